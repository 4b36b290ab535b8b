"""The planner's policies on hand-built snapshots (pure: no model, no KV pool)."""
from __future__ import annotations

import pytest

from pdrollout.engine.protocol.config import ControlSettings
from pdrollout.engine.scheduler.policy import IDLE_QUIET_MS, SEGMENT_UNITS, Snapshot, make_policy
from pdrollout.engine.scheduler.request import Req, SamplingParams, Status

SP = SamplingParams(max_new_tokens=8)


def req(rid, n, status=Status.WAITING, computed=0, out=0, t=0.0):
    r = Req(rid, list(range(2, 2 + n)), SP, arrival=t)
    r.status, r.computed, r.output = status, computed, [7] * out
    return r


def snap(waiting=(), prefilling=(), decoding=(), free=1000, max_running=8):
    return Snapshot(list(waiting), list(prefilling), list(decoding), free, 4, max_running, 20)


def control(**kw):
    return ControlSettings(prefill_budget_tokens=kw.pop("budget", 64), **kw)


def decoding(k, ctx=9):
    return [req(f"d{i}", ctx, Status.DECODE, computed=ctx, out=1, t=i) for i in range(k)]


def test_normal_runs_every_prefill_before_any_decode():
    plan = make_policy("normal").plan(0, snap([req("w", 30)], decoding=decoding(3)), control())
    assert plan.decode == () and [s.rid for s in plan.prefill] == ["w"]
    plan = make_policy("normal").plan(1, snap(decoding=decoding(3)), control())
    assert len(plan.decode) == 3 and plan.prefill == ()


def test_normal_decodes_when_no_prefill_fits_in_kv():
    plan = make_policy("normal").plan(0, snap([req("w", 300)], decoding=decoding(2), free=5), control())
    assert len(plan.decode) == 2 and plan.prefill == ()


def test_mixed_rides_decode_rows_with_a_fixed_chunk():
    plan = make_policy("mixed").plan(0, snap([req("w", 100)], decoding=decoding(3)), control())
    assert len(plan.decode) == 3
    assert plan.prefill_tokens == 20 - 3 and not plan.prefill[0].completes


@pytest.mark.parametrize("span", [1, 2, 3, 4])
def test_pd_segment_is_span_units_with_decode_rows(span):
    plan = make_policy("pd").plan(0, snap([req("w", 500)], decoding=decoding(3)), control(span=span))
    assert len(plan.decode) == 3 and plan.multiplexing
    assert plan.prefill_tokens == span * 64 // SEGMENT_UNITS and plan.span == span


def test_pd_without_decode_rows_runs_the_whole_budget():
    plan = make_policy("pd").plan(0, snap([req("a", 40), req("b", 40)]), control())
    assert plan.prefill_tokens == 64 and plan.decode == ()


def test_pd_keeps_kv_headroom_for_decode_rows():
    # 12 free blocks: 3 decode rows take one each now; the 8-block prompt fits only without headroom.
    s = snap([req("w", 32)], decoding=decoding(3, ctx=8), free=12)
    assert make_policy("mixed").plan(0, s, control()).admit == ("w",)
    assert make_policy("pd").plan(0, s, control(span=4)).admit == ()


def test_pd_activation_off_is_normal():
    s = snap([req("w", 30)], decoding=decoding(2))
    assert make_policy("pd").plan(0, s, control(activation="off")).decode == ()


def test_auto_span_shrinks_with_decode_occupancy():
    s_busy = snap([req("w", 5000)], decoding=decoding(8), max_running=8)
    s_idle = snap([req("w", 5000)], decoding=decoding(1), max_running=8)
    busy = make_policy("pd").plan(0, s_busy, control(budget=1600)).span
    idle = make_policy("pd").plan(0, s_idle, control(budget=1600)).span
    assert busy == 1 and idle > busy


def test_decode_rows_retract_youngest_first_under_kv_pressure():
    rows = decoding(4, ctx=8)           # 9 tokens: position 8 starts a new block
    plan = make_policy("pd").plan(0, snap(decoding=rows, free=2), control())
    assert plan.decode == ("d0", "d1") and plan.retract == ("d3", "d2")


def test_fcfs_admission_does_not_let_later_requests_overtake():
    plan = make_policy("mixed").plan(0, snap([req("big", 400), req("small", 4)], free=50), control())
    assert plan.admit == ()


@pytest.mark.parametrize("mode", ["normal", "mixed", "pd"])
def test_admission_takes_the_higher_priority_first_then_the_queue_order(mode):
    a, b, c = req("a", 8, t=0), req("b", 8, t=1), req("c", 8, t=2)
    b.priority = 5                     # the client's critical path: a trajectory with much work left
    plan = make_policy(mode).plan(0, snap([a, b, c], free=5), control())   # two prompts fit in KV
    assert plan.admit == ("b", "a")


def test_under_kv_pressure_the_lowest_priority_rows_give_their_kv_back_first():
    rows = decoding(4, ctx=8)
    rows[3].priority = 9               # the youngest, but the critical path: it keeps its KV
    plan = make_policy("pd").plan(0, snap(decoding=rows, free=2), control())
    assert plan.decode == ("d3", "d0") and plan.retract == ("d2", "d1")


def test_pd_runs_whole_budget_segments_once_the_oldest_prefill_waited_past_its_bound():
    s = snap([req("w", 500, t=0.0)], decoding=decoding(3))
    unit = 64 // SEGMENT_UNITS
    s.now = 0.3
    assert make_policy("pd").plan(0, s, control(span=1, p_wait_bound_ms=500)).prefill_tokens == unit
    s.now = 0.6
    past = make_policy("pd").plan(0, s, control(span=1, p_wait_bound_ms=500))
    assert past.prefill_tokens == 64 and len(past.decode) == 3
    assert make_policy("pd").plan(0, s, control(span=1)).prefill_tokens == unit   # no bound: off
    # a retracted request re-prefilling has had its first token: its wait is not the TTFT tail
    again = req("r", 500, t=0.0)
    again.first_token_at = 0.1
    s = snap([again], decoding=decoding(3))
    s.now = 9.0
    assert make_policy("pd").plan(0, s, control(span=1, p_wait_bound_ms=500)).prefill_tokens == unit


def test_pd_runs_a_burst_of_first_turns_alone_when_it_outnumbers_the_decode_rows():
    burst = [req(f"w{i}", 20, t=0.01 * i) for i in range(3)]
    plan = make_policy("pd").plan(0, snap(burst, decoding=decoding(2)), control(span=1, p_burst_first=True))
    assert plan.decode == () and [x.rid for x in plan.prefill] == ["w0", "w1", "w2"] and not plan.multiplexing
    # as many decode rows as waiting requests: decode first, P in its segment
    plan = make_policy("pd").plan(0, snap(burst, decoding=decoding(3)), control(span=1, p_burst_first=True))
    assert len(plan.decode) == 3 and plan.prefill_tokens == 64 // SEGMENT_UNITS
    # off (the default on CPU), and never under activation "on" (multiplexing forced)
    for c in (control(span=1), control(span=1, p_burst_first=True, activation="on")):
        assert len(make_policy("pd").plan(0, snap(burst, decoding=decoding(2)), c).decode) == 2
    # nothing fits in KV: decode, so memory frees up
    plan = make_policy("pd").plan(0, snap(burst, decoding=decoding(2), free=4), control(span=1, p_burst_first=True))
    assert len(plan.decode) == 2


def test_pd_gathers_p_with_slack_but_never_the_critical_paths():
    """A step that carries P is dearer than a decode-only one: P below the top priority waits up to
    p_gather_ms for company; the top priority's P (or, with no priorities, anyone's) never waits."""
    rows = decoding(3)
    rows[0].priority = 9                                   # the critical path, decoding
    slack = req("w", 40, t=0.0)
    slack.priority = 2
    s = snap([slack], decoding=rows)
    s.now = 0.05
    held = make_policy("pd").plan(0, s, control(span=1, p_gather_ms=100))
    assert held.prefill == () and len(held.decode) == 3
    s.now = 0.2                                            # waited past p_gather_ms: it runs
    assert make_policy("pd").plan(0, s, control(span=1, p_gather_ms=100)).prefill_tokens == 64 // SEGMENT_UNITS
    s.now = 0.05
    assert make_policy("pd").plan(0, s, control(span=1)).prefill_tokens == 64 // SEGMENT_UNITS   # off
    top = req("c", 40, t=0.0)
    top.priority = 9                                       # the critical path's next turn: never held
    s = snap([slack, top], decoding=rows)
    s.now = 0.05
    assert make_policy("pd").plan(0, s, control(budget=1600, span=1, p_gather_ms=100)).admit == ("c", "w")  # w rides
    s = snap([req("n", 40, t=0.0)], decoding=decoding(3))   # no priorities given: nothing has slack
    s.now = 0.05
    assert make_policy("pd").plan(0, s, control(budget=1600, span=1, p_gather_ms=100)).admit == ("n",)


def test_an_idle_pd_engine_holds_a_burst_of_arrivals_until_it_ends():
    """p_idle_gather_ms: with nothing decoding or prefilling, arrivals wait while the last came less
    than IDLE_QUIET_MS ago, at most the gather after the first; the plan says until when."""
    def at(now, waiting, decoding=(), gather=20.0):
        s = snap(waiting, decoding=decoding)
        s.now, s.idle_gather_ms = now, gather
        return s
    ctl = control(span=1)
    first, last = req("a", 30, t=1.000), req("b", 30, t=1.0015)
    held = make_policy("pd").plan(0, at(1.002, [first, last]), ctl)   # the last came 0.5 ms ago
    assert held.empty and held.hold_until == pytest.approx(1.0015 + IDLE_QUIET_MS / 1e3)
    quiet = at(1.0015 + IDLE_QUIET_MS / 1e3 + 1e-4, [first, last])    # quiet since: one step for both
    assert make_policy("pd").plan(0, quiet, ctl).admit == ("a", "b")
    steady = [req(f"w{i}", 30, t=1.0 + i * 0.001) for i in range(30)]  # still arriving at 30 ms
    assert make_policy("pd").plan(0, at(1.0295, steady), ctl).admit    # the first waited its 20 ms
    busy = make_policy("pd").plan(0, at(1.002, [first, last], decoding(1)), ctl)   # not idle: never held
    assert busy.hold_until is None and busy.admit and busy.decode
    assert make_policy("pd").plan(0, at(1.002, [first, last], gather=None), ctl).admit == ("a", "b")   # off
    off = control(span=1, activation="off")                            # activation off: normal's step
    assert make_policy("pd").plan(0, at(1.002, [first, last]), off).admit == ("a", "b")
    for mode in ("mixed", "normal"):                                   # the baselines never hold
        plan = make_policy(mode).plan(0, at(1.002, [first, last]), ctl)
        assert plan.hold_until is None and plan.admit[0] == "a"


def test_a_requests_tokens_follow_its_output_without_being_rebuilt():
    """Req.tokens is prompt + output kept as one list (the planner reads it per row per step): it
    follows appends in place, and a replaced output rebuilds it."""
    r = req("a", 5)
    first = r.tokens
    assert first == [2, 3, 4, 5, 6]
    r.output.append(9)
    r.output.append(11)
    assert r.tokens is first and first == [2, 3, 4, 5, 6, 9, 11]
    r.output = [8]
    assert r.tokens == [2, 3, 4, 5, 6, 8]
    r.output = [9, 1, 2]
    assert r.tokens == [2, 3, 4, 5, 6, 9, 1, 2] and len(r.tokens) == 8
