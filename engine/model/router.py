"""Qwen3-MoE routing in one pass per token (Triton): softmax over the experts in fp32, the top k,
their renormalized weights. The torch ops take ~6 kernels for it (softmax, a top-k gather and its
sort, the sum, the division, the cast), a measurable share of a decode step (docs/PERF.md). The
default in bf16 (`EngineConfig.router: auto`); tested under Triton's interpreter on CPU and
compiled on the GPU. A row whose live count is 0 (a decode graph's padding row: `ForwardBatch.live`)
gets no expert (ids -1, weights 0) in the same pass.

Ties: experts are picked by the highest probability, the lower expert id first among equals (the
reference's torch.topk leaves the order of equal values unspecified).
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
    def route(logits, out_w, out_ids, sl, live, E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr,
              K_PAD: tl.constexpr, NORM: tl.constexpr, LIVE: tl.constexpr):
        row = tl.program_id(0)
        e = tl.arange(0, E_PAD)
        emask = e < E
        x = tl.load(logits + row * sl + e, mask=emask, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, 0))
        p = p / tl.sum(p, 0)                       # the softmax, as the reference computes it
        left = tl.where(emask, p, -1.0)
        kk = tl.arange(0, K_PAD)
        w = tl.zeros([K_PAD], tl.float32)
        ids = tl.zeros([K_PAD], tl.int64)
        for j in tl.static_range(K):
            top = tl.max(left, 0)
            pick = tl.min(tl.where(left == top, e, E_PAD), 0)   # the lowest id among equals
            w = tl.where(kk == j, top, w)
            ids = tl.where(kk == j, pick.to(tl.int64), ids)
            left = tl.where(e == pick, -1.0, left)
        if NORM:
            w = w / tl.sum(w, 0)
        if LIVE:   # a padding row (count 0): no expert, so the experts' kernels skip its pairs
            dead = tl.load(live + row) == 0
            w = tl.where(dead, 0.0, w)
            ids = tl.where(dead, -1, ids)
        kmask = kk < K
        tl.store(out_w + row * K + kk, w.to(out_w.dtype.element_ty), mask=kmask)
        tl.store(out_ids + row * K + kk, ids, mask=kmask)

    return route


def fused_route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool, dtype: torch.dtype,
                live: torch.Tensor | None = None):
    """Same function as ops.route: (weights [T, k] in `dtype`, expert ids [T, k] int64); `live` as there."""
    import triton
    t, e = router_logits.shape
    weights = torch.empty(t, top_k, dtype=dtype, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    if t:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        _kernel(triton_interpreting())[(t,)](
            logits, weights, ids, logits.stride(0), ids if live is None else live, E=e,
            E_PAD=triton.next_power_of_2(e), K=top_k, K_PAD=triton.next_power_of_2(top_k), NORM=norm_topk_prob,
            LIVE=live is not None)
    return weights, ids
