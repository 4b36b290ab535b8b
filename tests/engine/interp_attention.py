"""The paged decode-attention kernels (model/kernels.py: one pass per (row, KV head), and the
split-context flash-decoding pair) against ops.paged_attention, on CPU under Triton's interpreter
(run by test_triton_interpreted.py in a process of its own); compiled on the GPU by
tests/engine/test_kernels.py."""
from __future__ import annotations

import pytest
import torch

from interp import interpreted, rel  # noqa: F401 (interpreted: an autouse fixture)
from pdrollout.engine.model import ops
from pdrollout.engine.model.kernels import MAX_KV_SPLITS, decode_attention, kv_splits_for
from pdrollout.engine.model.qwen3_moe import SeqSlice


def paged(ctx, block_size, h, kvh, d, dtype, seed):
    """Scattered blocks, a padding row last (length 0), and the fp64 reference per sequence."""
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-c // block_size) for c in ctx) + 2
    k = torch.randn(nblocks * block_size, kvh, d, generator=g).to(dtype)
    v = torch.randn(nblocks * block_size, kvh, d, generator=g).to(dtype)
    perm = torch.randperm(nblocks, generator=g).tolist()
    width = max(-(-c // block_size) for c in ctx) + 1   # wider than any row: as a graph's table
    bt = torch.zeros(len(ctx) + 1, width, dtype=torch.int32)
    seqs, at = [], 0
    for i, c in enumerate(ctx):
        n = -(-c // block_size)
        bt[i, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
        pos = torch.arange(c)
        seqs.append(SeqSlice(i, 1, c, bt[i].long()[pos // block_size] * block_size + pos % block_size))
    q = torch.randn(len(ctx) + 1, h, d, generator=g).to(dtype)
    lens = torch.tensor(ctx + [0], dtype=torch.int32)
    ref = ops.paged_attention(q[:-1].double(), k.double(), v.double(), seqs, d ** -0.5)
    return q, k, v, bt, lens, ref


@pytest.mark.parametrize("splits", [1, 2, 3, 16, 32, "auto"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_attention_matches_the_reference(splits, dtype, tol):
    """Lengths below one tile, at block edges, and longer than a split's slice; 3 splits of a
    130-token row leave slices of 64, 64 and 2; 16 splits leave most slices of short rows empty; 32
    is past the merge's one-compile width (a second compile, same result)."""
    ctx = [1, 15, 16, 17, 130, 300]
    q, k, v, bt, lens, ref = paged(ctx, 16, 8, 2, 32, dtype, seed=len(ctx))
    out = decode_attention(q, k, v, bt, lens, 16, 32 ** -0.5, kv_splits=splits)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all() and out[-1].abs().max() == 0   # the padding row: zeros
    assert rel(out[:-1], ref) < tol


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_attention_writes_into_the_rows_it_is_given(splits):
    """`out`: the decode rows of a layer's output (PagedAttention's o[:nd]), written in place; the
    rows past them (a step's prefill rows) are left as they were."""
    q, k, v, bt, lens, ref = paged([40, 130], 16, 4, 2, 16, torch.float32, seed=5)
    o = torch.full((q.shape[0] + 2, 4, 16), 7.0)
    got = decode_attention(q, k, v, bt, lens, 16, 0.25, kv_splits=splits, out=o[:q.shape[0]])
    assert got.data_ptr() == o.data_ptr()
    assert torch.equal(o[:q.shape[0]], decode_attention(q, k, v, bt, lens, 16, 0.25, kv_splits=splits))
    assert (o[q.shape[0]:] == 7.0).all()


def test_splits_agree_with_one_pass_in_fp32():
    """The merge is exact up to fp32 rounding: 4 splits against one pass over the same tiles."""
    q, k, v, bt, lens, _ = paged([70, 200], 16, 4, 1, 16, torch.float32, seed=3)
    one = decode_attention(q, k, v, bt, lens, 16, 0.25, kv_splits=1)
    four = decode_attention(q, k, v, bt, lens, 16, 0.25, kv_splits=4)
    assert (one - four).abs().max().item() < 1e-5


def test_split_count_from_shapes():
    # the 30B-A3B decode batch on an H200: 64 rows × 4 KV heads = 256 programs fill 132 SMs: one pass;
    # 32 rows: 128 programs → 2 splits (the two the sweep measured fastest there)
    assert kv_splits_for(64, 4, 32768, 132) == 1
    assert kv_splits_for(32, 4, 2048, 132) == 2
    assert kv_splits_for(1, 4, 32768, 132) == MAX_KV_SPLITS           # one row: capped
    assert kv_splits_for(1, 4, 100, 132, tile=64) == 2                 # no slice under one tile
    assert kv_splits_for(1, 4, 100, 132) == 1
    assert kv_splits_for(512, 8, 32768, 132) == 1                      # enough programs already
