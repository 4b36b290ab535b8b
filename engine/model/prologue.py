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


@functools.cache
def _kernel(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit
    def norm_rope(x, w, cos, sin, out, slots, eps, sx_t, sx_h, so_t, so_h, sc_t,
                  D: tl.constexpr, TO_SLOTS: tl.constexpr):
        t, h = tl.program_id(0), tl.program_id(1)
        half = tl.arange(0, D // 2)
        src = x + t * sx_t + h * sx_h
        a = tl.load(src + half).to(tl.float32)
        b = tl.load(src + D // 2 + half).to(tl.float32)
        r = tl.rsqrt((tl.sum(a * a, 0) + tl.sum(b * b, 0)) / D + eps)
        dt = out.dtype.element_ty
        # weight * normalized, in the activations' dtype (as the reference's `weight * xf.to(dtype)`)
        a = (tl.load(w + half).to(tl.float32) * (a * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        b = (tl.load(w + D // 2 + half).to(tl.float32) * (b * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c1 = tl.load(cos + t * sc_t + half).to(tl.float32)
        c2 = tl.load(cos + t * sc_t + D // 2 + half).to(tl.float32)
        s1 = tl.load(sin + t * sc_t + half).to(tl.float32)
        s2 = tl.load(sin + t * sc_t + D // 2 + half).to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product and the sum rounded like the reference's
        lo = ((a * c1).to(dt).to(tl.float32) + (-b * s1).to(dt).to(tl.float32)).to(dt)
        hi = ((b * c2).to(dt).to(tl.float32) + (a * s2).to(dt).to(tl.float32)).to(dt)
        row = tl.load(slots + t) if TO_SLOTS else t
        dst = out + row * so_t + h * so_h
        tl.store(dst + half, lo)
        tl.store(dst + D // 2 + half, hi)

    return norm_rope


def _norm_rope(x, w, cos, sin, out, slots, eps: float) -> None:
    t, heads, d = x.shape
    if t == 0:
        return
    to_slots = slots is not None
    _kernel(triton_interpreting())[(t, heads)](
        x, w, cos, sin, out, slots if to_slots else x, eps, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        cos.stride(0), D=d, TO_SLOTS=to_slots)


def qk_prologue(q, k, v, q_weight, k_weight, eps: float, cos, sin, k_cache, v_cache, slot_mapping):
    """q normalized and rotated in place (returned); k normalized, rotated and written to k_cache at
    slot_mapping; v copied to v_cache. Same result as the torch ops in Attention.forward."""
    if k_cache.dtype != k.dtype:
        raise ValueError(f"the fused prologue rounds in the activations' dtype: KV cache {k_cache.dtype} "
                         f"!= activations {k.dtype}")
    _norm_rope(q, q_weight, cos, sin, q, None, eps)
    _norm_rope(k, k_weight, cos, sin, k_cache, slot_mapping, eps)
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return q
