"""The expert exchange through fixed token slots (engine/runtime/token_slots.py), P's and D's, on real
gloo ranks: equal to one rank's experts, padding routed nowhere, two all-to-alls a pass, no host read,
and the bytes a rank sends its peers counted as the cost model counts them (e2e/rank_cost.py)."""
import os
import sys

import pytest

from ranks import assert_ok, run_ranks

sys.path.insert(0, os.path.dirname(__file__))  # spawned ranks inherit sys.path and import the target
from slot_targets import slots_rank  # noqa: E402


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,phase", [(1, "prefill"), (2, "prefill"), (4, "prefill"), (2, "decode"), (4, "decode")])
def test_token_slots_equal_one_rank_with_no_host_read(world, phase):
    outs = run_ranks(slots_rank, world, ("float32", phase), timeout_s=200)
    assert_ok(outs)
    # every peer a slot for each of the bound's 10 rows: the token, 3 ids, 3 weights; back, the sums
    sent = (world - 1) * 10 * (16 + 2 * 3) * 4 + (world - 1) * 10 * 16 * 4
    for o in outs:
        r = o.result
        assert max(r["err"]) < 1e-5, r["err"]
        assert r["zero_rows"] and max(r["zero_rows"]) == 0.0     # a padding row gets nothing back
        assert r["issued"] == [2] * 4                             # dispatch and combine, no count exchange
        assert r["sent"] == [sent] * 4, r["sent"]                 # whatever the rows and their routing
        assert r["reads"] == {"prefill": 0, "decode": 0}          # the exchange never waited for the device
        assert ("exceeds the bound or the P slots' 10 rows" if phase == "prefill" else
                "exceeds the D buffers' capacity of 10 tokens") in r["over"]


@pytest.mark.timeout(240)
def test_token_slots_in_bf16_stay_within_one_rounding():
    outs = run_ranks(slots_rank, 2, ("bfloat16",), timeout_s=200)
    assert_ok(outs)
    assert all(max(o.result["err"]) < 0.05 for o in outs), [o.result["err"] for o in outs]
