"""CUDA kernels against the reference ops (GPU machine; deselected on CPU CI by the `gpu` marker)."""
from __future__ import annotations

import functools

import pytest
import torch

from pdrollout.engine.model import ops
from pdrollout.engine.model.qwen3_moe import SeqSlice

pytestmark = pytest.mark.gpu
cuda = torch.device("cuda")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _paged(ctx_lens, block_size, kvh, d, dtype, g):
    nblocks = sum(-(-c // block_size) for c in ctx_lens) + 4
    k = torch.randn(nblocks * block_size, kvh, d, generator=g, device=cuda).to(dtype)
    v = torch.randn(nblocks * block_size, kvh, d, generator=g, device=cuda).to(dtype)
    perm = torch.randperm(nblocks, generator=g, device=cuda).tolist()   # scattered blocks
    tables, at = [], 0
    for c in ctx_lens:
        n = -(-c // block_size)
        tables.append(perm[at:at + n])
        at += n
    return k, v, tables


@pytest.mark.parametrize("splits", [1, 5, "auto"])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_attention_matches_reference(dtype, tol, block_size, splits):
    from pdrollout.engine.model.kernels import decode_attention
    g = torch.Generator(device=cuda).manual_seed(0)
    h, kvh, d = 32, 4, 128
    ctx = [1, 15, 16, 17, 300, 2049, 5000]
    k, v, tables = _paged(ctx, block_size, kvh, d, dtype, g)
    q = torch.randn(len(ctx), h, d, generator=g, device=cuda).to(dtype)
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(ctx) + 1, width, dtype=torch.int32, device=cuda)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    lens = torch.tensor(ctx + [0], dtype=torch.int32, device=cuda)     # last row: padding
    qpad = torch.cat([q, torch.randn(1, h, d, generator=g, device=cuda).to(dtype)])
    out = decode_attention(qpad, k, v, bt, lens, block_size, d ** -0.5, kv_splits=splits)
    assert torch.isfinite(out).all() and out[-1].abs().max() == 0
    seqs = []
    for i, (c, t) in enumerate(zip(ctx, tables)):
        pos = torch.arange(c, device=cuda)
        slots = torch.tensor(t, device=cuda)[pos // block_size] * block_size + pos % block_size
        seqs.append(SeqSlice(i, 1, c, slots))
    ref = ops.paged_attention(q.double(), k.double(), v.double(), seqs, d ** -0.5)
    assert rel(out[:-1], ref) < tol


def test_split_decode_attention_replays_in_a_graph_with_new_lengths():
    """The split kernels' grid is fixed by shapes: a graph captured at one set of lengths replays
    right at others (longer and shorter rows, a row going to padding)."""
    from pdrollout.engine.model.kernels import decode_attention
    g = torch.Generator(device=cuda).manual_seed(2)
    h, kvh, d, bs = 32, 4, 128, 16
    k, v, tables = _paged([4096] * 4, bs, kvh, d, torch.bfloat16, g)
    bt = torch.tensor(tables, dtype=torch.int32, device=cuda)
    q = torch.randn(4, h, d, generator=g, device=cuda).to(torch.bfloat16)
    lens = torch.tensor([100, 2000, 4096, 7], dtype=torch.int32, device=cuda)
    decode_attention(q, k, v, bt, lens, bs, d ** -0.5, kv_splits="auto")   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, bt, lens, bs, d ** -0.5, kv_splits="auto")
    for new in ([4096, 1, 3000, 0], [64, 65, 4000, 129]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        eager = decode_attention(q, k, v, bt, lens, bs, d ** -0.5, kv_splits=1)
        assert rel(out, eager) < 1e-2, new


def _prefill_segments(shapes, h, d, seed, kvh=4, bs=16):
    """q, paged k/v (bf16) and segments of (new tokens, total context) each."""
    g = torch.Generator(device=cuda).manual_seed(seed)
    k, v, tables = _paged([c for _, c in shapes], bs, kvh, d, torch.bfloat16, g)
    seqs, start = [], 0
    for (n, c), t in zip(shapes, tables):
        pos = torch.arange(c, device=cuda)
        seqs.append(SeqSlice(start, n, c, torch.tensor(t, device=cuda)[pos // bs] * bs + pos % bs))
        start += n
    return torch.randn(start, h, d, generator=g, device=cuda).to(torch.bfloat16), k, v, seqs


@pytest.mark.parametrize("kernel", ["sdpa", "triton"])
def test_prefill_attention_matches_reference(kernel):
    """SDPA per segment (kernels.py) and the paged Triton launch (paged_prefill.py)."""
    from pdrollout.engine.model.kernels import prefill_attention
    from pdrollout.engine.model.paged_prefill import paged_prefill_attention
    h, d = 32, 128
    # (new tokens, total context): fresh prompts and continuation prefills over a cached prefix.
    q, k, v, seqs = _prefill_segments([(37, 37), (512, 1300), (1, 70), (2048, 2048)], h, d, seed=1)
    out = (prefill_attention if kernel == "sdpa" else paged_prefill_attention)(q, k, v, seqs, d ** -0.5)
    ref = ops.paged_attention(q.double(), k.double(), v.double(), seqs, d ** -0.5)
    assert rel(out, ref) < 2e-2
    for s in seqs:
        rows = slice(s.q_start, s.q_start + s.q_len)
        assert rel(out[rows], ref[rows]) < 2e-2


def test_fresh_prefill_attention_on_cudnn_matches_reference_and_the_launch():
    """`prefill_attention: hybrid`'s path: cuDNN SDPA over fresh prompts bucketed and batched (back to
    back at a bucket's length: views; others padded), with NaN in every cache slot no prompt holds
    (the padding must not read them). Equal to the reference and to the paged launch at bf16."""
    from pdrollout.engine.model.kernels import fresh_groups, fresh_prefill_attention
    from pdrollout.engine.model.paged_prefill import paged_prefill_attention
    h, d = 32, 128
    shapes = [(2048, 2048), (2048, 2048), (2100, 2100), (2500, 2500), (777, 777)]
    q, k, v, seqs = _prefill_segments(shapes, h, d, seed=3)
    used = torch.zeros(k.shape[0], dtype=torch.bool, device=cuda)
    for s in seqs:
        used[s.slots] = True
    k[~used], v[~used] = float("nan"), float("nan")
    assert sorted((n, len(g)) for n, g in fresh_groups(seqs).items()) == [(1024, 1), (2048, 2), (2560, 2)]
    out = fresh_prefill_attention(q, k, v, seqs, d ** -0.5)
    ref = ops.paged_attention(q.double(), k.double(), v.double(), seqs, d ** -0.5)
    launch = paged_prefill_attention(q, k, v, seqs, d ** -0.5)
    assert torch.isfinite(out).all()
    for s in seqs:
        rows = slice(s.q_start, s.q_start + s.q_len)
        assert rel(out[rows], ref[rows]) < 2e-2 and rel(out[rows], launch[rows]) < 2e-2, s.q_len


def test_paged_prefill_splits_a_lone_continuation_along_its_context():
    """One continuation of 128 tokens over 4k cached (the fused step's P at P1): one tile per head
    leaves most SMs idle, so the walk is split and merged; the reference's output either way."""
    from pdrollout.engine.model.paged_prefill import paged_prefill_attention, plan_tiles
    h, d = 32, 128
    q, k, v, seqs = _prefill_segments([(128, 4096), (1, 3000)], h, d, seed=2)
    plan = plan_tiles(seqs, q.device, heads=h)
    assert plan.splits > 1
    out = paged_prefill_attention(q, k, v, seqs, d ** -0.5, plan=plan)
    ref = ops.paged_attention(q.double(), k.double(), v.double(), seqs, d ** -0.5)
    for s in seqs:
        rows = slice(s.q_start, s.q_start + s.q_len)
        assert rel(out[rows], ref[rows]) < 2e-2
    whole = paged_prefill_attention(q, k, v, seqs, d ** -0.5, plan=plan_tiles(seqs, q.device, splits=1))
    assert rel(out, whole) < 1e-2


@pytest.mark.parametrize("kernel", ["align_fused", "align_spread"])
@pytest.mark.parametrize("tokens,num_local,offset", [(1, 128, 0), (64, 128, 0), (1024, 128, 0), (300, 32, 32),
                                                     (8192, 128, 0), (3000, 32, 64)])
def test_the_align_kernels_lay_out_pairs_as_the_torch_ops(kernel, tokens, num_local, offset):
    """Compiled: the barriers and atomics of one program (the interpreter runs it sequentially). The
    atomics hand out an expert's rows in any order, so an expert with more pairs than a block may split
    them over its blocks differently: each expert's run of blocks holds the same pairs, and each
    block's real pairs come first (padding, id n, after them)."""
    from pdrollout.engine.model import fused_moe
    g = torch.Generator(device=cuda).manual_seed(tokens)
    ids = torch.randint(0, 128, (tokens, 8), generator=g, device=cuda)
    ref, got = fused_moe.align(ids, num_local, offset), getattr(fused_moe, kernel)(ids, num_local, offset)
    assert got[2] == ref[2] and torch.equal(got[1], ref[1])
    n, bm = ids.numel(), ref[0].numel() // ref[2]
    runs: dict[int, list] = {}
    for e, a, b in zip(ref[1].tolist(), got[0].view(-1, bm).tolist(), ref[0].view(-1, bm).tolist()):
        real = sum(p < n for p in b)
        assert all(p < n for p in a[:real]) and all(p >= n for p in a[real:])
        run = runs.setdefault(e, [[], []])
        run[0] += a[:real]
        run[1] += b[:real]
    for e, (a, b) in runs.items():
        assert sorted(a) == sorted(b), f"expert {e}"


def _experts(kernel: str):
    from pdrollout.engine.model import fused_moe, kernels
    from pdrollout.engine.model.backends import FUSED_LARGE_TILES
    large = functools.partial(fused_moe.experts_fused, **FUSED_LARGE_TILES)   # AutoExperts' long-prefill tiles
    return {"grouped": kernels.experts_grouped, "fused": fused_moe.experts_fused, "fused_large": large}[kernel]


@pytest.mark.parametrize("kernel", ["grouped", "fused", "fused_large"])
@pytest.mark.parametrize("tokens,offset,num_local", [(1, 0, 128), (64, 0, 128), (4096, 0, 128), (200, 32, 32)])
def test_routed_experts_match_reference(kernel, tokens, offset, num_local):
    experts = _experts(kernel)
    g = torch.Generator(device=cuda).manual_seed(2)
    hdim, inter, top_k, total = 2048, 768, 8, 128
    x = torch.randn(tokens, hdim, generator=g, device=cuda).to(torch.bfloat16)
    gate_up = (torch.randn(num_local, 2 * inter, hdim, generator=g, device=cuda) * hdim ** -0.5).to(torch.bfloat16)
    down = (torch.randn(num_local, hdim, inter, generator=g, device=cuda) * inter ** -0.5).to(torch.bfloat16)
    logits = torch.randn(tokens, total, generator=g, device=cuda)
    w, ids = ops.route(logits, top_k, True, torch.bfloat16)
    out = experts(x, ids, w, gate_up, down, offset)
    ref = ops.experts_reference(x.double(), ids, w.double(), gate_up.double(), down.double(), offset)
    assert rel(out, ref) < 2e-2


@pytest.mark.parametrize("rows", [1, 64, 8192])
def test_fused_add_norm_matches_the_torch_ops(rows):
    """bf16 at the model's hidden size: the add rounds once (equal bits), the norm differs from the
    torch ops only by the order of its fp32 sum of squares (a last-bit difference on a few values)."""
    from pdrollout.engine.model.norms import fused_add_norm, torch_add_norm
    g = torch.Generator(device=cuda).manual_seed(rows)
    x, y = (torch.randn(2, rows, 2048, generator=g, device=cuda) * 4).to(torch.bfloat16).unbind(0)
    w = (1 + 0.1 * torch.randn(2048, generator=g, device=cuda)).to(torch.bfloat16)
    got_x, got_h = fused_add_norm(x, y, w, 1e-6)
    ref_x, ref_h = torch_add_norm(x, y, w, 1e-6)
    assert torch.equal(got_x, ref_x)
    assert (got_h != ref_h).float().mean().item() < 0.01 and rel(got_h, ref_h) < 4e-3


@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_fp8_fused_experts_equal_the_fused_kernel_on_dequantized_weights(tokens):
    """e4m3 experts with 128×128 block scales at the Qwen3-30B-A3B expert shape: each tile is
    dequantized in registers to fp8.dequantize's bf16 weights (bit-equal under the interpreter,
    interp_fused_moe.py). Compiled, the FP8 kernel's MMAs take the tile from registers and may sum
    in another order than the bf16 kernel's (seen on the H200: not bit-equal), so here both runs
    must agree to bf16 rounding and be equally far from the fp64 product on the dequantized weights."""
    from pdrollout.engine.model import fp8, fused_moe
    g = torch.Generator(device=cuda).manual_seed(3)
    hdim, inter, top_k, e = 2048, 768, 8, 128
    block = (128, 128)
    qs = [fp8.quantize(torch.randn(rows, cols, generator=g, device=cuda) * cols ** -0.5, block)
          for _ in range(e) for rows, cols in ((inter, hdim), (inter, hdim), (hdim, inter))]
    gu = torch.stack([torch.cat([qs[3 * i][0], qs[3 * i + 1][0]]) for i in range(e)])
    gu_s = torch.stack([torch.cat([qs[3 * i][1], qs[3 * i + 1][1]]) for i in range(e)])
    dn, dn_s = torch.stack([qs[3 * i + 2][0] for i in range(e)]), torch.stack([qs[3 * i + 2][1] for i in range(e)])
    x = torch.randn(tokens, hdim, generator=g, device=cuda).to(torch.bfloat16)
    w, ids = ops.route(torch.randn(tokens, e, generator=g, device=cuda), top_k, True, torch.bfloat16)
    out = fused_moe.experts_fused(x, ids, w, gu, dn, fp8=(gu_s, dn_s, block))
    half = inter // block[0]     # gate's and up's block rows: quantized apart
    gu16 = torch.cat([fp8.dequantize(gu[:, :inter], gu_s[:, :half], block, torch.bfloat16),
                      fp8.dequantize(gu[:, inter:], gu_s[:, half:], block, torch.bfloat16)], 1)
    dn16 = fp8.dequantize(dn, dn_s, block, torch.bfloat16)
    out16 = fused_moe.experts_fused(x, ids, w, gu16, dn16)
    ref = ops.experts_reference(x.double(), ids, w.double(), gu16.double(), dn16.double())
    assert rel(out, out16) < 4e-3
    assert rel(out, ref) < 1.25 * rel(out16, ref) + 1e-4


@pytest.mark.parametrize("kernel", ["grouped", "fused"])
def test_routed_experts_capture_in_a_graph(kernel):
    experts = _experts(kernel)
    g = torch.Generator(device=cuda).manual_seed(3)
    x = torch.randn(64, 256, generator=g, device=cuda).to(torch.bfloat16)
    gu = torch.randn(16, 128, 256, generator=g, device=cuda).to(torch.bfloat16) * 0.06
    dn = torch.randn(16, 256, 64, generator=g, device=cuda).to(torch.bfloat16) * 0.1
    w, ids = ops.route(torch.randn(64, 16, generator=g, device=cuda), 4, True, torch.bfloat16)
    experts(x, ids, w, gu, dn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts(x, ids, w, gu, dn)
    w2, ids2 = ops.route(torch.randn(64, 16, generator=g, device=cuda), 4, True, torch.bfloat16)
    ids.copy_(ids2), w.copy_(w2)
    graph.replay()
    assert rel(out, ops.experts_reference(x.double(), ids2, w2.double(), gu.double(), dn.double())) < 2e-2


def test_gathered_experts_match_reference_in_fp32():
    from pdrollout.engine.model.kernels import experts_gathered
    g = torch.Generator(device=cuda).manual_seed(4)
    x = torch.randn(50, 64, generator=g, device=cuda)
    gu = torch.randn(8, 64, 64, generator=g, device=cuda) * 0.1
    dn = torch.randn(8, 64, 32, generator=g, device=cuda) * 0.1
    w, ids = ops.route(torch.randn(50, 16, generator=g, device=cuda), 2, False, torch.float32)
    out = experts_gathered(x, ids, w, gu, dn, expert_offset=8)
    assert rel(out, ops.experts_reference(x.double(), ids, w.double(), gu.double(), dn.double(), 8)) < 1e-6



@pytest.mark.parametrize("tokens", [1, 64, 3000])
def test_fused_prologue_matches_the_torch_ops(tokens):
    """Per-head RMSNorm + RoPE + KV write (model/prologue.py) against Attention.project's torch ops."""
    from pdrollout.engine.model.prologue import qk_prologue
    g = torch.Generator(device=cuda).manual_seed(7)
    heads, kv_heads, d, nslots, eps = 32, 4, 128, 4096, 1e-6
    q, k, v = (torch.randn(tokens, n, d, generator=g, device=cuda).to(torch.bfloat16) for n in (heads, kv_heads, kv_heads))
    qw, kw = ((1 + 0.1 * torch.randn(d, generator=g, device=cuda)).to(torch.bfloat16) for _ in range(2))
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float, device=cuda) / d))
    cos, sin = ops.rope_cos_sin(torch.randint(0, 32768, (tokens,), generator=g, device=cuda), inv, torch.bfloat16)
    slots = torch.randperm(nslots, generator=g, device=cuda)[:tokens]
    kc, vc, kc2, vc2 = (torch.zeros(nslots, kv_heads, d, dtype=torch.bfloat16, device=cuda) for _ in range(4))
    want_q = ops.apply_rope(ops.rms_norm(q, qw, eps), cos, sin)
    kc.index_copy_(0, slots, ops.apply_rope(ops.rms_norm(k, kw, eps), cos, sin))
    vc.index_copy_(0, slots, v)
    got_q = qk_prologue(q.clone(), k, v, qw, kw, eps, cos, sin, kc2, vc2, slots)
    ulp2 = 2 * 2 ** -7          # the same rounding points; the fp32 sum of squares in another order
    assert torch.allclose(got_q.float(), want_q.float(), atol=ulp2, rtol=ulp2)
    assert torch.allclose(kc2.float(), kc.float(), atol=ulp2, rtol=ulp2) and torch.equal(vc2, vc)


def test_fp8_linear_dequantizes_once_per_weight_storage_on_cuda():
    """Fp8Linear on CUDA keeps one dequantized copy: the output equals the per-call path, a second
    call reuses it, and new weight storage (a memory resume, a load) is dequantized again."""
    from pdrollout.engine.model import fp8
    g = torch.Generator(device=cuda).manual_seed(5)
    lin = fp8.Fp8Linear(512, 384, (128, 128)).to(cuda)
    q, s = fp8.quantize(torch.randn(384, 512, generator=g, device=cuda) * 0.05, (128, 128))
    lin.weight.data, lin.weight_scale_inv.data = q, s
    x = torch.randn(7, 512, generator=g, device=cuda).to(torch.bfloat16)
    first = lin(x)
    assert torch.equal(first, fp8.linear(x, q, s, (128, 128)))
    copy = lin.dequantized(torch.bfloat16)
    assert lin.dequantized(torch.bfloat16) is copy
    q2, s2 = fp8.quantize(torch.randn(384, 512, generator=g, device=cuda) * 0.05, (128, 128))
    lin.weight.data, lin.weight_scale_inv.data = q2, s2
    assert torch.equal(lin(x), fp8.linear(x, q2, s2, (128, 128))) and not torch.equal(lin(x), first)
    lin.drop_derived()
    assert lin._dequantized is None


@pytest.mark.parametrize("t", [1, 64, 8192])
def test_fused_router_matches_reference(t):
    """The 30B-A3B router shape (128 experts, top 8, renormalized): the same picked logits as
    torch.topk in order, the same ids in fp32, weights within bf16 rounding."""
    from pdrollout.engine.model.router import fused_route
    g = torch.Generator(device=cuda).manual_seed(t)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(t, 128, generator=g, device=cuda) * 2).to(dtype)
        w, ids = fused_route(logits, 8, True, dtype)
        ref_w, ref_ids = ops.route(logits, 8, True, dtype)
        assert torch.equal(logits.gather(1, ids), logits.gather(1, ref_ids))
        if dtype == torch.float32:
            assert torch.equal(ids, ref_ids) and torch.allclose(w, ref_w, rtol=1e-5, atol=1e-6)
        else:
            assert torch.allclose(w.float(), ref_w.float(), rtol=2 ** -7, atol=0)


def test_a_new_batch_size_compiles_nothing_once_each_regime_ran():
    """Triton compiles a kernel per specialization; a compile mid-run stalled a 19,579-token step for
    1 s on the H200 (runtime/jit_watch.py). The MoE path's per-step sizes (pairs, blocks, rows) and the
    decode attention's table width are unspecialized, so once `fused_regime_tokens` ran (what the
    prefill warm-up does) and one decode launch in one pass and one split did, token counts of every
    residue and every batch's split count compile nothing."""
    import triton
    import triton.language as tl

    from pdrollout.engine.model.backends import AutoExperts, fused_regime_tokens
    from pdrollout.engine.model.kernels import decode_attention
    from pdrollout.engine.runtime.jit_watch import install
    watch = install()
    assert watch is not None, f"Triton {triton.__version__} has no post-compile hook"

    @triton.jit
    def fresh(x, BLOCK: tl.constexpr):   # a kernel this process never ran: its first launch compiles
        i = tl.arange(0, BLOCK)
        tl.store(x + i, tl.load(x + i) + 1)

    before = watch.total
    fresh[(1,)](torch.zeros(16, device=cuda), BLOCK=16)
    assert watch.total == before + 1 and watch.take()[-1] == "fresh"

    g = torch.Generator(device=cuda).manual_seed(3)
    hdim, inter, top_k, total = 256, 128, 8, 128
    gate_up = (torch.randn(total, 2 * inter, hdim, generator=g, device=cuda) * hdim ** -0.5).to(torch.bfloat16)
    down = (torch.randn(total, hdim, inter, generator=g, device=cuda) * inter ** -0.5).to(torch.bfloat16)
    experts = AutoExperts().fn

    def moe(tokens: int) -> None:
        x = torch.randn(tokens, hdim, generator=g, device=cuda).to(torch.bfloat16)
        w, ids = ops.route(torch.randn(tokens, total, generator=g, device=cuda), top_k, True, torch.bfloat16)
        experts(x, ids, w, gate_up, down)

    h, kvh, d, bs = 8, 2, 128, 16
    k, v, tables = _paged([5000], bs, kvh, d, torch.bfloat16, g)

    def attend(rows: int, width: int, splits="auto") -> None:
        bt = torch.tensor(tables[0][:width], dtype=torch.int32, device=cuda).repeat(rows, 1)
        lens = torch.full((rows,), width * bs, dtype=torch.int32, device=cuda)
        q = torch.randn(rows, h, d, generator=g, device=cuda).to(torch.bfloat16)
        decode_attention(q, k, v, bt, lens, bs, d ** -0.5, kv_splits=splits)   # auto: the engine's default

    for t in fused_regime_tokens(top_k):
        moe(t)
    attend(64, 128, 1)
    attend(64, 128, 2)
    torch.cuda.synchronize()
    watch.take()
    # odd and even token counts (pairs a multiple of 16 or not), blocks of every residue, both layouts
    for t in (2, 3, 17, 31, 255, 257, 258, 999, 1023, 1025, 1031, 2447, 4099, 19579):
        moe(t)
    for rows, width in ((1, 1), (3, 2), (17, 16), (64, 17), (5, 313), (1, 313), (2, 313), (8, 64)):
        attend(rows, width)   # auto: 1 to 16 splits by the rows (h/kvh = 4 heads a row's program)
    for splits in range(1, 17):
        attend(3, 313, splits)
    torch.cuda.synchronize()
    assert watch.take() == ()
