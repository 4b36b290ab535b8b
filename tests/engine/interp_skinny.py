"""The skinny dense projection (model/skinny.py: a few rows against a weight, one launch over its
columns) against F.linear, on CPU under Triton's interpreter (run by test_triton_interpreted.py in a
process of its own); compiled on the GPU by tests/engine/test_kernels.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from interp import interpreted, rel  # noqa: F401 (interpreted: an autouse fixture)
from pdrollout.engine.model import skinny
from pdrollout.engine.model.backends import Backends, ReferenceAttention, ReferenceExperts


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows,n,k,tiles", [
    (1, 40, 72, {}),                                  # the defaults: column and K tiles past both sizes
    (3, 100, 300, dict(block_n=32, block_k=64)),      # a partial last column tile and K step
    (16, 48, 64, dict(block_n=16, block_k=32)),       # a full row tile
])
def test_a_few_rows_match_f_linear(dtype, tol, rows, n, k, tiles):
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    got = skinny.linear_rows(x, w, **tiles)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert rel(got, F.linear(x.double(), w.double())) < tol


def test_a_view_of_the_fused_qkv_rows_and_strided_rows():
    """The q/k/v weight is a view of one storage (Attention._qkv_weight) and the router's input a
    row slice; both are read as they are."""
    g = torch.Generator().manual_seed(2)
    storage = torch.randn(3 * 24, 32, generator=g)
    w = storage.as_strided((3 * 24, 32), (32, 1))
    x = torch.randn(5, 64, generator=g)[:, :32]       # rows 64 apart
    assert rel(skinny.linear_rows(x, w), F.linear(x.double(), w.double())) < 1e-6


def test_more_rows_than_one_tile_or_a_mismatch_is_refused():
    with pytest.raises(ValueError, match="up to 16 rows, got 17"):
        skinny.linear_rows(torch.zeros(17, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"x \(2, 8\) torch.float32 against weight \(4, 6\)"):
        skinny.linear_rows(torch.zeros(2, 8), torch.zeros(4, 6))


def test_backends_take_the_skinny_launch_only_for_a_few_rows(monkeypatch):
    """Backends.dense: the launch up to MAX_ROWS rows, F.linear past it and for an empty batch (a rank
    with no rows this step); a Backends without it is F.linear throughout."""
    calls = []
    real = skinny.linear_rows
    b = Backends(ReferenceAttention(), ReferenceExperts(), linear=lambda x, w: calls.append(x.shape[0]) or real(x, w))
    w = torch.randn(24, 32)
    for rows in (1, 16, 17, 0):
        x = torch.randn(rows, 32)
        assert rel(b.dense(x, w), F.linear(x.double(), w.double())) < 1e-6 if rows else b.dense(x, w).shape == (0, 24)
    assert calls == [1, 16]
    assert Backends(ReferenceAttention(), ReferenceExperts()).dense(torch.ones(1, 32), w).shape == (1, 24)
