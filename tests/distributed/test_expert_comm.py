"""Phase-owned expert communication: concurrent P (normal, split) and D (low-latency) paths."""
import os
import subprocess
import sys

import pytest

from pdrollout.engine.protocol import netenv
from pdrollout.engine.protocol.exits import EXIT_COMM
from ranks import assert_ok, run_ranks

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks inherit sys.path and import the target
from expert_targets import expert_rank  # noqa: E402


@pytest.mark.timeout(300)
def test_concurrent_p_and_d_match_single_rank_reference():
    outs = run_ranks(expert_rank, 4, (6,), timeout_s=240)
    assert_ok(outs)
    for o in outs:
        r = o.result
        assert not r["alive"] and r["failures"] == [], r["failures"]
        assert r["errs"]["P"] < 1e-4 and r["errs"]["D"] < 1e-4, r["errs"]
        assert r["errs"]["D_valid"] < 1e-4 and r["errs"]["D_padding"] == 0.0, r["errs"]
        assert r["errs"]["D_reads"] == (0, "tokens", (4 * 12, 16))   # ep * rows token slots, no host read
        assert r["disjoint"] == []                             # buffers, counters, QPs, lanes, groups
        assert r["qp"] == ([2, 3], [0, 1])                      # P [s,2s), D [0,s), s = 2 local experts
        retired, freed, after = r["errs"]["cancel"]
        assert retired == ["retired"] and freed == 1 and after == ["free"]
        # the errors these real ranks raised end a rank with the communication code, not "bad configuration"
        assert r["raised"] == {"PendingDispatchError": EXIT_COMM, "PermitMissingError": EXIT_COMM,
                               "ExpertCommError": EXIT_COMM}, r["raised"]


def test_qp_split_and_env():
    s = netenv.qp_split(4)
    assert list(s.decode) == [0, 1, 2, 3] and list(s.prefill) == [4, 5, 6, 7] and s.total == 8
    env = netenv.expert_comm_env(num_experts=128, ep=16, nodes=2, hcas=["mlx5_0", "mlx5_1:2"], gid_index=3)
    assert env["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "16" and env["NVSHMEM_IB_ENABLE_IBGDA"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["NVSHMEM_HCA_LIST"] == "mlx5_0:1,mlx5_1:2"
    assert env["NCCL_IB_HCA"] == env["NVSHMEM_HCA_LIST"] and env["NVSHMEM_IB_GID_INDEX"] == "3"
    assert netenv.expert_comm_env(64, 8)["NVSHMEM_IB_ENABLE_IBGDA"] == "0"   # one node: NVLink P2P
    assert all(isinstance(v, str) for v in env.values())
    with pytest.raises(ValueError):
        netenv.qp_split(0)
    with pytest.raises(ValueError):
        netenv.nvshmem_env(2, qp_depth=1000)
    with pytest.raises(ValueError):
        netenv.local_experts(10, 4)


def test_size_hints_scale_and_align():
    a = netenv.ll_rdma_bytes_hint(128, 7168, 16, 256)
    b = netenv.ll_rdma_bytes_hint(256, 7168, 16, 256)
    assert a % netenv.ALIGN == 0 and b > a and a > 2 * 256 * 128 * 7168 * 2   # at least the recv halves
    assert netenv.normal_nvl_bytes_hint(4096, 2048, 8, 8) % netenv.ALIGN == 0


def test_netenv_is_stdlib_only():
    code = ("import sys; import pdrollout.engine.protocol.netenv as n; "
            "bad=[m for m in ('torch','numpy','pydantic') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
