"""The attention prologue in one Triton kernel per operand: Qwen3's per-head RMSNorm of q and k,
RoPE, and k's write into the paged cache (v is one copy), in place of the ~15 element-wise kernels
the torch ops take per layer at decode. The same rounding points as the reference ops (normalize in
fp32; weight, each RoPE product and the sum in the activations' dtype), so the reference and this
path differ only by the order of the fp32 sum of squares. Tested under Triton's
interpreter on CPU and compiled on the GPU; on by default in bf16 on CUDA (`qk_prologue: auto`, docs/PERF.md).
"""
from __future__ import annotations

import functools

import torch

from .kernels import triton_interpreting


# Heads per program: a (token, head) program moved 2·D elements with 128 threads and re-read the
# token's cos/sin per head; prefill's q (8k tokens × 32 heads) ran at ~0.7 TB/s (docs/PERF.md).
HEADS_PER_PROGRAM = 16


@functools.cache
def _kernel(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit
    def norm_rope(x, w, cos, sin, out, slots, eps, sx_t, sx_h, so_t, so_h, sc_t, H,
                  D: tl.constexpr, BH: tl.constexpr, TO_SLOTS: tl.constexpr):
        t = tl.program_id(0)
        heads = tl.program_id(1) * BH + tl.arange(0, BH)
        half = tl.arange(0, D // 2)
        live = (heads < H)[:, None]
        src = x + t * sx_t + heads[:, None] * sx_h + half[None, :]
        a = tl.load(src, mask=live, other=0.0).to(tl.float32)
        b = tl.load(src + D // 2, mask=live, other=0.0).to(tl.float32)
        r = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / D + eps)[:, None]
        dt = out.dtype.element_ty
        # weight * normalized, in the activations' dtype (as the reference's `weight * xf.to(dtype)`)
        wa = tl.load(w + half).to(tl.float32)[None, :]
        wb = tl.load(w + D // 2 + half).to(tl.float32)[None, :]
        a = (wa * (a * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        b = (wb * (b * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c1 = tl.load(cos + t * sc_t + half).to(tl.float32)[None, :]
        c2 = tl.load(cos + t * sc_t + D // 2 + half).to(tl.float32)[None, :]
        s1 = tl.load(sin + t * sc_t + half).to(tl.float32)[None, :]
        s2 = tl.load(sin + t * sc_t + D // 2 + half).to(tl.float32)[None, :]
        # x * cos + rotate_half(x) * sin, each product and the sum rounded like the reference's
        lo = ((a * c1).to(dt).to(tl.float32) + (-b * s1).to(dt).to(tl.float32)).to(dt)
        hi = ((b * c2).to(dt).to(tl.float32) + (a * s2).to(dt).to(tl.float32)).to(dt)
        row = tl.load(slots + t) if TO_SLOTS else t
        dst = out + row * so_t + heads[:, None] * so_h + half[None, :]
        tl.store(dst, lo, mask=live)
        tl.store(dst + D // 2, hi, mask=live)

    return norm_rope


def _norm_rope(x, w, cos, sin, out, slots, eps: float) -> None:
    import triton
    t, heads, d = x.shape
    if t == 0:
        return
    to_slots = slots is not None
    bh = min(triton.next_power_of_2(heads), HEADS_PER_PROGRAM)
    _kernel(triton_interpreting())[(t, triton.cdiv(heads, bh))](
        x, w, cos, sin, out, slots if to_slots else x, eps, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        cos.stride(0), heads, D=d, BH=bh, TO_SLOTS=to_slots)


def qk_prologue(q, k, v, q_weight, k_weight, eps: float, cos, sin, k_cache, v_cache, slot_mapping):
    """q normalized and rotated in place (returned); k normalized, rotated and written to k_cache at
    slot_mapping; v copied to v_cache. Same result as the torch ops in Attention.project."""
    if k_cache.dtype != k.dtype:
        raise ValueError(f"the fused prologue rounds in the activations' dtype: KV cache {k_cache.dtype} "
                         f"!= activations {k.dtype}")
    _norm_rope(q, q_weight, cos, sin, q, None, eps)
    _norm_rope(k, k_weight, cos, sin, k_cache, slot_mapping, eps)
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return q
