"""Paged prefill attention (model/paged_prefill.py) against ops.paged_attention, on CPU under Triton's
interpreter (run by test_triton_interpreted.py in a process of its own); compiled on the GPU by
tests/engine/test_kernels.py."""
from __future__ import annotations

import pytest
import torch

from interp import interpreted, rel  # noqa: F401 (interpreted: an autouse fixture)
from pdrollout.engine.model import ops
from pdrollout.engine.model.paged_prefill import MAX_SPLITS, TILES, paged_prefill_attention, plan_tiles, walk_splits
from pdrollout.engine.model.qwen3_moe import SeqSlice


def segments(shapes, block_size, h, kvh, d, dtype, seed):
    """(new tokens, context) per segment, their context in scattered cache blocks; q packed."""
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-c // block_size) for _, c in shapes) + 3
    k = torch.randn(nblocks * block_size, kvh, d, generator=g).to(dtype)
    v = torch.randn(nblocks * block_size, kvh, d, generator=g).to(dtype)
    perm = torch.randperm(nblocks, generator=g)
    seqs, start, at = [], 0, 0
    for n, c in shapes:
        blocks = perm[at:at + -(-c // block_size)]
        at += len(blocks)
        pos = torch.arange(c)
        seqs.append(SeqSlice(start, n, c, blocks[pos // block_size] * block_size + pos % block_size))
        start += n
    q = torch.randn(start, h, d, generator=g).to(dtype)
    return q, k, v, seqs


# fresh prompts (q_len == ctx), continuations over a cached prefix, one new token, and a segment of
# more than two query tiles
BLOCK_M = TILES["block_m"]   # query rows per program
SHAPES = [(37, 37), (20, 90), (1, 70), (2 * BLOCK_M + 5, 2 * BLOCK_M + 40), (3, 3)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kvh", [1, 2, 8])   # GQA groups of 8, 4 and 1
def test_paged_prefill_matches_the_reference(dtype, tol, kvh):
    q, k, v, seqs = segments(SHAPES, 16, 8, kvh, 32, dtype, seed=kvh)
    out = paged_prefill_attention(q, k, v, seqs, 32 ** -0.5)
    ref = ops.paged_attention(q.double(), k.double(), v.double(), seqs, 32 ** -0.5)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel(out, ref) < tol
    for s in seqs:   # per segment too: a wrong slot offset would hide in the whole
        rows = slice(s.q_start, s.q_start + s.q_len)
        assert rel(out[rows], ref[rows]) < tol


def test_rows_outside_the_segments_are_left_alone():
    """Decode rows come first in a mixed batch (the decode kernel writes them): prefill writes only its rows."""
    q, k, v, seqs = segments([(5, 30), (7, 7)], 16, 4, 2, 16, torch.float32, seed=1)
    shifted = [SeqSlice(s.q_start + 3, s.q_len, s.ctx_len, s.slots) for s in seqs]
    qq = torch.cat([torch.randn(3, 4, 16), q])
    out = torch.full_like(qq, 7.0)
    paged_prefill_attention(qq, k, v, shifted, 0.25, out=out, plan=plan_tiles(shifted, qq.device))
    assert (out[:3] == 7.0).all()
    ref = ops.paged_attention(qq, k, v, shifted, 0.25)
    assert rel(out[3:], ref[3:]) < 1e-5


def test_tiles_cover_each_segment_once():
    _, _, _, seqs = segments(SHAPES, 16, 2, 1, 16, torch.float32, seed=0)
    slots, tiles, splits = plan_tiles(seqs, torch.device("cpu"))
    assert splits == 1   # the CPU's walks are never split unless asked
    assert slots.shape[0] == sum(s.ctx_len for s in seqs)
    assert int(tiles[:, 1].sum()) == sum(s.q_len for s in seqs)
    assert tiles.shape[0] == sum(-(-s.q_len // BLOCK_M) for s in seqs)
    assert all(int(t[3]) == int(t[2]) + int(t[1]) for t in tiles)   # the last row sees itself
    ends = tiles[:, 3].tolist()
    assert ends == sorted(ends, reverse=True)   # the longest walks start first


@pytest.mark.parametrize("tiles", [dict(block_m=32, block_n=16), dict(block_m=16, block_n=32)])
def test_other_tile_shapes_match_the_reference(tiles):
    """The sweep's shapes (e2e/gpu/attn_kernels.py): a plan made with the launch's block_m; blocks
    before a tile's first row skip the causal mask, the rest apply it."""
    q, k, v, seqs = segments(SHAPES + [(9, 200)], 16, 4, 2, 32, torch.float32, seed=3)
    out = paged_prefill_attention(q, k, v, seqs, 32 ** -0.5, tiles=tiles)
    ref = ops.paged_attention(q.double(), k.double(), v.double(), seqs, 32 ** -0.5)
    assert rel(out, ref) < 1e-5
    plan = plan_tiles(seqs, q.device, tiles["block_m"])
    assert torch.equal(paged_prefill_attention(q, k, v, seqs, 32 ** -0.5, plan=plan, tiles=tiles), out)


def test_a_model_through_the_paged_prefill_equals_the_reference(monkeypatch):
    """Every layer's prefill attention through the kernel (PagedAttention, `prefill_attention:
    triton`): the reference's fp32 logits, with one tile plan for all the layers."""
    from conftest import tiny_prompt_forward
    from pdrollout.engine.model import paged_prefill
    from pdrollout.engine.model.backends import REFERENCE, Backends, PagedAttention
    plans = []
    monkeypatch.setattr(paged_prefill, "plan_tiles", lambda *a, **k: plans.append(1) or plan_tiles(*a, **k))
    ref = tiny_prompt_forward(REFERENCE)
    got = tiny_prompt_forward(Backends(PagedAttention("torch", prefill="triton"), REFERENCE.experts))
    assert rel(got, ref) < 1e-5 and len(plans) == 1


@pytest.mark.parametrize("setting,splits", [("auto", 1), (3, 3)])   # auto: 1 on the CPU (its one "SM")
def test_prefill_kv_splits_reaches_the_launch_and_a_split_model_equals_the_reference(monkeypatch, setting, splits):
    """EngineConfig.prefill_kv_splits through PagedAttention: every layer's walks in that many
    stretches, the reference's fp32 logits either way."""
    from conftest import tiny_prompt_forward
    from pdrollout.engine.model import paged_prefill
    from pdrollout.engine.model.backends import REFERENCE, Backends, PagedAttention
    from pdrollout.engine.protocol.config import EngineConfig
    plans = []
    monkeypatch.setattr(paged_prefill, "plan_tiles", lambda *a, **k: plans.append(plan_tiles(*a, **k)) or plans[-1])
    ref = tiny_prompt_forward(REFERENCE)
    got = tiny_prompt_forward(Backends(PagedAttention("torch", prefill="triton", prefill_splits=setting),
                                       REFERENCE.experts))
    assert rel(got, ref) < 1e-5 and [p.splits for p in plans] == [splits]
    assert EngineConfig(model="m", prefill_kv_splits=setting).prefill_kv_splits == setting
    for bad in (0, 17, "many"):
        with pytest.raises(ValueError):
            EngineConfig(model="m", prefill_kv_splits=bad)


def test_hybrid_sends_only_long_fresh_prompts_to_sdpa(monkeypatch):
    """`prefill_attention: hybrid`: a step whose segments are all fresh prompts of at least
    SDPA_FRESH_MIN_TOKENS, at most SDPA_FRESH_MAX_TOKENS in all, runs the fresh-prompt SDPA path (no
    tile plan), any other step the paged launch; both equal the reference."""
    from conftest import tiny_prompt_forward
    from pdrollout.engine.model import backends, kernels, paged_prefill
    from pdrollout.engine.model.backends import REFERENCE, Backends, PagedAttention
    from pdrollout.engine.model.qwen3_moe import SeqSlice
    fresh, cont = SeqSlice(0, 9, 9, None), SeqSlice(9, 4, 20, None)
    monkeypatch.setattr(backends, "SDPA_FRESH_MIN_TOKENS", 9)
    assert backends.sdpa_wins([fresh]) and not backends.sdpa_wins([fresh, cont])
    monkeypatch.setattr(backends, "SDPA_FRESH_MAX_TOKENS", 17)   # two such prompts: over the cap
    assert backends.sdpa_wins([fresh]) and not backends.sdpa_wins([fresh, SeqSlice(9, 9, 9, None)])
    monkeypatch.setattr(backends, "SDPA_FRESH_MIN_TOKENS", 10)
    assert not backends.sdpa_wins([fresh])
    ref = tiny_prompt_forward(REFERENCE)
    for bound, path in ((9, "sdpa"), (10, "triton")):   # the prompt is 9 fresh tokens
        monkeypatch.setattr(backends, "SDPA_FRESH_MIN_TOKENS", bound)
        ran = []
        monkeypatch.setattr(paged_prefill, "plan_tiles", lambda *a, **k: ran.append("triton") or plan_tiles(*a, **k))
        sdpa = kernels.fresh_prefill_attention   # cuDNN on the GPU; SDPA's CPU backend here
        monkeypatch.setattr(kernels, "fresh_prefill_attention", lambda *a, **k: ran.append("sdpa") or sdpa(*a, **k))
        got = tiny_prompt_forward(Backends(PagedAttention("torch", prefill="hybrid"), REFERENCE.experts))
        assert rel(got, ref) < 1e-5
        assert set(ran) == {path}, (bound, ran)


# a fresh prompt (its first rows see only the first keys: later stretches mask them whole), a
# continuation over a long context, one new token, and a segment of more than one tile
SPLIT_SHAPES = [(40, 40), (20, 300), (1, 170), (BLOCK_M + 9, BLOCK_M + 60)]


@pytest.mark.parametrize("dtype,tol,splits", [(torch.float32, 1e-5, 2), (torch.float32, 1e-5, 3),
                                              (torch.float32, 1e-5, 7), (torch.bfloat16, 2e-2, 3)])
def test_walks_split_along_the_context_match_the_reference(dtype, tol, splits):
    """Each stretch's softmax state, merged: the reference's output, and the unsplit launch's."""
    tiles = dict(block_n=16)
    q, k, v, seqs = segments(SPLIT_SHAPES, 16, 8, 2, 32, dtype, seed=splits)
    plan = plan_tiles(seqs, q.device, TILES["block_m"], splits=splits)
    assert plan.splits == splits
    out = paged_prefill_attention(q, k, v, seqs, 32 ** -0.5, plan=plan, tiles=tiles)
    ref = ops.paged_attention(q.double(), k.double(), v.double(), seqs, 32 ** -0.5)
    assert torch.isfinite(out).all()
    for s in seqs:
        rows = slice(s.q_start, s.q_start + s.q_len)
        assert rel(out[rows], ref[rows]) < tol
    whole = paged_prefill_attention(q, k, v, seqs, 32 ** -0.5, plan=plan_tiles(seqs, q.device, splits=1), tiles=tiles)
    assert rel(out, whole) < tol


def test_walks_split_only_while_tiles_leave_sms_idle():
    assert walk_splits(programs=132, longest=8192, sms=132, block_n=128) == 1     # every SM busy already
    assert walk_splits(programs=32, longest=2176, sms=132, block_n=128) == 5      # ceil(132 / 32)
    assert walk_splits(programs=32, longest=300, sms=132, block_n=128) == 1       # stretches of 2+ blocks
    assert walk_splits(programs=1, longest=1 << 20, sms=132, block_n=128) == MAX_SPLITS
