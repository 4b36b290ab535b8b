"""The fused Triton MoE (model/fused_moe.py) against ops.experts_reference, on CPU under Triton's
interpreter (TRITON_INTERPRET=1: the kernels' own code, run by numpy; test_triton_interpreted.py runs
this file in a process of its own); on the GPU,
tests/engine/test_kernels.py runs it compiled at the Qwen3-30B-A3B shape."""
from __future__ import annotations

import os

import pytest
import torch

from pdrollout.engine.model import ops
from pdrollout.engine.model.fused_moe import BLOCK_M, align, experts_fused


@pytest.fixture(autouse=True)
def interpreted():
    assert os.environ.get("TRITON_INTERPRET") == "1", \
        "run through tests/engine/test_triton_interpreted.py (TRITON_INTERPRET=1 before Triton's first import)"


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _case(t, k, total, hidden, inter, num_local, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(num_local, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype)
    down = (torch.randn(num_local, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    w, ids = ops.route(torch.randn(t, total, generator=g), k, True, dtype)
    return x, ids, w, gate_up, down


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("t,k,total,num_local,offset", [
    (1, 8, 128, 128, 0),      # one decode row, every expert local
    (37, 4, 16, 16, 0),       # several rows per expert, partial last block
    (64, 8, 64, 16, 32),      # EP: a quarter of the experts here, the rest routed elsewhere (zero rows)
])
def test_fused_experts_match_the_reference(dtype, tol, t, k, total, num_local, offset):
    x, ids, w, gu, dn = _case(t, k, total, 96, 80, num_local, dtype, seed=t)   # H, I not multiples of the tiles
    out = experts_fused(x, ids, w, gu, dn, offset, block_n=32, block_k=32)
    ref = ops.experts_reference(x.double(), ids, w.double(), gu.double(), dn.double(), offset)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert rel(out, ref) < tol


def test_rows_with_no_local_expert_are_zero_and_empty_slots_are_skipped():
    x, ids, w, gu, dn = _case(6, 2, 8, 96, 80, 4, torch.float32, seed=9)
    foreign = experts_fused(x, torch.full_like(ids, 7), w, gu, dn, expert_offset=0)   # expert 7: not here
    assert torch.equal(foreign, torch.zeros_like(x))
    # what an expert all-to-all delivers: one local id per row, -1 for an empty slot
    one = torch.tensor([[2], [-1], [0], [2], [-1], [3]])
    ones = torch.ones(6, 1)
    out = experts_fused(x, one, ones, gu, dn)
    ref = ops.experts_reference(x.double(), one, ones.double(), gu.double(), dn.double())
    assert rel(out, ref) < 1e-6 and torch.equal(out[1], torch.zeros(96))


def test_align_places_each_owned_pair_once_in_its_experts_blocks():
    ids = torch.tensor([[3, 0], [3, 9], [1, 3], [0, 3]])          # expert 9 is another rank's
    sorted_ids, block_expert, blocks = align(ids, num_local=4, expert_offset=0)
    n = ids.numel()
    got = sorted_ids.view(blocks, BLOCK_M)
    flat = ids.flatten()
    seen = []
    for b in range(blocks):
        e = int(block_expert[b])
        pairs = [int(p) for p in got[b] if p < n]
        if e == 4:                                                  # past the end: nothing in it
            assert not pairs
            continue
        assert pairs and all(int(flat[p]) == e for p in pairs), (b, e, pairs)
        seen += pairs
    assert sorted(seen) == [p for p in range(n) if int(flat[p]) < 4]   # each owned pair exactly once
    assert sorted_ids.numel() == blocks * BLOCK_M and blocks >= 3      # experts 0, 1, 3: a block each


def test_align_counts_and_sorts_to_the_same_layout(monkeypatch):
    """Decode sizes count per expert instead of sorting; both ways give one layout."""
    import pdrollout.engine.model.fused_moe as fm
    ids = torch.randint(0, 40, (300, 8), generator=torch.Generator().manual_seed(1))
    counted = align(ids, num_local=32, expert_offset=4)
    monkeypatch.setattr(fm, "SORT_FREE_MAX", 0)
    sorted_ = align(ids, num_local=32, expert_offset=4)
    assert all(torch.equal(a, b) for a, b in zip(counted[:2], sorted_[:2])) and counted[2] == sorted_[2]
