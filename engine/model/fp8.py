"""Block-wise FP8 weights (the Hugging Face layout of Qwen3 and DeepSeek FP8 releases).

A quantized linear holds `weight` as float8_e4m3fn [out, in] and `weight_scale_inv` as float32
[ceil(out/128), ceil(in/128)]: the real weight is `weight.float() * scale` with each scale covering
one 128x128 block (the last row/column of blocks may be partial). The weights stay FP8 in memory
(half the bytes of bf16); a forward dequantizes them on the fly, one linear or one expert at a
time, so no full-precision copy of the model is ever held.

  CPU and default CUDA   dequantize (fp32 product, cast to the activations' dtype), then matmul:
                         the reference path, equal to a checkpoint holding the dequantized values;
                         experts: one routed expert at a time on CPU, a layer's experts at once
                         into the grouped GEMM on CUDA (qwen3_moe.MoEBlock; graph-capturable)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0    # largest finite e4m3fn value


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return _ceil(rows, block[0]), _ceil(cols, block[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., out, in] weights of `dtype` (leading dims: experts): the product is formed in fp32
    (as a dequantized checkpoint is written), then cast once."""
    rows, cols = weight.shape[-2:]
    s = scale_inv.float().repeat_interleave(block[0], -2)[..., :rows, :]
    s = s.repeat_interleave(block[1], -1)[..., :cols]
    return (weight.float() * s).to(dtype)


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale_inv) of a [out, in] tensor: each block's absolute maximum maps
    to FP8_MAX (the scheme of the FP8 releases' quantizers)."""
    rows, cols = w.shape
    nr, nc = scale_shape(rows, cols, block)
    padded = torch.zeros(nr * block[0], nc * block[1], dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(nr, block[0], nc, block[1])
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).view(nr * block[0], nc * block[1])[:rows, :cols]
    return q.to(FP8).contiguous(), scale.float().contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
           bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize(weight, scale_inv, block, x.dtype), bias)


class Fp8Linear(nn.Module):
    """nn.Linear's interface over block-FP8 weights; parameter names are the checkpoint's."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], bias: bool = False):
        super().__init__()
        self.block = block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(*scale_shape(out_features, in_features, block),
                                                         dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._dequantized = None   # (key, weights): CUDA's copy in the activations' dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        return linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights dequantized once per (storage, dtype), not per call: dequantizing the
        attention linears in every forward was a large share of a decode step (docs/PERF.md), and
        these linears are a small share of the weights (the experts stay e4m3, fused_moe.py).
        Keyed by the tensors' addresses, so weights moved by a memory resume are dequantized again."""
        key = (self.weight.data_ptr(), self.weight_scale_inv.data_ptr(), dtype)
        if self._dequantized is None or self._dequantized[0] != key:
            self._dequantized = (key, dequantize(self.weight, self.weight_scale_inv, self.block, dtype))
        return self._dequantized[1]

    def drop_derived(self) -> None:
        """A memory release frees the weights: their dequantized copy goes too."""
        self._dequantized = None


def make_linear(in_features: int, out_features: int, block: tuple[int, int] | None, bias: bool = False) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias) if block is None else \
        Fp8Linear(in_features, out_features, block, bias)


def expert_weights(experts, e: int | slice, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Local expert e's (gate_up [2I, H], down [H, I]) in `dtype` (a slice of experts: [E, ...]).
    Gate and up are quantized separately in the checkpoint (their blocks restart at row I), so
    each half has its own block rows of the fused scale."""
    i, b = experts.inter, experts.block
    nb = _ceil(i, b[0])
    gu, s = experts.gate_up_proj[e], experts.gate_up_proj_scale_inv[e]
    gate_up = torch.cat([dequantize(gu[..., :i, :], s[..., :nb, :], b, dtype),
                         dequantize(gu[..., i:, :], s[..., nb:, :], b, dtype)], dim=-2)
    return gate_up, dequantize(experts.down_proj[e], experts.down_proj_scale_inv[e], b, dtype)


def experts_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts,
                    expert_offset: int = 0) -> torch.Tensor:
    """Routed SwiGLU over FP8 experts, one expert at a time, each dequantized only when a row is
    routed to it (the same order of operations as ops.experts_reference). Ids outside this
    shard contribute nothing."""
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    local = topk_ids - expert_offset
    for e in torch.unique(local).tolist():
        if e < 0 or e >= experts.gate_up_proj.shape[0]:
            continue
        tok, slot = torch.where(local == e)
        gate_up, down = expert_weights(experts, e, x.dtype)
        gate, up = F.linear(x[tok], gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down)
        out.index_add_(0, tok, y * topk_weights[tok, slot, None])
    return out
