"""pd on one rank with `solo_overlap`: a P epoch on its own thread while the next steps' D goes on
(runtime/solo_p.py), against transformers, with the step log showing the epochs span D steps."""
from __future__ import annotations

import json
import time

import pytest

from hf_reference import PROMPTS, assert_matches_reference, hf_greedy, run_all
from pdrollout.engine.protocol.config import SOLO_FUSE_TOKENS_CUDA, ControlSettings, EngineConfig
from pdrollout.engine.protocol.plan import Phase
from pdrollout.engine.protocol.topology import Topology
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.runtime.options import RankOptions
from pdrollout.engine.runtime.worker import Worker

P_DELAY_S = 0.05    # each P forward takes this much longer: D steps (milliseconds here) go on meanwhile


FUSE = 16    # the hybrid case: a step whose P is at most this many tokens (here every P+D step's) runs fused


@pytest.mark.parametrize("overlap,fuse", [(True, 0), (False, 0), (True, FUSE)])
def test_p_epochs_span_d_steps_on_one_rank_and_outputs_equal_transformers(tiny_model, tmp_path, overlap, fuse):
    cfg = EngineConfig(model=str(tiny_model), mode="pd", block_size=4, num_blocks=256, mixed_chunk_tokens=20,
                       control=ControlSettings(prefill_budget_tokens=64, span=4, activation="on"),
                       solo_overlap=overlap, solo_fuse_tokens=fuse)
    worker = Worker(cfg, Topology(1), 0, options=RankOptions(step_log=str(tmp_path)))
    forward = worker.forward

    def slow_p(phase, plan, pick, **kw):
        if phase in (Phase.PREFILL, Phase.MIXED):
            time.sleep(P_DELAY_S)
        return forward(phase, plan, pick, **kw)
    worker.forward = slow_p
    epoch_steps = set()   # the steps whose P went to an epoch (one that ends inside its step too)
    if worker.solo is not None:
        epoch = worker.solo._epoch
        worker.solo._epoch = lambda plan, planned: epoch_steps.add(plan.step) or epoch(plan, planned)
    engine = Engine(cfg, worker)
    out = run_all(engine, PROMPTS, max_new=10, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        ref, margins = hf_greedy(tiny_model, p, 10)
        assert_matches_reference(out[f"r{i}"], ref, margins, f"solo_overlap={overlap} prompt {i}")
    steps = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    started = [s["step"] for s in steps if s["p_pending"]]
    finished = [s["p_done"] for s in steps if s["p_done"] is not None]
    during = [s for s in steps if s["p_flight"] is not None]
    # the records say which steps ran beside an epoch (/metrics' decode_step_beside_p_seconds)
    assert [r.step for r in engine.records if r.p_beside] == [s["step"] for s in during]
    if not overlap:   # one fused P+D forward per step
        assert not started and not finished and not during
        return
    both = [s for s in steps if s["step"] > 0 and s["prefill_tokens"] and s["decode_rows"]]
    fused = [s for s in both if s["step"] not in epoch_steps]
    if fuse:   # small P rode in D's step; an epoch only for a larger P (the wait bound's whole budget)
        assert fused and all(s["prefill_tokens"] <= fuse for s in fused), fused
        assert all(s["prefill_tokens"] > fuse for s in both if s["step"] in epoch_steps)
        assert finished == started
        return
    assert both and not fused
    assert started and finished == started, (started, finished)   # each epoch finishes once, in order
    assert all(s["prefill_tokens"] == 0 for s in during)          # no P planned while one is in flight
    assert sum(s["decode_rows"] > 0 for s in during) >= len(started)   # D went on beside every epoch
    for s in during:
        assert max(x for x in started if x < s["step"]) == s["p_flight"]
    # Each epoch is timed on its thread: the P tokens of every step that started one, and its
    # time split into issuing (here the 50 ms sleep, which is no CPU time) and the rest.
    epochs = [r.p_epoch for r in engine.records if r.p_epoch is not None]
    assert len(epochs) >= len(started)
    assert sum(e.tokens for e in epochs) == sum(r.prefill_tokens for r in engine.records if r.decode_rows)
    for e in epochs:
        assert e.tokens > 0 and e.wall_s >= e.enqueue_s >= P_DELAY_S, e
        assert e.cpu_s < e.enqueue_s - 0.8 * P_DELAY_S, e


@pytest.mark.parametrize("mode,overlap,bound,want", [("pd", True, None, 200.0), ("pd", True, 50.0, 50.0),
                                                      ("pd", False, None, None), ("mixed", True, None, None)])
def test_the_ttft_bound_is_on_by_default_only_where_p_epochs_run_beside_d(tiny_model, mode, overlap, bound, want):
    cfg = EngineConfig(model=str(tiny_model), mode=mode, block_size=4, num_blocks=64, solo_overlap=overlap,
                       control=ControlSettings(p_wait_bound_ms=bound))
    assert Engine(cfg).control.p_wait_bound_ms == want


@pytest.mark.parametrize("overlap,given,want", [(True, None, True), (True, False, False), (False, None, None)])
def test_a_burst_runs_alone_by_default_only_where_p_epochs_run_beside_d(tiny_model, overlap, given, want):
    cfg = EngineConfig(model=str(tiny_model), mode="pd", block_size=4, num_blocks=64, solo_overlap=overlap,
                       control=ControlSettings(p_burst_first=given))
    assert Engine(cfg).control.p_burst_first is want


@pytest.mark.parametrize("given,cuda,cpu", [(None, SOLO_FUSE_TOKENS_CUDA, 0), (0, 0, 0), (64, 64, 64)])
def test_small_p_rides_in_ds_step_by_default_only_on_cuda(tiny_model, given, cuda, cpu):
    cfg = EngineConfig(model=str(tiny_model), mode="pd", solo_fuse_tokens=given)
    assert (cfg.solo_fuse_tokens_on("cuda"), cfg.solo_fuse_tokens_on("cpu")) == (cuda, cpu)
    assert Engine(cfg.model_copy(update={"solo_overlap": True, "block_size": 4, "num_blocks": 64}))._solo_fuse_tokens == cpu


def test_prefill_warmup_runs_every_size_and_changes_no_output(tiny_model, capfd):
    """The warm-up (on by default on one CUDA rank) writes KV blocks no request holds yet and samples
    nothing: the requests after it equal transformers' and the pool is whole again."""
    cfg = EngineConfig(model=str(tiny_model), mode="pd", block_size=4, num_blocks=256, prefill_warmup=True,
                       mixed_chunk_tokens=20, control=ControlSettings(prefill_budget_tokens=64))
    engine = Engine(cfg)
    # 1, 9 (the tiny model's top-2: the first pairs laid out), 37, the budget, then a continuation over
    # the cached context that fits (896 of 1,024 slots)
    assert "prefill warm-up: 5 steps up to 64 tokens" in capfd.readouterr().err
    assert engine.warm_prefill((3, 70)) == 2
    assert engine.stats()["kv_blocks_used"] == 0 and engine.step_id == 1
    out = run_all(engine, PROMPTS, max_new=6, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        ref, margins = hf_greedy(tiny_model, p, 6)
        assert_matches_reference(out[f"r{i}"], ref, margins, f"after the warm-up, prompt {i}")


def test_priority_stream_names_a_phase_and_needs_no_green_context():
    """The stream priority is start-time config: a phase or nothing, and not with an SM partition,
    whose green-context streams have one priority (said before any CUDA call)."""
    import torch
    from pydantic import ValidationError

    from pdrollout.engine.runtime.streams import make_streams
    with pytest.raises(ValidationError, match="priority_stream"):
        EngineConfig(model="m", priority_stream="high")
    # unset: D's stream first on one rank (measured at P1), equal on several (not measured there)
    assert EngineConfig(model="m").priority_stream_on(multi=False) == "d"
    assert EngineConfig(model="m").priority_stream_on(multi=True) is None
    assert EngineConfig(model="m", priority_stream="none").priority_stream_on(multi=False) is None
    assert EngineConfig(model="m", priority_stream="d").priority_stream_on(multi=True) == "d"
    with pytest.raises(ValueError, match="sm_partition"):
        make_streams(torch.device("cuda", 0), 8, "d")


def test_an_idle_engine_holds_a_burst_of_arrivals_and_prefills_it_in_one_step(tiny_model):
    """p_idle_gather_ms: arrivals to an idle pd engine wait while they keep coming (the scheduler's
    clock here is a virtual one), then run in one step; outputs still equal transformers'."""
    from pdrollout.engine.scheduler.policy import IDLE_QUIET_MS
    from pdrollout.engine.scheduler.request import SamplingParams
    engine = Engine(EngineConfig(model=str(tiny_model), mode="pd", block_size=4, num_blocks=256,
                                 p_idle_gather_ms=50.0))
    now = [100.0]
    engine.schedulers[0].clock = lambda: now[0]
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    engine.submit("r0", PROMPTS[0], sp)
    now[0] += 0.0005
    ran = len(engine.records)
    assert engine.step() == [] and len(engine.records) == ran        # held: nothing ran
    assert engine.hold_until == pytest.approx(100.0 + IDLE_QUIET_MS / 1e3)
    now[0] += 0.0005
    engine.submit("r1", PROMPTS[1], sp)                                # the burst goes on
    now[0] += 0.0015
    assert engine.step() == [] and engine.hold_until == pytest.approx(100.001 + IDLE_QUIET_MS / 1e3)
    now[0] += 0.001                                                    # quiet: both in one step
    outs = engine.step()
    assert engine.records[-1].prefill_tokens == len(PROMPTS[0]) + len(PROMPTS[1]) and engine.hold_until is None
    out = {}
    while True:
        for o in outs:
            out.setdefault(o.rid, []).extend(o.new_token_ids)
        if not engine.has_unfinished():
            break
        outs = engine.step()
    for i in (0, 1):
        ref, margins = hf_greedy(tiny_model, PROMPTS[i], 6)
        assert_matches_reference(out[f"r{i}"], ref, margins, f"a held burst, prompt {i}")
