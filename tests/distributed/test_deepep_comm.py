"""Pure parts of the DeepEP backend (no deep_ep, no GPU): shape checks against stock DeepEP's
kernel switches, the lane/QP audit, and that the module imports without deep_ep."""
import subprocess
import sys

from pdrollout.engine.runtime import deepep_comm
from pdrollout.engine.protocol import netenv


def test_shapes_of_the_two_gpu_check_pass():
    assert deepep_comm.check_shapes(16, 2, 7168, 8, 128) == []
    assert deepep_comm.check_shapes(128, 8, 2048, 8, 256) == []


def test_shapes_stock_deepep_would_assert_on():
    probs = deepep_comm.check_shapes(16, 3, 1000, 12, 3)
    text = " ".join(probs)
    assert "ranks" in text and "divide" in text and "hidden" in text and "top-k" in text and "multiple of 4" in text
    assert deepep_comm.check_shapes(16, 2, 7168, 8, 1) == ["EP x LL max tokens per rank (2 x 1) must be a positive multiple of 4"]


def test_lane_audit():
    qps = netenv.qp_split(8)
    ok = deepep_comm.lane_problems({"p_lane": 1, "d_lane": 2, "p_comm0": 3, "d_comm": 4}, qps.total, qps)
    assert ok == []
    bad = deepep_comm.lane_problems({"p_lane": 1, "d_lane": 1, "p_comm0": 3, "d_comm": 3}, 8, qps)
    assert len(bad) == 3 and "p_lane and d_lane" in bad[0] and "p_comm0 and d_comm" in bad[1] and "2s = 16" in bad[2]
    assert "unset" in deepep_comm.lane_problems({}, None, qps)[0]


def test_module_imports_without_deep_ep():
    code = ("import sys; import pdrollout.engine.runtime.deepep_comm as m; "
            "sys.exit(int('deep_ep' in sys.modules or 'torch' in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
