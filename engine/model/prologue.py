"""The attention prologue in one Triton launch a layer: Qwen3's per-head RMSNorm of q and k, RoPE,
and k's and v's writes into the paged cache, in place of the ~15 element-wise kernels the torch ops
take per layer at decode. The same rounding points as the reference ops (normalize in
fp32; weight, each RoPE product and the sum in the activations' dtype), so the reference and this
path differ only by the order of the fp32 sum of squares. Tested under Triton's
interpreter on CPU and compiled on the GPU; on by default in bf16 on CUDA (`qk_prologue: auto`, docs/PERF.md).
"""
from __future__ import annotations

import functools

import torch

from .kernels import triton_interpreting


# Heads per program: a (token, head) program moved too little per thread and re-read the token's
# cos/sin for every head (docs/PERF.md, "Kernel choices").
HEADS_PER_PROGRAM = 16


@functools.cache
def _kernel(interpret: bool):
    import triton
    import triton.language as tl

    # the ints the two branches below assign to one name: never specialized (a 1 would be a constexpr)
    @triton.jit(do_not_specialize=["sq_t", "sq_h", "sk_t", "sk_h", "skc_t", "skc_h", "HQ", "HK", "QP"])
    def qkv_prologue(q, k, v, qw, kw, cos, sin, kc, vc, slots, eps, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
                     skc_t, skc_h, svc_t, svc_h, sc_t, HQ, HK, QP,
                     D: tl.constexpr, BH: tl.constexpr):
        # One launch a layer: programs [0, QP) take BH of q's heads (in place), the rest BH of k's,
        # written to the cache at the token's slot with v's same heads (at decode the separate
        # launches were mostly launch latency: docs/PERF.md)
        t = tl.program_id(0)
        j = tl.program_id(1)
        half = tl.arange(0, D // 2)
        if j < QP:
            slot = t.to(tl.int64)
            src, w, dst = q + t * sq_t, qw, q + t * sq_t
            s_h, d_h, heads, H = sq_h, sq_h, j * BH + tl.arange(0, BH), HQ
        else:
            slot = tl.load(slots + t).to(tl.int64)
            src, w, dst = k + t * sk_t, kw, kc + slot * skc_t
            s_h, d_h, heads, H = sk_h, skc_h, (j - QP) * BH + tl.arange(0, BH), HK
        live = (heads < H)[:, None]
        a = tl.load(src + heads[:, None] * s_h + half[None, :], mask=live, other=0.0).to(tl.float32)
        b = tl.load(src + heads[:, None] * s_h + D // 2 + half[None, :], mask=live, other=0.0).to(tl.float32)
        r = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / D + eps)[:, None]
        dt = q.dtype.element_ty
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
        out = dst + heads[:, None] * d_h + half[None, :]
        tl.store(out, lo, mask=live)
        tl.store(out + D // 2, hi, mask=live)
        if j >= QP:   # v: copied to its cache at the same slot, in the cache's dtype
            full = tl.arange(0, D)
            vals = tl.load(v + t * sv_t + heads[:, None] * sv_h + full[None, :], mask=live, other=0.0)
            tl.store(vc + slot * svc_t + heads[:, None] * svc_h + full[None, :],
                     vals.to(vc.dtype.element_ty), mask=live)

    return qkv_prologue


def qk_prologue(q, k, v, q_weight, k_weight, eps: float, cos, sin, k_cache, v_cache, slot_mapping):
    """q normalized and rotated in place (returned); k normalized, rotated and written to k_cache at
    slot_mapping; v copied to v_cache. Same result as the torch ops in Attention.project."""
    import triton
    if k_cache.dtype != k.dtype:
        raise ValueError(f"the fused prologue rounds in the activations' dtype: KV cache {k_cache.dtype} "
                         f"!= activations {k.dtype}")
    t, heads, d = q.shape
    if t == 0:
        return q
    kv_heads = k.shape[1]
    bh = min(triton.next_power_of_2(max(heads, kv_heads)), HEADS_PER_PROGRAM)
    q_programs = triton.cdiv(heads, bh)
    _kernel(triton_interpreting())[(t, q_programs + triton.cdiv(kv_heads, bh))](
        q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, slot_mapping, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), cos.stride(0),
        heads, kv_heads, q_programs, D=d, BH=bh)
    return q
