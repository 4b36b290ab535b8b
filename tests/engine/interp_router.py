"""The fused router (model/router.py) against ops.route, on CPU under Triton's interpreter (run by
test_triton_interpreted.py in a process of its own); compiled on the GPU by tests/engine/test_kernels.py."""
from __future__ import annotations

import pytest
import torch

from interp import interpreted  # noqa: F401 (an autouse fixture)
from pdrollout.engine.model import ops
from pdrollout.engine.model.router import fused_route


@pytest.mark.parametrize("experts,k", [(128, 8), (60, 4), (16, 1)])   # 60: a masked tail
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_route_matches_the_reference(experts, k, norm, dtype):
    g = torch.Generator().manual_seed(experts + k)
    logits = (torch.randn(37, experts, generator=g) * 2).to(dtype)
    w, ids = fused_route(logits, k, norm, dtype)
    ref_w, ref_ids = ops.route(logits, k, norm, dtype)
    assert w.dtype == dtype and ids.dtype == torch.int64 and w.shape == ids.shape == (37, k)
    # the same logits picked, in the same (descending) order; in bf16 equal logits are common, and
    # which of two equal ones torch.topk takes is unspecified, so ids are compared in fp32 only
    assert torch.equal(logits.gather(1, ids), logits.gather(1, ref_ids))
    if dtype == torch.float32:
        assert torch.equal(ids, ref_ids)
    if dtype == torch.float32:
        assert torch.allclose(w, ref_w, rtol=1e-6, atol=1e-7)
    else:
        assert torch.allclose(w.float(), ref_w.float(), rtol=2 ** -7, atol=0)
    if norm:
        assert torch.allclose(w.float().sum(1), torch.ones(37), atol=2e-2 if dtype == torch.bfloat16 else 1e-6)


def test_equal_probabilities_pick_the_lower_expert_id():
    logits = torch.zeros(2, 8)
    logits[0, [2, 5, 6]] = 3.0      # a three-way tie for two places
    logits[1, 7] = 1.0
    _, ids = fused_route(logits, 2, True, torch.float32)
    assert ids[0].tolist() == [2, 5]
    assert ids[1].tolist() == [7, 0]   # then the lowest of the seven equal rest


def test_no_tokens():
    w, ids = fused_route(torch.empty(0, 16), 2, True, torch.bfloat16)
    assert w.shape == ids.shape == (0, 2)


def test_a_model_through_the_fused_router_picks_the_same_experts():
    """Every MoE layer routed by the kernel: the same expert ids as the torch ops and the same fp32
    logits (the routing weights differ only in the softmax's rounding)."""
    from conftest import tiny_prompt_forward
    from pdrollout.engine.model.backends import REFERENCE, Backends
    routes: tuple[list, list] = ([], [])
    logits = [tiny_prompt_forward(REFERENCE, routes[0]),
              tiny_prompt_forward(Backends(REFERENCE.attention, REFERENCE.experts, router=fused_route), routes[1])]
    routes = tuple(torch.stack(r) for r in routes)
    assert routes[0].numel() > 0 and torch.equal(routes[0], routes[1])
    assert ((logits[1] - logits[0]).norm() / logits[0].norm()).item() < 1e-5


def test_padding_rows_route_to_no_expert():
    """`live` (a decode graph's seq_lens): rows at 0 get ids -1 and weights 0; the others as without it."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 16, generator=g)
    live = torch.tensor([3, 0, 5, 0], dtype=torch.int32)
    w, ids = fused_route(logits, 2, True, torch.float32, live)
    free_w, free_ids = fused_route(logits, 2, True, torch.float32)
    ref_w, ref_ids = ops.route(logits, 2, True, torch.float32, live)
    assert ids[[1, 3]].eq(-1).all() and w[[1, 3]].eq(0).all()
    assert torch.equal(ids[[0, 2]], free_ids[[0, 2]]) and torch.equal(w[[0, 2]], free_w[[0, 2]])
    assert torch.equal(ids, ref_ids) and torch.allclose(w, ref_w, rtol=1e-6, atol=1e-7)
