"""The fused Triton MoE (model/fused_moe.py) against ops.experts_reference, on CPU under Triton's
interpreter (TRITON_INTERPRET=1: the kernels' own code, run by numpy; test_triton_interpreted.py runs
this file in a process of its own); on the GPU,
tests/engine/test_kernels.py runs it compiled at the Qwen3-30B-A3B shape."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from interp import interpreted, rel  # noqa: F401 (interpreted: an autouse fixture)
from pdrollout.engine.model import ops
from pdrollout.engine.model.fused_moe import BLOCK_M, align, align_fused, align_spread, experts_fused


def _case(t, k, total, hidden, inter, num_local, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(num_local, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype)
    down = (torch.randn(num_local, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    w, ids = ops.route(torch.randn(t, total, generator=g), k, True, dtype)
    return x, ids, w, gate_up, down


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("t,k,total,num_local,offset", [
    (1, 8, 128, 128, 0),      # one decode row, every expert local
    (37, 4, 16, 16, 0),       # several rows per expert, partial last block
    (64, 8, 64, 16, 32),      # EP: a quarter of the experts here, the rest routed elsewhere (zero rows)
])
def test_fused_experts_match_the_reference(dtype, tol, t, k, total, num_local, offset):
    x, ids, w, gu, dn = _case(t, k, total, 96, 80, num_local, dtype, seed=t)   # H, I not multiples of the tiles
    out = experts_fused(x, ids, w, gu, dn, offset, block_n=32, block_k=32)
    ref = ops.experts_reference(x.double(), ids, w.double(), gu.double(), dn.double(), offset)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert rel(out, ref) < tol


def _blas_keeps_columns() -> bool:
    """Whether numpy's matmul gives an output column the same bits whatever the count of columns beside it."""
    g = np.random.default_rng(0)
    a, b = g.standard_normal((32, 32), dtype=np.float32), g.standard_normal((32, 64), dtype=np.float32)
    full = a @ b
    return all(np.array_equal(a @ b[:, i:i + n], full[:, i:i + n]) for n in (16, 32) for i in range(0, 64, n))


@pytest.mark.parametrize("tiles", [dict(group_m=3), dict(group_m=8, down_tiles=dict(block_n=64, group_m=2)),
                                   dict(down_tiles=dict(block_n=16, num_warps=8))])
def test_row_block_groups_and_downs_own_tiles_change_no_value(tiles):
    """The grid order (groups of row blocks, a group past the last block cut short) and down's column
    tiles move no product between sums: the output is the default launch's, bit for bit."""
    x, ids, w, gu, dn = _case(64, 8, 64, 96, 80, 16, torch.float32, seed=3)
    base = experts_fused(x, ids, w, gu, dn, 32, block_n=32, block_k=32)
    out = experts_fused(x, ids, w, gu, dn, 32, block_n=32, block_k=32, **tiles)
    if "down_tiles" in tiles and not _blas_keeps_columns():
        # the interpreter's tl.dot is numpy's matmul, whose sums inside a tile change with its column
        # count on some CPUs' BLAS (AMD EPYC's here): bits can differ without the kernel moving a product
        assert rel(out, base) < 1e-6
    else:
        assert torch.equal(out, base)
    assert rel(base, ops.experts_reference(x.double(), ids, w.double(), gu.double(), dn.double(), 32)) < 1e-6


def test_rows_with_no_local_expert_are_zero_and_empty_slots_are_skipped():
    x, ids, w, gu, dn = _case(6, 2, 8, 96, 80, 4, torch.float32, seed=9)
    foreign = experts_fused(x, torch.full_like(ids, 7), w, gu, dn, expert_offset=0)   # expert 7: not here
    assert torch.equal(foreign, torch.zeros_like(x))
    # what an expert all-to-all delivers: one local id per row, -1 for an empty slot
    one = torch.tensor([[2], [-1], [0], [2], [-1], [3]])
    ones = torch.ones(6, 1)
    out = experts_fused(x, one, ones, gu, dn)
    ref = ops.experts_reference(x.double(), one, ones.double(), gu.double(), dn.double())
    assert rel(out, ref) < 1e-6 and torch.equal(out[1], torch.zeros(96))


@pytest.mark.parametrize("t,k,total,num_local,offset", [
    (1, 8, 128, 128, 0),     # one decode row: the engine's default for it
    (2, 8, 16, 8, 4),        # EP: ids below and above this rank's 8 experts; experts shared by pairs
    (9, 4, 8, 8, 0),         # past DIRECT_MAX_PAIRS (forced): most experts read by several blocks
])
def test_each_pair_its_own_block_gives_the_laid_out_result(t, k, total, num_local, offset):
    """`direct` (no layout: block b is pair b) against the laid-out launch, bit for bit in fp32: each
    row of a tile is computed alone, so which rows share a tile moves nothing."""
    x, ids, w, gu, dn = _case(t, k, total, 96, 80, num_local, torch.float32, seed=t + k)
    ids[0, -1] = -1                                               # an empty slot from an all-to-all
    direct = experts_fused(x, ids, w, gu, dn, offset, block_n=32, block_k=32, direct=True)
    assert torch.equal(direct, experts_fused(x, ids, w, gu, dn, offset, block_n=32, block_k=32, direct=False))
    ref = ops.experts_reference(x.double(), ids, w.double(), gu.double(), dn.double(), offset)
    assert rel(direct, ref) < 1e-6


def test_align_places_each_owned_pair_once_in_its_experts_blocks():
    ids = torch.tensor([[3, 0], [3, 9], [1, 3], [0, 3]])          # expert 9 is another rank's
    sorted_ids, block_expert, blocks = align(ids, num_local=4, expert_offset=0)
    n = ids.numel()
    got = sorted_ids.view(blocks, BLOCK_M)
    flat = ids.flatten()
    seen = []
    for b in range(blocks):
        e = int(block_expert[b])
        pairs = [int(p) for p in got[b] if p < n]
        if e == 4:                                                  # past the end: nothing in it
            assert not pairs
            continue
        assert pairs and all(int(flat[p]) == e for p in pairs), (b, e, pairs)
        seen += pairs
    assert sorted(seen) == [p for p in range(n) if int(flat[p]) < 4]   # each owned pair exactly once
    assert sorted_ids.numel() == blocks * BLOCK_M and blocks >= 3      # experts 0, 1, 3: a block each


def test_align_counts_and_sorts_to_the_same_layout(monkeypatch):
    """Decode sizes count per expert instead of sorting; both ways give one layout."""
    import pdrollout.engine.model.fused_moe as fm
    ids = torch.randint(0, 40, (300, 8), generator=torch.Generator().manual_seed(1))
    counted = align(ids, num_local=32, expert_offset=4)
    monkeypatch.setattr(fm, "SORT_FREE_MAX", 0)
    sorted_ = align(ids, num_local=32, expert_offset=4)
    assert all(torch.equal(a, b) for a, b in zip(counted[:2], sorted_[:2])) and counted[2] == sorted_[2]


def _runs(sorted_ids, block_expert, blocks, n, block_m=BLOCK_M):
    """{block: (expert, sorted pairs)}: a layout up to the order inside each block."""
    got = sorted_ids.view(blocks, block_m)
    return {b: (int(block_expert[b]), sorted(int(p) for p in got[b] if p < n)) for b in range(blocks)}


@pytest.mark.parametrize("kernel", [align_fused, align_spread])
@pytest.mark.parametrize("t,k,num_local,offset,block_m", [
    (1, 8, 128, 0, 16),      # one decode row
    (64, 8, 128, 0, 16),     # a decode batch of the 30B shape
    (300, 8, 32, 4, 16),     # EP: ids below and above this rank's experts (align_spread: 3 programs)
    (300, 8, 32, 4, 64),     # another block size
    (700, 8, 128, 0, 128),   # prefill-sized: 6 programs, the large tiles
])
def test_the_align_kernels_lay_out_the_pairs_as_the_torch_ops(kernel, t, k, num_local, offset, block_m):
    ids = torch.randint(0, num_local + 2 * offset, (t, k), generator=torch.Generator().manual_seed(t))
    ids[0, 0] = -1                                                 # an empty slot from an all-to-all
    ref = align(ids, num_local, offset, block_m)
    got = kernel(ids, num_local, offset, block_m)
    assert got[2] == ref[2] and got[0].shape == ref[0].shape and got[0].dtype == ref[0].dtype
    assert torch.equal(got[1], ref[1])
    assert _runs(*got, ids.numel(), block_m) == _runs(*ref, ids.numel(), block_m)


def test_past_the_kernels_bound_the_torch_align_gives_the_same_experts(monkeypatch):
    import pdrollout.engine.model.fused_moe as fm
    x, ids, w, gu, dn = _case(37, 4, 16, 96, 80, 16, torch.float32, seed=5)
    fused = experts_fused(x, ids, w, gu, dn, block_n=32, block_k=32)
    monkeypatch.setattr(fm, "ALIGN_KERNEL_MAX_PAIRS", 0)
    assert torch.equal(experts_fused(x, ids, w, gu, dn, block_n=32, block_k=32), fused)


def _fp8_experts(num_local, hidden, inter, block, seed):
    """FP8 experts in fp8.py's layout: gate and up quantized apart (their block rows restart at I)."""
    from types import SimpleNamespace
    from pdrollout.engine.model import fp8
    g = torch.Generator().manual_seed(seed)
    gu_q, gu_s, dn_q, dn_s = [], [], [], []
    for _ in range(num_local):
        gate, up = (torch.randn(2, inter, hidden, generator=g) * hidden ** -0.5).unbind(0)
        (qg, sg), (qu, su) = fp8.quantize(gate, block), fp8.quantize(up, block)
        q, sd = fp8.quantize(torch.randn(hidden, inter, generator=g) * inter ** -0.5, block)
        gu_q.append(torch.cat([qg, qu])), gu_s.append(torch.cat([sg, su])), dn_q.append(q), dn_s.append(sd)
    return SimpleNamespace(gate_up_proj=torch.stack(gu_q), gate_up_proj_scale_inv=torch.stack(gu_s),
                           down_proj=torch.stack(dn_q), down_proj_scale_inv=torch.stack(dn_s),
                           inter=inter, block=block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,k,total,num_local,offset", [(1, 8, 16, 16, 0), (29, 4, 16, 8, 8)])
def test_fp8_fused_experts_dequantize_each_tile_exactly_as_the_reference(dtype, t, k, total, num_local, offset):
    """e4m3 weights with 128×128 block scales (partial last blocks: I = 192, H = 160): the kernel's
    in-register dequantization gives the same bits as running it on fp8.dequantize's weights (in
    fp32: the interpreter's fp32->bf16 cast does not round to nearest, the GPU test checks bf16's
    bits), and the result matches the reference FP8 path (fp8.experts_forward)."""
    from pdrollout.engine.model import fp8
    hidden, inter, block = 160, 192, (128, 128)
    ex = _fp8_experts(num_local, hidden, inter, block, seed=t)
    g = torch.Generator().manual_seed(100 + t)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    w, ids = ops.route(torch.randn(t, total, generator=g), k, True, dtype)
    out = experts_fused(x, ids, w, ex.gate_up_proj, ex.down_proj, offset, block_n=32, block_k=64,
                        fp8=(ex.gate_up_proj_scale_inv, ex.down_proj_scale_inv, block))
    gu, dn = fp8.expert_weights(ex, slice(None), dtype)
    same = experts_fused(x, ids, w, gu, dn, offset, block_n=32, block_k=64)
    assert torch.equal(out, same) if dtype == torch.float32 else rel(out, same) < 2e-2
    if dtype == torch.float32:
        assert rel(out, fp8.experts_forward(x, ids, w, ex, offset)) < 1e-6
    else:   # against the exact function of the FP8 weights (bf16 roundings, truncated here, ~1 % each)
        gu, dn = fp8.expert_weights(ex, slice(None), torch.float64)
        assert rel(out, ops.experts_reference(x.double(), ids, w.double(), gu, dn, offset)) < 3e-2
    assert out.dtype == dtype


@pytest.mark.parametrize("tiles", [dict(block_k=96), dict(down_tiles=dict(block_k=96))])
def test_fp8_fused_experts_reject_a_k_tile_across_scale_blocks(tiles):
    ex = _fp8_experts(2, 160, 192, (128, 128), seed=0)
    x, ids, w = torch.randn(2, 160), torch.tensor([[0], [1]]), torch.ones(2, 1)
    with pytest.raises(ValueError, match=r"block_k \(96\)"):
        experts_fused(x, ids, w, ex.gate_up_proj, ex.down_proj, **tiles,
                      fp8=(ex.gate_up_proj_scale_inv, ex.down_proj_scale_inv, (128, 128)))


def test_an_fp8_model_through_the_fused_experts_equals_the_reference_path():
    """MoEBlock hands FP8 experts to the fused kernels as they are (`experts_kernel: fused`), for
    top-k rows and for routed rows (what an all-to-all delivers): the same logits as the
    per-expert dequantizing reference, in fp32."""
    from pdrollout.engine.model.backends import REFERENCE, Backends, FusedExperts, ReferenceAttention
    from pdrollout.engine.model.checkpoint import random_model
    from pdrollout.engine.model.kv_cache import KVCache
    from pdrollout.engine.protocol.config import ModelConfig
    from pdrollout.engine.runtime.batch import ForwardBatch, SeqSlice
    cfg = ModelConfig.from_dict({"vocab_size": 384, "hidden_size": 256, "intermediate_size": 384,
                                 "moe_intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "head_dim": 128, "num_experts": 8,
                                 "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 512,
                                 "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                         "activation_scheme": "dynamic",
                                                         "weight_block_size": [128, 128]}})
    fused = Backends(ReferenceAttention(), FusedExperts())
    prompt = [(i * 37) % 380 + 2 for i in range(11)]
    logits = []
    for backends in (REFERENCE, fused):
        model = random_model(cfg, torch.device("cpu"), torch.float32, seed=4, backends=backends)
        n = len(prompt)
        kv = KVCache(2, 1, n, 2, 128, torch.float32, "cpu")
        slots = torch.arange(n)
        batch = ForwardBatch(input_ids=torch.tensor(prompt), positions=torch.arange(n), slot_mapping=slots,
                             seqs=[SeqSlice(0, n, n, slots)], logits_indices=torch.arange(n))
        logits.append(model(batch, kv))
        moe = model.model.layers[0].mlp
        assert moe.experts.down_proj.dtype == torch.float8_e4m3fn and moe._fp8_in_kernel() == (backends is fused)
    assert rel(logits[1], logits[0]) < 1e-5
    rows, ids = torch.randn(5, 256), torch.tensor([3, -1, 0, 7, 3])
    got = moe.routed_experts(rows, ids)
    moe.backends = REFERENCE
    assert rel(got, moe.routed_experts(rows, ids)) < 1e-6 and torch.equal(got[1], torch.zeros(256))


@pytest.mark.parametrize("t", [80, 256, 1024])
def test_auto_experts_grow_their_tiles_with_the_pairs_and_keep_fp8_weights_in_the_kernels(t):
    """AutoExperts runs the fused kernels at every size, with 16-, 32- (16-bit weights; FP8 64-),
    64- and 128-row tiles as the pairs grow; FP8 experts stay e4m3 into the kernels at each (exact
    against the dequantizing reference)."""
    from pdrollout.engine.model import fp8 as fp8mod
    from pdrollout.engine.model.backends import AutoExperts, fused_tiles
    k = 8
    assert fused_tiles(t * k, 1).get("block_m", BLOCK_M) == {80: 16, 256: 64, 1024: 128}[t]
    assert fused_tiles(t * k).get("block_m", BLOCK_M) == {80: 16, 256: 32, 1024: 128}[t]
    assert [fused_tiles(p).get("block_m", BLOCK_M) for p in (2047, 2048, 4095, 4096, 8191)] == [16, 32, 32, 64, 64]
    assert fused_tiles(640).get("block_k") == 128 and fused_tiles(640, 4) == {}   # fp32: 64-deep K steps
    ex = _fp8_experts(8, 256, 128, (128, 128), seed=2)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(t, 256, generator=g)
    w, ids = ops.route(torch.randn(t, 8, generator=g), k, True, torch.float32)
    fp8 = (ex.gate_up_proj_scale_inv, ex.down_proj_scale_inv, (128, 128))
    assert AutoExperts.fp8_in_kernel
    got = AutoExperts()(x, ids, w, ex.gate_up_proj, ex.down_proj, fp8=fp8)
    assert rel(got, fp8mod.experts_forward(x, ids, w, ex, 0)) < 1e-6
