"""Issue 2's CUDA equality: greedy outputs on CUDA (fp32, decode CUDA graphs on, all three modes)
equal transformers' on the same checkpoint. GPU machine only (`gpu` marker)."""
from __future__ import annotations

import pytest
import torch

from hf_reference import assert_matches_reference, hf_greedy
from pdrollout.engine.protocol.config import ControlSettings, EngineConfig
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.scheduler.request import SamplingParams
from tests.engine.test_speculative import run_all, run_logprobs

pytestmark = pytest.mark.gpu
PROMPTS = [[7], [3, 9, 27, 81, 243, 217, 139], list(range(10, 26)), [(i * 37) % 500 + 2 for i in range(41)],
           [(i * 11) % 509 + 2 for i in range(70)]]


@pytest.mark.parametrize("mode", ["normal", "mixed", "pd"])
def test_cuda_greedy_matches_transformers(tiny_model, mode):
    e = Engine(EngineConfig(model=str(tiny_model), device="cuda", dtype="float32", mode=mode, block_size=4,
                            num_blocks=512, max_running=8, mixed_chunk_tokens=20,
                            control=ControlSettings(prefill_budget_tokens=24)))
    assert e.worker.graphs is not None and e.worker.p_graphs is not None
    out, _ = run_all(e, PROMPTS, max_new_tokens=12, ignore_eos=True)
    assert e.worker.p_graphs.replays > 0   # P forwards replayed their pieces (prefill_graphs.py)
    for i, p in enumerate(PROMPTS):
        ref, margins = hf_greedy(tiny_model, p, 12)
        assert_matches_reference(out[f"r{i}"], ref, margins, f"cuda {mode} prompt {i}")


@pytest.mark.parametrize("kernels,priority", [("fused", "d"), ("auto", None), ("auto", "none")])
def test_cuda_fused_kernels_and_solo_overlap_match_transformers(tiny_model, kernels, priority):
    """The fused Triton experts, prologue, residual add + norm and routing (fp32: IEEE dots), and pd's P
    epoch on its own stream beside D's graph replays (solo_overlap, on by default on CUDA; every P an
    epoch: these prompts are under the default fuse bound; D's stream at high priority, set or by
    default on one rank, or equal), inside the margin rule."""
    e = Engine(EngineConfig(model=str(tiny_model), device="cuda", dtype="float32", mode="pd", block_size=4,
                            num_blocks=512, max_running=8, experts_kernel=kernels, qk_prologue=kernels,
                            add_norm=kernels, router=kernels, priority_stream=priority, solo_fuse_tokens=0,
                            control=ControlSettings(prefill_budget_tokens=24, activation="on")))
    assert e.worker.solo is not None
    p, d = e.worker.streams["p"].priority, e.worker.streams["d"].priority
    assert {"d": d < p, None: d < p, "none": p == d}[priority], (p, d)
    spans = []   # after each step: a P epoch outlives the step that started it
    out, _ = run_all(e, PROMPTS, lambda e: spans.append(e._flight is not None or e.worker.solo.flight is not None),
                     max_new_tokens=12, ignore_eos=True)
    assert any(spans), "no P epoch ran beside D"
    assert e.worker.p_graphs.replays > 0   # the epochs replayed P's pieces on P's stream
    for i, p in enumerate(PROMPTS):
        ref, margins = hf_greedy(tiny_model, p, 12)
        assert_matches_reference(out[f"r{i}"], ref, margins, f"cuda {kernels} kernels, solo_overlap, prompt {i}")


@pytest.mark.parametrize("mode", ["mixed", "pd"])
def test_cuda_served_steps_compile_no_kernel_after_the_warm_up(tiny_model, mode):
    """bf16 on the fused kernels (`auto`), the prefill warm-up on by default: prompts of many lengths
    arriving while others decode (fused P+D steps, P epochs, decode batches and block tables of
    changing size) compile no Triton kernel in a served step (runtime/jit_watch.py)."""
    e = Engine(EngineConfig(model=str(tiny_model), device="cuda", dtype="bfloat16", mode=mode, block_size=16,
                            num_blocks=4096, max_running=16, mixed_chunk_tokens=2048,
                            control=ControlSettings(prefill_budget_tokens=4096)))
    from pdrollout.engine.runtime.jit_watch import install
    assert e.worker.compiles is install() is not None and type(e.worker.backends.experts).__name__ == "AutoExperts"
    lengths = (1, 3, 17, 250, 1023, 1025, 2049, 3001, 31, 4000, 2, 999)
    for i, n in enumerate(lengths):
        e.submit(f"r{i}", [(j * 7 + n) % 500 + 2 for j in range(n)],
                 SamplingParams(temperature=0.0, max_new_tokens=6 + i % 5, ignore_eos=True))
        for _ in range(i % 3 + 1):   # a few steps before the next arrival: it joins running decodes
            e.step()
    while e.has_unfinished():
        e.step()
    served = [r for r in e.records if r.decode_rows or r.prefill_tokens]
    assert sum(r.prefill_tokens for r in served) >= sum(lengths)
    assert [(r.step, r.prefill_tokens, r.decode_rows) for r in served if r.jit_compiles] == []


@pytest.mark.parametrize("mode", ["normal", "pd"])
def test_cuda_long_fresh_prompts_run_on_cudnn_by_default_in_bf16(tiny_model, mode, monkeypatch):
    """bf16's default prefill attention is `hybrid`: a served step of long fresh prompts runs cuDNN SDPA
    (kernels.fresh_prefill_attention; the shapes under its cap warmed at start, not the budget's) and
    the tokens agree with the paged launch's (`triton`) in the same dtype: equal, or apart only after
    a near-tie, where the chosen tokens' logprobs are within bf16 noise of each other."""
    from pdrollout.engine.model import kernels
    from pdrollout.engine.model.backends import SDPA_FRESH_MAX_TOKENS, SDPA_FRESH_MIN_TOKENS
    from pdrollout.engine.model.kernels import fresh_shapes
    from pdrollout.engine.runtime import warmup
    real, calls = kernels.fresh_prefill_attention, []
    monkeypatch.setattr(kernels, "fresh_prefill_attention",
                        lambda q, k, v, seqs, *a, **kw: calls.append(len(seqs)) or real(q, k, v, seqs, *a, **kw))
    warm, built = warmup.warm_fresh_attention, []   # the shapes the start builds (the warm-up's steps run others)
    monkeypatch.setattr(warmup, "warm_fresh_attention", lambda *a, **kw: built.append(warm(*a, **kw)) or built[-1])
    prompts = [[(j * 7 + n) % 500 + 2 for j in range(n)] for n in (2048, 2300, 3000)]
    runs = {}
    for setting in ("auto", "triton"):
        calls.clear()
        built.clear()
        e = Engine(EngineConfig(model=str(tiny_model), device="cuda", dtype="bfloat16", mode=mode, block_size=16,
                                num_blocks=2048, max_running=8, mixed_chunk_tokens=16384, prefill_attention=setting,
                                control=ControlSettings(prefill_budget_tokens=16384)))
        assert e.worker.backends.attention.prefill == {"auto": "hybrid", "triton": "triton"}[setting]
        warmed, calls[:] = len(calls), []
        toks, lps = run_logprobs(e, prompts, max_new_tokens=6, ignore_eos=True)
        if setting == "auto":   # every fresh shape up to the cap (not the budget) at start, then the prompts'
            assert built == [len(fresh_shapes(SDPA_FRESH_MAX_TOKENS, SDPA_FRESH_MIN_TOKENS))] == [22], built
            assert warmed > 22 and calls and max(calls) >= 2, (warmed, calls)   # the warm-up's steps of <= 8k too
        else:
            assert built == [] and warmed == 0 and calls == []
        runs[setting] = toks, lps
    (th, lh), (tt, lt) = runs["auto"], runs["triton"]
    for rid in th:
        assert len(th[rid]) == len(tt[rid]) == 6
        for i, (a, b) in enumerate(zip(th[rid], tt[rid])):
            assert abs(lh[rid][i] - lt[rid][i]) < 0.05, (rid, i, th[rid], tt[rid], lh[rid], lt[rid])
            if a != b:   # a near-tie (both tokens about as likely under the two launches): apart after it
                break


SPEC_PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [(i * 7) % 24 for i in range(11)] * 2, [3, 1, 4, 1, 5, 9, 2, 6]]


def _spec_greedy(model, mode: str, proposer: str, k: int, **config):
    """Greedy tokens (fp32 on CUDA) and step records, with `proposer` drafting k tokens (k 0: off)."""
    spec = {"speculative": proposer, "speculative_k": k} if k else {}
    e = Engine(EngineConfig(model=str(model), device="cuda", dtype="float32", mode=mode, block_size=4,
                            num_blocks=256, max_running=4, mixed_chunk_tokens=20, **spec, **config,
                            control=ControlSettings(prefill_budget_tokens=24)))
    return run_all(e, SPEC_PROMPTS, max_new_tokens=16, ignore_eos=True)[0], e.records


@pytest.mark.parametrize("mode", ["normal", "mixed", "pd"])
def test_cuda_verify_steps_replay_the_decode_graphs(tmp_path, mode):
    """n-gram speculation on CUDA (fp32): a verify step replays D's graphs, its k + 1 positions per
    row as one-token graph rows (graphs.py), and greedy tokens equal those without speculation."""
    from conftest import tiny_config
    from pdrollout.engine.model.checkpoint import write_checkpoint
    model = write_checkpoint(tiny_config(vocab_size=24), tmp_path, seed=0)   # loops: drafts accepted
    base, _ = _spec_greedy(model, mode, "ngram", 0)
    got, records = _spec_greedy(model, mode, "ngram", 3)
    assert got == base
    graphed = [r for r in records if r.spec_verify and r.graph]
    assert graphed, "no verify step replayed a graph"
    assert sum(r.spec_accepted for r in graphed) > 0, "no draft accepted on a graphed verify step"


@pytest.mark.parametrize("mode", ["normal", "pd"])
def test_cuda_mtp_verify_steps_replay_graphs_that_keep_hidden_states(tmp_path, mode):
    """`--speculative mtp` on CUDA (fp32): greedy tokens equal those without speculation; verify
    steps replay D's graphs, which hand the head the rows' hidden states: the head drafts exactly
    what it drafts from an eager D's hidden states (same proposals, same acceptances)."""
    from conftest import tiny_config
    from pdrollout.engine.model.checkpoint import write_checkpoint
    model = write_checkpoint(tiny_config(vocab_size=24, num_nextn_predict_layers=1), tmp_path, seed=0)
    base, _ = _spec_greedy(model, mode, "mtp", 0)
    got, records = _spec_greedy(model, mode, "mtp", 2)
    eager, eager_records = _spec_greedy(model, mode, "mtp", 2, cuda_graphs=False)
    assert got == base == eager
    graphed = [r for r in records if r.spec_verify and r.graph]
    assert graphed, "no verify step replayed a graph"
    assert not any(r.graph for r in eager_records)
    counts = lambda recs: (sum(r.spec_proposed for r in recs), sum(r.spec_accepted for r in recs))
    assert counts(records)[0] > 0 and counts(records) == counts(eager_records)


def test_cuda_sampling_draws_on_the_device_from_each_requests_seed(tiny_model):
    """Temperature 1 with top-p on CUDA: the requests' generators live on the device (no logits row
    goes to the host), and a seeded request's tokens are the same alone and beside other sampling
    requests (the batched exponential race: runtime/sampler.py)."""
    from pdrollout.engine.scheduler.request import SamplingParams

    def go(prompts):
        e = Engine(EngineConfig(model=str(tiny_model), device="cuda", dtype="float32", mode="pd", block_size=4,
                                num_blocks=512, max_running=8))
        for i, p in enumerate(prompts):
            e.submit(f"r{i}", p, SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=5 + i,
                                                ignore_eos=True))
        out: dict[str, list[int]] = {}
        devices = set()
        while e.has_unfinished():
            for o in e.step():
                out.setdefault(o.rid, []).extend(o.new_token_ids)
            devices |= {g.device.type for g in e.worker.gens.values()}
        assert devices == {"cuda"}, devices
        return out
    alone, together = go(PROMPTS[:1]), go(PROMPTS)
    assert len(alone["r0"]) == 12 and together["r0"] == alone["r0"]


def test_cuda_step_log_times_each_d_graph_replay_on_the_gpu(tiny_model, tmp_path):
    """The step log's d_gpu_s: a D-only graph step's replay on the GPU (CUDA events), inside the step's
    wall; None on steps that replayed no D graph (P-only ones)."""
    import json
    from pdrollout.engine.protocol.topology import Topology
    from pdrollout.engine.runtime.options import RankOptions
    from pdrollout.engine.runtime.worker import Worker
    cfg = EngineConfig(model=str(tiny_model), device="cuda", dtype="float32", mode="normal", block_size=4,
                       num_blocks=512, max_running=8, control=ControlSettings(prefill_budget_tokens=24))
    e = Engine(cfg, Worker(cfg, Topology(1), 0, options=RankOptions(step_log=str(tmp_path))))
    run_all(e, PROMPTS, max_new_tokens=12, ignore_eos=True)
    steps = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    d = [s for s in steps if s["graph"] and s["decode_rows"] and not s["prefill_tokens"]]
    assert d and all(0 < s["d_gpu_s"] <= s["wall_s"] for s in d), d[:3]
    assert all(s["d_gpu_s"] is None for s in steps if s["prefill_tokens"] and not s["decode_rows"])
