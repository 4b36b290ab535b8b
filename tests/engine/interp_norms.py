"""The fused residual add + RMSNorm (model/norms.py) against the torch ops, on CPU under Triton's
interpreter (run by test_triton_interpreted.py in a process of its own); compiled on the GPU by
tests/engine/test_kernels.py."""
from __future__ import annotations

import pytest
import torch

from interp import interpreted, rel  # noqa: F401 (interpreted: an autouse fixture)
from pdrollout.engine.model.norms import fused_add_norm, torch_add_norm


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows,hidden", [(1, 128), (7, 96), (33, 200)])    # 96, 200: a masked tail
@pytest.mark.parametrize("add", [True, False])
def test_fused_add_norm_matches_the_torch_ops(dtype, tol, rows, hidden, add):
    g = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    y = torch.randn(rows, hidden, generator=g).to(dtype) if add else None
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    got_x, got_h = fused_add_norm(x, y, w, 1e-6)
    ref_x, ref_h = torch_add_norm(x, y, w, 1e-6)
    assert got_h.dtype == dtype and got_h.shape == x.shape
    if add:
        assert torch.equal(got_x, ref_x) if dtype == torch.float32 else rel(got_x, ref_x) < 1e-2
    else:
        assert got_x is x          # nothing added: the residual is the input itself
    assert rel(got_h, ref_h) < tol


def test_no_rows():
    x = torch.empty(0, 64)
    out_x, out_h = fused_add_norm(x, torch.empty(0, 64), torch.ones(64), 1e-6)
    assert out_x.shape == out_h.shape == (0, 64)


def test_a_model_through_the_fused_add_norm_equals_the_reference():
    """Every residual add and the norm after it through the kernel (the first layer's norm alone,
    the last layer's add alone): the same fp32 logits as the torch ops."""
    from conftest import tiny_prompt_forward
    from pdrollout.engine.model.backends import REFERENCE, Backends
    from pdrollout.engine.protocol.config import load_preset
    calls = []

    def counted(*args):
        calls.append(args[1] is None)
        return fused_add_norm(*args)
    logits = [tiny_prompt_forward(b) for b in (REFERENCE, Backends(REFERENCE.attention, REFERENCE.experts, counted))]
    assert rel(logits[1], logits[0]) < 1e-5
    layers = load_preset("tiny")["num_hidden_layers"]    # the first norm alone, then two adds per layer but the last's
    assert len(calls) == 2 * layers and calls.count(True) == 1
