"""The residual add and the RMSNorm after it, in one pass over the row (Triton): what the torch ops
do in ~7 element-wise kernels per norm (the add, the fp32 cast, square, mean, rsqrt, two products),
each a trip through HBM. The same rounding points as the reference (`x + y` rounded to the
activations' dtype; normalize in fp32; weight × normalized in the activations' dtype), so the two
differ only by the order of the fp32 sum of squares. The default in bf16 on CUDA
(`EngineConfig.add_norm: auto`, timed: docs/PERF.md); tested under Triton's interpreter on CPU and
compiled on the GPU.
"""
from __future__ import annotations

import functools

import torch

from . import ops
from .kernels import triton_interpreting


def torch_add_norm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(x + y, rms_norm(x + y)); y None: (x, rms_norm(x)). The reference ops."""
    if y is not None:
        x = x + y
    return x, ops.rms_norm(x, weight, eps)


@functools.cache
def _kernel(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit
    def add_norm(x, y, w, out_x, out_h, eps, sx, sy, sox, soh, H: tl.constexpr, BLOCK: tl.constexpr,
                 ADD: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        dt = out_h.dtype.element_ty
        a = tl.load(x + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
        if ADD:   # the sum rounded to the activations' dtype, as `x + y` is
            b = tl.load(y + row * sy + cols, mask=mask, other=0.0).to(tl.float32)
            s = (a + b).to(dt)
            tl.store(out_x + row * sox + cols, s, mask=mask)
            a = s.to(tl.float32)
        r = tl.rsqrt(tl.sum(a * a, 0) / H + eps)
        wt = tl.load(w + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_h + row * soh + cols, (wt * (a * r).to(dt).to(tl.float32)).to(dt), mask=mask)

    return add_norm


def fused_add_norm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """Same function as torch_add_norm; rows of x (and y) contiguous in their last dim."""
    import triton
    t, hidden = x.shape
    out_x = torch.empty_like(x) if y is not None else x
    out_h = torch.empty_like(x)
    if t:
        add = y is not None
        yy = y if add else x
        _kernel(triton_interpreting())[(t,)](
            x, yy, weight, out_x, out_h, eps, x.stride(0), yy.stride(0), out_x.stride(0), out_h.stride(0),
            H=hidden, BLOCK=triton.next_power_of_2(hidden), ADD=add)
    return out_x, out_h
