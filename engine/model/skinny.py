"""Dense projections of a few rows (a decode step's tail: 1-16 rows) in one Triton launch over the
weight's output columns, for cuBLAS's GEMMs there. At one row on the H200 a layer's q/k/v, o_proj and
router GEMMs took 7.8, 8.8 (split-K and its reduce) and 4.9 µs against 5.0, 4.0 and 0.1 µs of HBM
for their weights (docs/perf/HISTORY.md, nineteenth session): at this size a GEMM is a read of its weight,
and what it costs beyond that is launch shape. Each program reads BN of the weight's rows once for
all the step's rows (one 16-row tile, tl.dot's minimum) and accumulates in fp32, as cuBLAS does; only
the order of the K sum differs. Opt-in (`EngineConfig.dense_kernel: skinny`): timed on the H200
(e2e/gpu/dense_kernels.py, docs/perf/HISTORY.md, twentieth session) it matched cuBLAS on q/k/v, lost on o_proj
(9.1 against 7.5-8.3 µs) and gained < 1 µs on the router, and the one-row decode step was 2 % slower
with it, so cuBLAS stays the default; kept for other shapes and devices, tested under Triton's
interpreter on CPU and against cuBLAS on CUDA.
"""
from __future__ import annotations

import functools

import torch

from .kernels import triton_interpreting

MAX_ROWS = 16   # one row tile; past it the GEMM's own tiles pay off


# (block_n, block_k, num_warps, num_stages): narrow column tiles so that even o_proj's 2,048 columns
# give a program to every SM. The H200's sweep preferred wider ones per shape (64/128 for q/k/v, 32/512
# for o_proj and the router: docs/perf/HISTORY.md, twentieth session), none beating cuBLAS enough
# to change the default, so these stay
TILES = (16, 256, 4, 4)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["m"])
    def skinny(x, w, y, m, sx, sw, sy, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, F32: tl.constexpr, IEEE: tl.constexpr):
        rows = tl.arange(0, BM)
        rmask = rows < m
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        cmask = cols < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < K
            a = tl.load(x + rows[:, None] * sx + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w + cols[None, :] * sw + ks[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
            if F32:   # the interpreter's bf16 dot is wrong; fp32 products of bf16 are exact
                a, b = a.to(tl.float32), b.to(tl.float32)
            if IEEE:   # fp32 weights: no TF32 rounding
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        tl.store(y + rows[:, None] * sy + cols[None, :], acc.to(y.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])

    return skinny


def linear_rows(x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None, block_k: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x @ weight.T for up to MAX_ROWS rows of x ([m, K]; weight [N, K], no bias): F.linear's result up
    to the order of the fp32 sum. The tile arguments default to TILES (the sweep's to set)."""
    import triton
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"linear_rows takes up to {MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or weight.dtype != x.dtype:
        raise ValueError(f"linear_rows: x {tuple(x.shape)} {x.dtype} against weight {tuple(weight.shape)} {weight.dtype}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bn, bk, warps, stages = (a if a is not None else d for a, d in zip((block_n, block_k, num_warps, num_stages), TILES))
    x, weight = x.contiguous(), weight.contiguous()
    interpret = triton_interpreting()
    launch = {} if interpret else dict(num_warps=warps, num_stages=stages)
    _kernel()[(triton.cdiv(n, bn),)](x, weight, y, m, x.stride(0), weight.stride(0), y.stride(0), N=n, K=k,
                                     BM=MAX_ROWS, BN=bn, BK=bk, F32=interpret,
                                     IEEE=x.dtype == torch.float32 and not interpret, **launch)
    return y
