"""P's expert exchange through fixed token slots (engine/runtime/token_slots.py) on real gloo ranks:
equal to one rank's experts, padding routed nowhere, two all-to-alls a pass and no host read."""
import os
import sys

import pytest

from ranks import assert_ok, run_ranks

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks inherit sys.path and import the target
from slot_targets import slots_rank  # noqa: E402


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_token_slots_equal_one_rank_with_no_host_read(world):
    outs = run_ranks(slots_rank, world, ("float32",), timeout_s=200)
    assert_ok(outs)
    for o in outs:
        r = o.result
        assert max(r["err"]) < 1e-5, r["err"]
        assert r["zero_rows"] and max(r["zero_rows"]) == 0.0     # a padding row gets nothing back
        assert r["issued"] == [2] * 4                             # dispatch and combine, no count exchange
        assert r["reads"] == {"prefill": 0, "decode": 0}          # P never waited for the device
        assert "exceeds the bound or the P slots' 10 rows" in r["over"]


@pytest.mark.timeout(240)
def test_token_slots_in_bf16_stay_within_one_rounding():
    outs = run_ranks(slots_rank, 2, ("bfloat16",), timeout_s=200)
    assert_ok(outs)
    assert all(max(o.result["err"]) < 0.05 for o in outs), [o.result["err"] for o in outs]
