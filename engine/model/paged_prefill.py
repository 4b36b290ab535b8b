"""Prefill attention straight from the paged KV cache (Triton), every segment of a step in one launch.

The SDPA path (`kernels.prefill_attention`) gathers each segment's context out of the cache and calls
SDPA once per segment and layer: a step of 30 continuation segments is 30 launches and 60 gathers
per layer. Here one program takes block_m query rows of one segment for one query head, walks that
segment's context through its slot list (the same slots the gather would read) up to its last
query's position, and keeps an online softmax: causal, aligned bottom-right (a segment's queries are
the last q_len of its ctx_len positions), GQA by index (query head h reads KV head h // group).
Every step in bf16 on CUDA but those of long fresh prompts (`EngineConfig.prefill_attention: auto`,
i.e. hybrid: those go to cuDNN): timed on the H200 at P1, pd's P epochs of many short segments were
28 % shorter than with SDPA (docs/PERF.md, "Defaults"); tested under Triton's interpreter on CPU and compiled on
the GPU.

A step with few tiles (one continuation of a few hundred tokens fused into D's step: one tile per
head, 32 programs on 132 SMs) would leave most SMs idle while each program walks thousands of keys
alone: 63 µs a layer for 128 new tokens over 2,048 cached on the H200, +3 ms of a fused step's
kernels (e2e/gpu/fused_step.py). Then the walk is split along the context (flash-decoding's split):
each of `splits` programs per tile and head keeps the online softmax of its own stretch, and a
second launch merges the stretches.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .kernels import triton_interpreting

# The launch's tile shape and pipelining: the best of the swept ones at both a whole 8k chunk and a P1
# epoch's short segments (e2e/gpu/attn_kernels.py; figures in docs/PERF.md, "Kernel choices").
TILES = dict(block_m=128, block_n=128, num_warps=8, num_stages=2)
LOG2E = 1.4426950408889634


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    # splits, T, H: sizes only, not specialized (a new T % 16 mid-run would compile a variant)
    @triton.jit(do_not_specialize=["splits", "T", "H"])
    def attend(q_ptr, k_ptr, v_ptr, o_ptr, slots_ptr, tiles_ptr, scale2,
               sq_t, sq_h, sk_s, sk_h, so_t, so_h, part_ptr, ml_ptr, splits, T, H,
               GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               PRECISION: tl.constexpr, F32: tl.constexpr, SPLIT: tl.constexpr):
        # heads vary fastest: the GROUP query heads of one KV head run side by side (its K/V tiles
        # stay in L2), and the longest tiles (plan_tiles' order) start first
        h = tl.program_id(0)
        tile = tl.program_id(1)
        kvh = h // GROUP
        # a tile: first query row (in q), its rows, the first row's context position, the context
        # length visible to its last row, and where its segment's slots start
        row0 = tl.load(tiles_ptr + tile * 5)
        n = tl.load(tiles_ptr + tile * 5 + 1)
        pos0 = tl.load(tiles_ptr + tile * 5 + 2)
        end = tl.load(tiles_ptr + tile * 5 + 3)
        slot0 = tl.load(tiles_ptr + tile * 5 + 4)
        r = tl.arange(0, BM)
        d = tl.arange(0, D)
        rmask = r < n
        qpos = pos0 + r
        q = tl.load(q_ptr + (row0 + r)[:, None].to(tl.int64) * sq_t + h * sq_h + d[None, :],
                    mask=rmask[:, None], other=0.0)
        if F32:   # the interpreter's bf16 dot is wrong; fp32 products of bf16 are exact
            q = q.to(tl.float32)
        # online softmax in base 2 (scale2 = scale · log2 e): exp2 is the SFU's native op
        m = tl.full([BM], float("-inf"), tl.float32)
        l = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        lo, hi = 0, end
        if SPLIT:   # this program's stretch of the walk: whole BN blocks, the last one ragged
            sp = tl.program_id(2)
            stretch = tl.cdiv(tl.cdiv(end, splits), BN) * BN
            lo = sp * stretch
            hi = tl.minimum(end, lo + stretch)
        for start in range(lo, hi, BN):
            kpos = start + tl.arange(0, BN)
            kmask = kpos < hi
            slot = tl.load(slots_ptr + slot0 + kpos, mask=kmask, other=0)
            k = tl.load(k_ptr + slot[:, None] * sk_s + kvh * sk_h + d[None, :], mask=kmask[:, None], other=0.0)
            v = tl.load(v_ptr + slot[:, None] * sk_s + kvh * sk_h + d[None, :], mask=kmask[:, None], other=0.0)
            if F32:
                k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale2
            if start + BN > pos0 + 1:   # the diagonal (bottom-right causal) and the context's end;
                # the blocks before the tile's first row are seen whole by every row
                s = tl.where((kpos[None, :] <= qpos[:, None]) & kmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            # a stretch past a row's position masks all of its keys: keep exp2 off -inf - -inf
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_use)
            p = tl.exp2(s - m_use[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            m = m_new
        if SPLIT:   # this stretch's softmax state, unnormalized: merge() weighs the stretches
            at = (sp * T + row0 + r).to(tl.int64) * H + h   # part: [splits, T, H, D]; ml: [.., 2]
            tl.store(part_ptr + at[:, None] * D + d[None, :], acc, mask=rmask[:, None])
            tl.store(ml_ptr + at * 2, m, mask=rmask)
            tl.store(ml_ptr + at * 2 + 1, l, mask=rmask)
        else:
            out = acc / tl.maximum(l, 1e-30)[:, None]
            tl.store(o_ptr + (row0 + r)[:, None].to(tl.int64) * so_t + h * so_h + d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=rmask[:, None])

    return attend


@functools.cache
def _merge_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["splits", "T", "H"])
    def merge(part_ptr, ml_ptr, o_ptr, tiles_ptr, splits, T, H, so_t, so_h,
              D: tl.constexpr, BM: tl.constexpr):
        # one program per (head, tile): its rows' stretches, in order, with one running softmax
        h = tl.program_id(0)
        tile = tl.program_id(1)
        row0 = tl.load(tiles_ptr + tile * 5)
        n = tl.load(tiles_ptr + tile * 5 + 1)
        r = tl.arange(0, BM)
        d = tl.arange(0, D)
        rmask = r < n
        m = tl.full([BM], float("-inf"), tl.float32)
        l = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for sp in range(0, splits):
            at = ((sp * T + row0 + r).to(tl.int64) * H + h)
            ms = tl.load(ml_ptr + at * 2, mask=rmask, other=float("-inf"))
            ls = tl.load(ml_ptr + at * 2 + 1, mask=rmask, other=0.0)
            part = tl.load(part_ptr + at[:, None] * D + d[None, :], mask=rmask[:, None], other=0.0)
            m_new = tl.maximum(m, ms)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            a, b = tl.exp2(m - m_use), tl.exp2(ms - m_use)
            l = l * a + ls * b
            acc = acc * a[:, None] + part * b[:, None]
            m = m_new
        out = acc / tl.maximum(l, 1e-30)[:, None]
        tl.store(o_ptr + (row0 + r)[:, None].to(tl.int64) * so_t + h * so_h + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=rmask[:, None])

    return merge


MAX_SPLITS = 16


class TilePlan(NamedTuple):
    slots: torch.Tensor   # the segments' slots concatenated (int64)
    tiles: torch.Tensor   # int64 [tiles, 5]: first row, rows, first row's position, context end, slot offset
    splits: int           # programs per tile and head along the context (1: one walk, no merge)


def walk_splits(programs: int, longest: int, sms: int, block_n: int) -> int:
    """Stretches per walk: enough programs for every SM when the tiles alone leave some idle, each
    stretch at least two key blocks (a shorter one is mostly the merge's cost)."""
    if programs >= sms:
        return 1
    return max(1, min(MAX_SPLITS, -(-sms // programs), longest // (2 * block_n)))


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def plan_tiles(seqs, device: torch.device, block_m: int | None = None, heads: int = 1,
               splits: int | None = None) -> TilePlan:
    """The launch's metadata for prefill segments `seqs` (q_start, q_len, ctx_len, slots): their
    slots concatenated (int64), and one int64 row per tile of block_m queries: (first row, rows,
    first row's context position, context its last row sees, offset of the segment's slots),
    longest walk first (a causal segment's last tiles read the most: started last, they would run
    alone at the end of the launch). block_m: the launch's (default TILES'). splits: stretches per
    walk (None: walk_splits for `heads` query heads on the device's SMs; 1 on CPU)."""
    block_m = block_m or TILES["block_m"]
    tiles, offset = [], 0
    for s in seqs:
        first = s.ctx_len - s.q_len
        for m0 in range(0, s.q_len, block_m):
            rows = min(block_m, s.q_len - m0)
            tiles.append((s.q_start + m0, rows, first + m0, first + m0 + rows, offset))
        offset += s.ctx_len
    tiles.sort(key=lambda t: -t[3])
    if splits is None:
        device = torch.device(device)
        splits = walk_splits(len(tiles) * heads, tiles[0][3] if tiles else 0, _sms(device), TILES["block_n"])
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    slots = torch.cat([s.slots.to(device=device, dtype=torch.int64) for s in seqs]) if seqs else \
        torch.zeros(0, dtype=torch.int64, device=device)
    return TilePlan(slots, torch.tensor(tiles, dtype=torch.int64).reshape(-1, 5).to(device, non_blocking=True), splits)


def paged_prefill_attention(q, k_cache, v_cache, seqs, scale: float, out=None, plan=None, tiles: dict | None = None):
    """Same function as kernels.prefill_attention (q: [T, H, D]; k/v_cache: [slots, KVH, D]); `plan`:
    plan_tiles(seqs, ...) when the caller keeps it across layers (one build per step), made with
    the same block_m as `tiles` (default TILES)."""
    cfg = TILES if tiles is None else {**TILES, **tiles}
    out = torch.empty_like(q) if out is None else out
    t, h, d = q.shape
    slots, tile_rows, splits = plan if plan is not None else plan_tiles(seqs, q.device, cfg["block_m"], heads=h)
    if tile_rows.shape[0] == 0:
        return out
    interpret = triton_interpreting()
    warps = {} if interpret else dict(num_warps=cfg["num_warps"])
    if splits > 1:   # each stretch's state, then merged into `out`
        part = torch.empty(splits, t, h, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(splits, t, h, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out   # not read: the launch writes `out` itself
    _kernel()[(h, tile_rows.shape[0], splits)](
        q, k_cache, v_cache, out, slots, tile_rows, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        part, ml, splits, t, h,
        GROUP=h // k_cache.shape[1], D=d, BM=cfg["block_m"], BN=cfg["block_n"],
        PRECISION="ieee" if q.dtype == torch.float32 or interpret else "tf32", F32=interpret, SPLIT=splits > 1,
        **({} if interpret else dict(warps, num_stages=cfg["num_stages"])))
    if splits > 1:
        _merge_kernel()[(h, tile_rows.shape[0])](part, ml, out, tile_rows, splits, t, h, out.stride(0), out.stride(1),
                                                 D=d, BM=cfg["block_m"], **warps)
    return out
