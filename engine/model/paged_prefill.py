"""Prefill attention straight from the paged KV cache (Triton), every segment of a step in one launch.

The SDPA path (`kernels.prefill_attention`) gathers each segment's context out of the cache and calls
SDPA once per segment and layer: a step of 30 continuation segments is 30 launches and 60 gathers
per layer. Here one program takes block_m query rows of one segment for one query head, walks that
segment's context through its slot list (the same slots the gather would read) up to its last
query's position, and keeps an online softmax: causal, aligned bottom-right (a segment's queries are
the last q_len of its ctx_len positions), GQA by index (query head h reads KV head h // group).
The default in bf16 on CUDA (`EngineConfig.prefill_attention: auto`): timed on the H200 at P1, pd's
P epochs of many short segments were 28 % shorter than with SDPA (docs/PERF.md); tested under
Triton's interpreter on CPU and compiled on the GPU.
"""
from __future__ import annotations

import functools

import torch

from .kernels import triton_interpreting

# The launch's tile shape and pipelining, swept by e2e/gpu/attn_kernels.py on the H200: 128 × 128 with
# 8 warps was within 1.3 % of the best of 36 at both the 8k chunk (309 TFLOP/s) and a P1 epoch's 32
# segments, where 64 × 64 with 4 warps ran 258 and 212 (docs/PERF.md)
TILES = dict(block_m=128, block_n=128, num_warps=8, num_stages=2)
LOG2E = 1.4426950408889634


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def attend(q_ptr, k_ptr, v_ptr, o_ptr, slots_ptr, tiles_ptr, scale2,
               sq_t, sq_h, sk_s, sk_h, so_t, so_h,
               GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               PRECISION: tl.constexpr, F32: tl.constexpr):
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
        for start in range(0, end, BN):
            kpos = start + tl.arange(0, BN)
            kmask = kpos < end
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
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            m = m_new
        out = acc / tl.maximum(l, 1e-30)[:, None]
        tl.store(o_ptr + (row0 + r)[:, None].to(tl.int64) * so_t + h * so_h + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=rmask[:, None])

    return attend


def plan_tiles(seqs, device: torch.device, block_m: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch's metadata for prefill segments `seqs` (q_start, q_len, ctx_len, slots): their
    slots concatenated (int64), and one int64 row per tile of block_m queries: (first row, rows,
    first row's context position, context its last row sees, offset of the segment's slots),
    longest walk first (a causal segment's last tiles read the most: started last, they would run
    alone at the end of the launch). block_m: the launch's (default TILES')."""
    block_m = block_m or TILES["block_m"]
    tiles, offset = [], 0
    for s in seqs:
        first = s.ctx_len - s.q_len
        for m0 in range(0, s.q_len, block_m):
            rows = min(block_m, s.q_len - m0)
            tiles.append((s.q_start + m0, rows, first + m0, first + m0 + rows, offset))
        offset += s.ctx_len
    tiles.sort(key=lambda t: -t[3])
    slots = torch.cat([s.slots.to(device=device, dtype=torch.int64) for s in seqs]) if seqs else \
        torch.zeros(0, dtype=torch.int64, device=device)
    return slots, torch.tensor(tiles, dtype=torch.int64).reshape(-1, 5).to(device, non_blocking=True)


def paged_prefill_attention(q, k_cache, v_cache, seqs, scale: float, out=None, plan=None, tiles: dict | None = None):
    """Same function as kernels.prefill_attention (q: [T, H, D]; k/v_cache: [slots, KVH, D]); `plan`:
    plan_tiles(seqs, ...) when the caller keeps it across layers (one build per step), made with
    the same block_m as `tiles` (default TILES)."""
    cfg = TILES if tiles is None else {**TILES, **tiles}
    out = torch.empty_like(q) if out is None else out
    slots, tile_rows = plan if plan is not None else plan_tiles(seqs, q.device, cfg["block_m"])
    if tile_rows.shape[0] == 0:
        return out
    h, d = q.shape[1], q.shape[2]
    interpret = triton_interpreting()
    _kernel()[(h, tile_rows.shape[0])](
        q, k_cache, v_cache, out, slots, tile_rows, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        GROUP=h // k_cache.shape[1], D=d, BM=cfg["block_m"], BN=cfg["block_n"],
        PRECISION="ieee" if q.dtype == torch.float32 or interpret else "tf32", F32=interpret,
        **({} if interpret else dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])))
    return out
