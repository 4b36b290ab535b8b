"""Fused routed experts (Triton): the MoE block in two kernels and one fp32 sum, for the few rows per
expert of decode and short prefill, where a grouped GEMM's 64-128-row tiles are mostly padding.

1. `align` (fixed shapes: graph-capturable): the (token, slot) pairs grouped by local expert, each
   expert's run padded to a multiple of BLOCK_M, one expert id per block (`num_local` marks a block
   past the end: the kernels leave it at once). Pairs routed to another rank's experts are left out;
   their rows stay zero. Up to ALIGN_KERNEL_MAX_PAIRS one Triton launch (`align_fused`: counts and
   slots by atomics); past it three launches over many programs (`align_spread`). `align`, torch ops
   (a count, or one sort), is the layout's reference.
2. gate/up kernel: per block of BLOCK_M pairs and BLOCK_N intermediate columns, the gate and up
   tiles accumulate together over H and SiLU(gate)·up is written once (no [rows, 2I] round trip).
3. down kernel: act × down[e]ᵀ, scaled by the pair's routing weight, stored to the pair's own row
   of a [T·K, H] buffer in the dtype the kernels compute in (the weights', or the activations' with
   FP8 weights), as the reference rounds it (deterministic: no atomics; at 8k tokens an fp32 buffer
   cost half a GB of writes and reads a layer).
4. combine kernel: each token's K slots summed in order, slots of another rank's experts skipped
   (their rows are never written, so the buffer needs no zero fill), cast once to the output dtype.
Both GEMM kernels run a 1-D grid in groups of `group_m` row blocks that walk their column tiles
together: down's activations (100 MB a layer at 8k tokens) are then read from HBM once, not once
per column tile.
Every weight tile an expert needs is read once per block of its rows. Tested against
ops.experts_reference on CPU under Triton's interpreter (tests/engine/interp_fused_moe.py) and on the
GPU (tests/engine/test_kernels.py).
"""
from __future__ import annotations

import functools

import torch

from .kernels import triton_interpreting

BLOCK_M = 16     # rows per block: tl.dot's minimum, and ~ the rows an expert sees at decode
# Every kernel here leaves its per-step sizes (pairs, rows, blocks) unspecialized: Triton would
# compile again whenever one turns a multiple of 16 or stops being one (runtime/jit_watch.py).
SORT_FREE_MAX = 1 << 20   # pairs × experts up to which `align` counts instead of sorting


def align_blocks(n: int, num_local: int, block_m: int) -> int:
    """Blocks the layout of n pairs over num_local experts can need (each run padded to block_m): a
    bound from the shapes alone, so a captured graph keeps its sizes."""
    return -(-(n + min(num_local, n) * (block_m - 1)) // block_m)


def align(topk_ids: torch.Tensor, num_local: int, expert_offset: int, block_m: int = BLOCK_M):
    """(sorted pair ids padded with n = T·K, expert id per block (num_local: none), blocks)."""
    n = topk_ids.numel()
    dev = topk_ids.device
    local = (topk_ids - expert_offset).flatten()
    owned = (local >= 0) & (local < num_local)
    key = torch.where(owned, local, torch.full_like(local, num_local))
    blocks = align_blocks(n, num_local, block_m)
    rows = blocks * block_m
    if n * (num_local + 1) <= SORT_FREE_MAX:
        # sort-free (decode): a pair's rank among its expert's pairs from a running count per expert,
        # laid out expert-major so the count is an innermost-dim scan (an outer-dim scan was a visible
        # share of a decode step: docs/PERF.md, "Kernel choices")
        onehot = key[None, :] == torch.arange(num_local + 1, device=dev)[:, None]
        seen = torch.cumsum(onehot, 1, dtype=torch.int32)
        counts = seen[:num_local, -1].long()
        rank = seen.gather(0, key[None, :]).squeeze(0).long() - 1
        pair, skey = torch.arange(n, device=dev), key
    else:   # long prefill: n × E counters would outweigh one sort
        pair = torch.argsort(key, stable=True)
        skey = key[pair]
        counts = torch.zeros(num_local + 1, dtype=torch.long, device=dev)
        counts.index_add_(0, key, torch.ones_like(key))
        counts = counts[:num_local]
        rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[skey.clamp(max=num_local - 1)]
    padded = (counts + block_m - 1) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    e = skey.clamp(max=num_local - 1)
    dest = pend[e] - padded[e] + rank
    dest = torch.where(skey < num_local, dest, torch.full_like(dest, rows))   # foreign: a trash slot
    sorted_ids = torch.full((rows + 1,), n, dtype=torch.int32, device=dev)
    sorted_ids[dest] = pair.to(torch.int32)
    first = torch.arange(blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pend, first, right=True).to(torch.int32)   # num_local: past the end
    return sorted_ids[:rows], block_expert, blocks


# Up to here one program lays out the pairs; past it align_spread's three launches win (moe_kernels.py;
# docs/PERF.md, "Kernel choices").
ALIGN_KERNEL_MAX_PAIRS = 1024
# Up to here each pair is a block of its own, no layout made (`direct`): a shared expert is read once per
# pair, which costs less than the layout's launch while few pairs share one; a skewed router shares more,
# so it stops at 2 rows (docs/PERF.md, "Kernel choices").
DIRECT_MAX_PAIRS = 16


@functools.cache
def _align_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n", "rows", "blocks"])
    def align_pairs(ids, sorted_ids, block_expert, cursor, n, expert_offset, num_local, rows, blocks,
                    BM: tl.constexpr, BP: tl.constexpr, E_PAD: tl.constexpr, BB: tl.constexpr):
        # One program, in four passes separated by barriers (its threads see each other's global
        # writes after one). `cursor` holds each expert's count, then the next free row of its run.
        e = tl.arange(0, E_PAD)
        tl.store(cursor + e, tl.zeros([E_PAD], tl.int32))
        tl.debug_barrier()
        for p0 in range(0, n, BP):
            p = p0 + tl.arange(0, BP)
            local = tl.load(ids + p, mask=p < n, other=-1) - expert_offset
            owned = (p < n) & (local >= 0) & (local < num_local)
            tl.atomic_add(cursor + local, 1, mask=owned)
        tl.debug_barrier()
        counts = tl.load(cursor + e, mask=e < num_local, other=0, volatile=True)
        padded = (counts + BM - 1) // BM * BM
        ends = tl.cumsum(padded, 0)
        tl.debug_barrier()   # every thread has its counts before they become run starts
        tl.store(cursor + e, ends - padded)
        for r0 in range(0, rows, BP):   # a row no pair takes is padding (n)
            r = r0 + tl.arange(0, BP)
            tl.store(sorted_ids + r, tl.full([BP], 0, tl.int32) + n, mask=r < rows)
        tl.debug_barrier()
        # each owned pair takes its expert's next row: the order inside a run is the atomics', which
        # changes no result (each row of a tile is computed alone; combine sums a token's slots in order)
        for p0 in range(0, n, BP):
            p = p0 + tl.arange(0, BP)
            local = tl.load(ids + p, mask=p < n, other=-1) - expert_offset
            owned = (p < n) & (local >= 0) & (local < num_local)
            dest = tl.atomic_add(cursor + local, 1, mask=owned)
            tl.store(sorted_ids + dest, p.to(tl.int32), mask=owned)
        # a block's expert: the runs that end at or before its first row (num_local: past the end)
        ends = tl.where(e < num_local, ends, 1 << 30)
        for b0 in range(0, blocks, BB):
            b = b0 + tl.arange(0, BB)
            first = b * BM
            expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), 1)
            tl.store(block_expert + b, expert, mask=b < blocks)

    return align_pairs


@functools.cache
def _spread_kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n", "rows"])
    def rank_pairs(ids, rank, counts, sorted_ids, n, expert_offset, num_local, rows, BP: tl.constexpr):
        # each pair's rank among its expert's pairs (the atomics' order) and the experts' counts;
        # the program's slice of the layout is set to padding (n) while the scatter waits for starts
        p = tl.program_id(0) * BP + tl.arange(0, BP)
        tl.store(sorted_ids + p, tl.full([BP], 0, tl.int32) + n, mask=p < rows)
        local = tl.load(ids + p, mask=p < n, other=-1) - expert_offset
        owned = (p < n) & (local >= 0) & (local < num_local)
        r = tl.atomic_add(counts + local, 1, mask=owned)
        tl.store(rank + p, r, mask=owned)

    @triton.jit(do_not_specialize=["blocks"])
    def run_starts(counts, starts, block_expert, num_local, blocks,
                   BM: tl.constexpr, E_PAD: tl.constexpr, BB: tl.constexpr):
        # one program: each expert's run start (runs padded to BM rows) and each block's expert
        e = tl.arange(0, E_PAD)
        c = tl.load(counts + e, mask=e < num_local, other=0)
        padded = (c + BM - 1) // BM * BM
        ends = tl.cumsum(padded, 0)
        tl.store(starts + e, ends - padded)
        ends = tl.where(e < num_local, ends, 1 << 30)
        for b0 in range(0, blocks, BB):
            b = b0 + tl.arange(0, BB)
            tl.store(block_expert + b, tl.sum((ends[None, :] <= (b * BM)[:, None]).to(tl.int32), 1), mask=b < blocks)

    @triton.jit(do_not_specialize=["n"])
    def place_pairs(ids, rank, starts, sorted_ids, n, expert_offset, num_local, BP: tl.constexpr):
        p = tl.program_id(0) * BP + tl.arange(0, BP)
        local = tl.load(ids + p, mask=p < n, other=-1) - expert_offset
        owned = (p < n) & (local >= 0) & (local < num_local)
        dest = tl.load(starts + local, mask=owned, other=0) + tl.load(rank + p, mask=owned, other=0)
        tl.store(sorted_ids + dest, p.to(tl.int32), mask=owned)

    return rank_pairs, run_starts, place_pairs


SPREAD_BP = 1024   # pairs per program of align_spread


def align_spread(topk_ids: torch.Tensor, num_local: int, expert_offset: int, block_m: int = BLOCK_M):
    """`align`'s layout for long prefill in three launches over many programs: ranks by atomics,
    run starts, scatter (the torch ops around a sort were ~30 launches and ~0.1 ms a layer at 8k
    tokens on the H200). Each expert's run holds the same pairs as `align`'s, in the atomics' order."""
    import triton
    n = topk_ids.numel()
    dev = topk_ids.device
    blocks = align_blocks(n, num_local, block_m)
    rows = blocks * block_m
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    e_pad = triton.next_power_of_2(num_local + 1)
    counts = torch.zeros(e_pad, dtype=torch.int32, device=dev)
    starts = torch.empty(e_pad, dtype=torch.int32, device=dev)
    rank = torch.empty(max(n, 1), dtype=torch.int32, device=dev)
    ids = topk_ids.contiguous()
    warps = {} if triton_interpreting() else dict(num_warps=4)
    rank_pairs, run_starts, place_pairs = _spread_kernels()
    rank_pairs[(triton.cdiv(rows, SPREAD_BP),)](ids, rank, counts, sorted_ids, n, expert_offset, num_local,
                                                  rows, BP=SPREAD_BP, **warps)
    run_starts[(1,)](counts, starts, block_expert, num_local, blocks, BM=block_m, E_PAD=e_pad, BB=64, **warps)
    place_pairs[(triton.cdiv(n, SPREAD_BP),)](ids, rank, starts, sorted_ids, n, expert_offset, num_local,
                                               BP=SPREAD_BP, **warps)
    return sorted_ids, block_expert, blocks


def align_fused(topk_ids: torch.Tensor, num_local: int, expert_offset: int, block_m: int = BLOCK_M):
    """`align`'s layout in one launch (decode and short prefill: ~30 small kernels a layer fewer).
    Each expert's run holds the same pairs as `align`'s, in an order of the atomics' choosing."""
    import triton
    n = topk_ids.numel()
    dev = topk_ids.device
    blocks = align_blocks(n, num_local, block_m)
    rows = blocks * block_m
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    e_pad = triton.next_power_of_2(num_local + 1)
    cursor = torch.empty(e_pad, dtype=torch.int32, device=dev)
    interpret = triton_interpreting()
    _align_kernel()[(1,)](topk_ids.contiguous(), sorted_ids, block_expert, cursor, n, expert_offset, num_local,
                          rows, blocks, BM=block_m, BP=1024, E_PAD=e_pad, BB=64,
                          **({} if interpret else dict(num_warps=4)))
    return sorted_ids, block_expert, blocks


@functools.cache
def _kernels(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_pairs", "blocks", "expert_offset"])
    def gate_up(x, w, sorted_ids, block_expert, act, n_pairs, K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, num_local,
                sx, swe, swn, swk, ws, sse, ssn, ssk, blocks, expert_offset, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, GM: tl.constexpr, F32: tl.constexpr, IEEE: tl.constexpr, QB: tl.constexpr,
                DIRECT: tl.constexpr):
        # GM row blocks share a group: its programs walk their column tiles together, so the blocks'
        # rows and their experts' weight tiles are read from L2, not HBM, by the group's programs
        pid, n_tiles = tl.program_id(0), tl.cdiv(I, BN)
        first = pid // (GM * n_tiles) * GM
        size = tl.minimum(blocks - first, GM)
        pid_m = first + pid % (GM * n_tiles) % size
        pid_n = pid % (GM * n_tiles) // size
        rows = pid_m * BM + tl.arange(0, BM)
        if DIRECT:   # block b is pair b alone (block_expert: the routed ids; see experts_fused)
            e = tl.load(block_expert + pid_m) - expert_offset
            if (e < 0) | (e >= num_local):
                return
            pair = tl.where(tl.arange(0, BM) == 0, pid_m, n_pairs)
        else:
            e = tl.load(block_expert + pid_m)
            if e >= num_local:
                return
            pair = tl.load(sorted_ids + rows)
        valid = pair < n_pairs
        tok = pair // K
        cols = pid_n * BN + tl.arange(0, BN)
        cmask = cols < I
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, H, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < H
            a = tl.load(x + tok[:, None] * sx + ks[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
            base = w + e * swe + ks[:, None] * swk
            wmask = kmask[:, None] & cmask[None, :]
            wg = tl.load(base + cols[None, :] * swn, mask=wmask, other=0.0)
            wu = tl.load(base + (cols + I)[None, :] * swn, mask=wmask, other=0.0)
            if QB:   # FP8 weights: a tile lies in one block column of scales; gate's and up's block rows apart
                sbase = ws + e * sse + (k0 // QB) * ssk
                s_g = tl.load(sbase + (cols // QB) * ssn, mask=cmask, other=0.0)
                s_u = tl.load(sbase + ((I + QB - 1) // QB + cols // QB) * ssn, mask=cmask, other=0.0)
                wg = (wg.to(tl.float32) * s_g[None, :]).to(act.dtype.element_ty)
                wu = (wu.to(tl.float32) * s_u[None, :]).to(act.dtype.element_ty)
            if F32:   # the interpreter's bf16 dot is wrong; fp32 products of bf16 are exact
                a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            if IEEE:   # fp32 weights: no TF32 rounding (the exact path)
                acc_g += tl.dot(a, wg, input_precision="ieee")
                acc_u += tl.dot(a, wu, input_precision="ieee")
            else:
                acc_g += tl.dot(a, wg)
                acc_u += tl.dot(a, wu)
        # the reference rounds gate and up to the weights' dtype before SiLU; so do we
        g = acc_g.to(act.dtype.element_ty).to(tl.float32)
        u = acc_u.to(act.dtype.element_ty).to(tl.float32)
        h = g * tl.sigmoid(g) * u
        tl.store(act + rows[:, None] * I + cols[None, :], h.to(act.dtype.element_ty), mask=cmask[None, :])

    # the same block preamble as gate_up: a jit helper would have to be a module global, and this
    # module imports Triton only when a kernel first runs
    @triton.jit(do_not_specialize=["n_pairs", "blocks", "expert_offset"])
    def down(act, w, sorted_ids, block_expert, weights, y, n_pairs, H: tl.constexpr, I: tl.constexpr, num_local,
             swe, swn, swk, ws, sse, ssn, ssk, blocks, expert_offset, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, GM: tl.constexpr, F32: tl.constexpr, IEEE: tl.constexpr, QB: tl.constexpr,
             DIRECT: tl.constexpr):
        pid, n_tiles = tl.program_id(0), tl.cdiv(H, BN)
        first = pid // (GM * n_tiles) * GM
        size = tl.minimum(blocks - first, GM)
        pid_m = first + pid % (GM * n_tiles) % size
        pid_n = pid % (GM * n_tiles) // size
        rows = pid_m * BM + tl.arange(0, BM)
        if DIRECT:
            e = tl.load(block_expert + pid_m) - expert_offset
            if (e < 0) | (e >= num_local):
                return
            pair = tl.where(tl.arange(0, BM) == 0, pid_m, n_pairs)
        else:
            e = tl.load(block_expert + pid_m)
            if e >= num_local:
                return
            pair = tl.load(sorted_ids + rows)
        valid = pair < n_pairs
        cols = pid_n * BN + tl.arange(0, BN)
        cmask = cols < H
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, I, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < I
            a = tl.load(act + rows[:, None] * I + ks[None, :], mask=kmask[None, :], other=0.0)
            wt = tl.load(w + e * swe + cols[None, :] * swn + ks[:, None] * swk,
                         mask=kmask[:, None] & cmask[None, :], other=0.0)
            if QB:
                sc = tl.load(ws + e * sse + (cols // QB) * ssn + (k0 // QB) * ssk, mask=cmask, other=0.0)
                wt = (wt.to(tl.float32) * sc[None, :]).to(act.dtype.element_ty)
            if F32:
                a, wt = a.to(tl.float32), wt.to(tl.float32)
            if IEEE:
                acc += tl.dot(a, wt, input_precision="ieee")
            else:
                acc += tl.dot(a, wt)
        # as the reference: each expert's output rounded to the weights' dtype, then weighted in it
        acc = acc.to(act.dtype.element_ty).to(tl.float32)
        rw = tl.load(weights + pair, mask=valid, other=0.0).to(tl.float32)
        tl.store(y + pair[:, None] * H + cols[None, :], (acc * rw[:, None]).to(y.dtype.element_ty),
                 mask=valid[:, None] & cmask[None, :])

    @triton.jit
    def combine(y, topk_ids, out, expert_offset, num_local, H: tl.constexpr, K: tl.constexpr,
                BH: tl.constexpr):
        t, hb = tl.program_id(0), tl.program_id(1)
        cols = hb * BH + tl.arange(0, BH)
        cmask = cols < H
        acc = tl.zeros((BH,), dtype=tl.float32)
        for k in range(K):
            e = tl.load(topk_ids + t * K + k) - expert_offset
            owned = (e >= 0) & (e < num_local)
            acc += tl.load(y + (t * K + k) * H + cols, mask=cmask & owned, other=0.0).to(tl.float32)
        tl.store(out + t * H + cols, acc.to(out.dtype.element_ty), mask=cmask)

    return gate_up, down, combine


COMBINE_BH = 512    # hidden columns per combine program


def experts_fused(x, topk_ids, topk_weights, gate_up, down, expert_offset: int = 0,
                  block_m: int = BLOCK_M, block_n: int = 64, block_k: int = 64, num_warps: int = 4,
                  num_stages: int = 3, group_m: int = 1, down_tiles: dict | None = None, fp8: tuple | None = None,
                  direct: bool | None = None):
    """Same function as ops.experts_reference. gate_up: [E, 2I, H]; down: [E, H, I]. The tile
    arguments: backends.AutoExperts' large tiles for long prefill, and e2e/gpu/moe_kernels.py's sweep;
    `group_m` row blocks walk their column tiles together (L2 reuse); `down_tiles` overrides block_n,
    block_k, num_warps, num_stages and group_m for the down kernel (block_m is the layout's).
    `fp8` = (gate_up scale_inv, down scale_inv, quant block) with e4m3 weights (fp8.py's layout: gate's
    and up's block rows quantized apart): each weight tile is dequantized in registers, exactly as
    fp8.dequantize would (fp32 product, cast to x's dtype), so the weights cross HBM as FP8.
    `direct`: block b holds pair b alone, its expert read from topk_ids, and no layout is made (None:
    up to DIRECT_MAX_PAIRS pairs, from the shapes alone)."""
    import triton
    t, k = topk_ids.shape
    e_local, two_i, hidden = gate_up.shape
    inter = two_i // 2
    n = t * k
    ids = topk_ids.contiguous()
    direct = n <= DIRECT_MAX_PAIRS if direct is None else direct
    if direct:   # the kernels read each pair's expert themselves: one launch a layer fewer
        sorted_ids, block_expert, blocks = ids, ids, n
    else:
        lay_out = align_fused if n <= ALIGN_KERNEL_MAX_PAIRS else align_spread
        sorted_ids, block_expert, blocks = lay_out(topk_ids, e_local, expert_offset, block_m)
    wdtype = x.dtype if fp8 is not None else gate_up.dtype
    act = torch.empty(blocks * block_m, inter, dtype=wdtype, device=x.device)
    # owned pairs' rows, all written: weighted outputs in the compute dtype, as the reference's
    y = torch.empty(n, hidden, dtype=wdtype, device=x.device)
    interpret = triton_interpreting()
    k_gate_up, k_down, k_combine = _kernels(interpret)
    xs = x.to(wdtype).contiguous()
    ieee = wdtype == torch.float32 and not interpret
    if fp8 is None:
        qb, s_gu, s_dn = 0, gate_up, down    # unused scale pointers
        st_gu = st_dn = (0, 0, 0)
    else:
        s_gu, s_dn, block = fp8
        qb = block[0]
        st_gu, st_dn = s_gu.stride(), s_dn.stride()
    d = dict(block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages, group_m=group_m)
    d.update(down_tiles or {})
    for bk in (block_k, d["block_k"]) if fp8 is not None else ():
        if block[0] != block[1] or qb % bk:
            raise ValueError(f"fused FP8 experts need square quant blocks that block_k ({bk}) divides, got {block}")

    def tiles(block_n, block_k, num_warps, num_stages, group_m):
        launch = {} if interpret else dict(num_warps=num_warps, num_stages=num_stages)
        return dict(BM=block_m, BN=block_n, BK=block_k, GM=group_m, F32=interpret, IEEE=ieee, QB=qb,
                    DIRECT=direct, **launch)
    k_gate_up[(blocks * triton.cdiv(inter, block_n),)](
        xs, gate_up, sorted_ids, block_expert, act, n, k, hidden, inter, e_local,
        xs.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), s_gu, *st_gu, blocks, expert_offset,
        **tiles(block_n, block_k, num_warps, num_stages, group_m))
    w = topk_weights.reshape(-1).contiguous()
    k_down[(blocks * triton.cdiv(hidden, d["block_n"]),)](
        act, down, sorted_ids, block_expert, w, y, n, hidden, inter, e_local,
        down.stride(0), down.stride(1), down.stride(2), s_dn, *st_dn, blocks, expert_offset, **tiles(**d))
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    k_combine[(t, triton.cdiv(hidden, COMBINE_BH))](y, ids, out, expert_offset, e_local, hidden, k,
                                                    COMBINE_BH, **({} if interpret else dict(num_warps=4)))
    return out
