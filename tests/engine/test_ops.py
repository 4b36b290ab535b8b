"""CPU checks of the graph-safe expert path against the reference (the CUDA-only kernels are in
test_kernels.py)."""
import torch

from pdrollout.engine.model import ops
from pdrollout.engine.model.kernels import experts_gathered


def test_gathered_experts_equal_reference_on_cpu():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 32, generator=g, dtype=torch.float64)
    gu = torch.randn(6, 48, 32, generator=g, dtype=torch.float64) * 0.2
    dn = torch.randn(6, 32, 24, generator=g, dtype=torch.float64) * 0.2
    for offset in (0, 6):                 # a whole-model shard, and the second of two EP shards
        w, ids = ops.route(torch.randn(40, 12, generator=g, dtype=torch.float64), 3, True, torch.float64)
        got = experts_gathered(x, ids, w, gu, dn, offset)
        ref = ops.experts_reference(x, ids, w, gu, dn, offset)
        assert torch.allclose(got, ref, atol=1e-12)
        assert got.abs().sum() > 0
