"""The fused attention prologue (model/prologue.py: per-head RMSNorm, RoPE, KV write) against the
torch ops of Attention.project, on CPU under Triton's interpreter (run by test_triton_interpreted.py
in a process of its own)."""
from __future__ import annotations

import pytest
import torch

from interp import interpreted  # noqa: F401 (an autouse fixture)
from pdrollout.engine.model import ops
from pdrollout.engine.model.prologue import qk_prologue


def _reference(q, k, v, qw, kw, eps, cos, sin, k_cache, v_cache, slots):
    q = ops.apply_rope(ops.rms_norm(q, qw, eps), cos, sin)
    k = ops.apply_rope(ops.rms_norm(k, kw, eps), cos, sin)
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
    return q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads", [(1, 8, 2), (7, 8, 2), (5, 20, 4), (3, 4, 1)])
def test_fused_prologue_matches_the_torch_ops(dtype, tokens, heads, kv_heads):
    """20 heads: two programs of 16 per token, the second one's last 12 masked. q, k and v are views
    of one projection's output, as Attention.project hands them over (row stride past their width)."""
    g = torch.Generator().manual_seed(tokens)
    d, nslots, eps = 64, 40, 1e-6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q, k, v = (part.view(tokens, -1, d) for part in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    qw, kw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype), (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    cos, sin = ops.rope_cos_sin(torch.randint(0, 4000, (tokens,), generator=g), inv, dtype)
    slots = torch.randperm(nslots, generator=g)[:tokens]
    caches = [torch.zeros(nslots, kv_heads, d, dtype=dtype) for _ in range(4)]
    want = _reference(q.clone(), k, v, qw, kw, eps, cos, sin, caches[0], caches[1], slots)
    got = qk_prologue(q.clone(), k, v, qw, kw, eps, cos, sin, caches[2], caches[3], slots)
    # fp32: only the order of the sum of squares differs. bf16: the interpreter casts fp32 -> bf16 by
    # truncation (the GPU rounds to nearest: tests/engine/test_kernels.py holds it to 2 ulps), and
    # the path casts 4 times, so up to ~4 ulps (2^-7 each) here
    tol = 1e-6 if dtype == torch.float32 else 4 * 2 ** -7
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.allclose(caches[2].float(), caches[0].float(), atol=tol, rtol=tol)
    assert torch.equal(caches[3], caches[1])
    untouched = torch.ones(nslots, dtype=torch.bool)
    untouched[slots] = False
    assert not caches[2][untouched].any() and not caches[3][untouched].any()   # nothing outside the slots given


def test_a_kv_cache_of_another_dtype_is_refused():
    x = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="KV cache torch.bfloat16 != activations torch.float32"):
        qk_prologue(x, x, x, torch.ones(8), torch.ones(8), 1e-6, torch.ones(1, 8), torch.zeros(1, 8),
                    torch.zeros(2, 1, 8, dtype=torch.bfloat16), torch.zeros(2, 1, 8, dtype=torch.bfloat16),
                    torch.tensor([0]))
