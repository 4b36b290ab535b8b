"""Greedy outputs equal transformers' Qwen3MoeForCausalLM.generate on the same random checkpoint,
in every planner mode, for prompts of different lengths and for multi-turn prefix reuse."""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import tiny_config
from hf_reference import PROMPTS, assert_matches_reference, drain, hf_greedy, run_all
from pdrollout.engine.model.checkpoint import write_checkpoint
from pdrollout.engine.protocol.config import ControlSettings, EngineConfig
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.scheduler.request import SamplingParams

MODES = ["normal", "mixed", "pd"]

# Configs covering: both expert layouts, norm_topk_prob both ways, decoder_sparse_step > 1,
# a dense layer in mlp_only_layers, tied embeddings, attention bias.
VARIANTS = {
    "per-expert": (tiny_config(), "per-expert"),
    "fused-sparse-step": (tiny_config(norm_topk_prob=False, decoder_sparse_step=2, num_hidden_layers=4), "fused"),
    "dense-layer-tied": (tiny_config(mlp_only_layers=[1], tie_word_embeddings=True, attention_bias=True), "per-expert"),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant_model(request, tmp_path_factory):
    cfg, layout = VARIANTS[request.param]
    return write_checkpoint(cfg, tmp_path_factory.mktemp(request.param), seed=1, layout=layout)


def engine_for(model_dir, mode, **kw) -> Engine:
    # Small blocks and budgets so prefill is chunked, blocks span segments and modes really differ.
    control = ControlSettings(prefill_budget_tokens=kw.pop("budget", 24), span=kw.pop("span", "auto"))
    return Engine(EngineConfig(model=str(model_dir), mode=mode, block_size=4, num_blocks=kw.pop("num_blocks", 256),
                               mixed_chunk_tokens=20, control=control, **kw))


@pytest.mark.parametrize("mode", MODES)
def test_batch_matches_transformers(variant_model, mode):
    out = run_all(engine_for(variant_model, mode), PROMPTS, max_new=10, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        ref, margins = hf_greedy(variant_model, p, 10)
        assert_matches_reference(out[f"r{i}"], ref, margins, f"{mode} prompt {i} (len {len(p)})")


EOS_PROMPTS = [[(i * 13 + k) % 500 + 2 for i in range(5 + k)] for k in range(6)]
EOS_MAX_NEW = 24


@pytest.fixture(scope="module")
def eos_model(tiny_model, tmp_path_factory):
    """The tiny checkpoint with eos_token_id set to tokens of transformers' own greedy paths (prompt
    k's token at step 2 + 2k), so greedy decoding of every prompt reaches EOS before the length limit."""
    eos = []
    for k, p in enumerate(EOS_PROMPTS):
        path, _ = hf_greedy(tiny_model, p, EOS_MAX_NEW)
        eos.append(path[2 + 2 * k])
    out = tmp_path_factory.mktemp("tiny-eos") / "model"
    shutil.copytree(tiny_model, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "eos_token_id": sorted(set(eos))}))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_stops_at_eos_like_transformers(eos_model, mode):
    eos = set(json.loads((eos_model / "config.json").read_text())["eos_token_id"])
    engine = engine_for(eos_model, mode)
    for i, p in enumerate(EOS_PROMPTS):
        engine.submit(f"r{i}", p, SamplingParams(max_new_tokens=EOS_MAX_NEW, temperature=0.0))
    out, reasons = drain(engine)
    for i, p in enumerate(EOS_PROMPTS):
        ref, margins = hf_greedy(eos_model, p, EOS_MAX_NEW, stop_at_eos=True)
        assert len(ref) < EOS_MAX_NEW and ref[-1] in eos, f"the reference must stop on EOS: {ref}"
        assert out[f"r{i}"] == ref, f"{mode} eos prompt {i}: ours {out[f'r{i}']}, transformers {ref}"
        assert reasons[f"r{i}"] == {"type": "stop", "matched": ref[-1]}, (mode, i, reasons[f"r{i}"])


@pytest.mark.parametrize("mode", MODES)
def test_multi_turn_reuses_prefix_and_matches(tiny_model, mode):
    engine = engine_for(tiny_model, mode)
    context: list[int] = []
    for turn, new in enumerate(([5, 17, 29, 41, 53, 65, 77, 89, 101], [200, 201, 202, 203, 204], [300, 301, 302])):
        prompt = context + new
        engine.submit(f"t{turn}", prompt, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
        ids, cached = [], None
        while engine.has_unfinished():
            for o in engine.step():
                ids.extend(o.new_token_ids)
                cached = o.cached_tokens
        ref, margins = hf_greedy(tiny_model, prompt, 8)
        assert_matches_reference(ids, ref, margins, f"{mode} turn {turn}")
        if turn > 0:
            # Everything but the partial last block of the previous context is reused.
            assert cached == (len(context) - 1) // 4 * 4 and cached > 0, (turn, cached, len(context))
        context = prompt + ids


def test_concurrent_continuations_share_prefix(tiny_model):
    """Two trajectories continuing the same context at once: both hit the cache and stay exact."""
    engine = engine_for(tiny_model, "pd")
    base = [(i * 7) % 500 + 2 for i in range(23)]
    first = run_all(engine, [base], max_new=5, ignore_eos=True)["r0"]
    ctx = base + first
    prompts = [ctx + [400, 401], ctx + [402]]
    for i, p in enumerate(prompts):
        engine.submit(f"c{i}", p, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    out, cached = {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
            cached[o.rid] = o.cached_tokens
    for i, p in enumerate(prompts):
        ref, margins = hf_greedy(tiny_model, p, 6)
        assert_matches_reference(out[f"c{i}"], ref, margins, f"continuation {i}")
        assert cached[f"c{i}"] >= 24
