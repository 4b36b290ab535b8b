"""e2e/plan_sim.py: the engine's Scheduler and policies on a virtual clock, step times from a fitted
cost model (docs/PERF.md, "The planner on a virtual clock")."""
import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("plan_sim", Path(__file__).parents[2] / "e2e" / "plan_sim.py")
plan_sim = sys.modules["plan_sim"] = importlib.util.module_from_spec(_spec)   # dataclasses look it up
_spec.loader.exec_module(plan_sim)


def test_fit_recovers_the_step_costs():
    steps = [{"decode_rows": r, "prefill_tokens": 0, "wall_s": 0.004 + 0.0003 * r} for r in (1, 8, 32, 64)]
    steps += [{"decode_rows": r, "prefill_tokens": p, "wall_s": 0.017 + 0.0001 * r + 2e-4 * p}
              for r, p in ((0, 100), (4, 2000), (16, 512), (1, 8192))]
    c = plan_sim.fit(steps)
    assert c.graph == pytest.approx((0.004, 0.0003), abs=1e-9)
    assert c.eager == pytest.approx((0.017, 0.0001, 2e-4), abs=1e-9)


@pytest.mark.parametrize("mode", ["normal", "mixed", "pd"])
def test_a_two_turn_trajectory_on_the_virtual_clock(mode):
    """P step 20 ms (first token), two D steps 10 ms, the client's 1 s wait, then the same again."""
    cost = plan_sim.Cost(graph=(0.010, 0.0), eager=(0.020, 0.0, 0.0))
    rows = [{"session_id": "a", "turn": 0, "input_length": 5, "output_length": 3},
            {"session_id": "a", "turn": 1, "input_length": 4, "output_length": 3, "delay_ms": 1000}]
    r = plan_sim.simulate(rows, mode, cost, seed=0, pressure="trace")
    assert r["makespan_s"] == pytest.approx(1.08) and r["steps"] == 6
    assert r["p99_ttft_ms"] == pytest.approx(20.0)


def test_priority_reaches_admission_under_contention():
    """Two first turns, one running row at a time: FCFS runs the short trajectory first; the
    critical-path hint runs the long one first, and the short one's first token waits for it."""
    cost = plan_sim.Cost(graph=(0.010, 0.0), eager=(0.020, 0.0, 0.0))
    rows = [{"session_id": "short", "turn": 0, "input_length": 8, "output_length": 2},
            {"session_id": "long", "turn": 0, "input_length": 8, "output_length": 20}]
    fcfs = plan_sim.simulate(rows, "pd", cost, seed=0, max_running=1)
    hint = plan_sim.simulate(rows, "pd", cost, seed=0, max_running=1, priority="critical-path")
    assert fcfs["p99_ttft_ms"] == pytest.approx(20 + 10 + 20, abs=0.6)     # long's: after short's P and D
    assert hint["p99_ttft_ms"] == pytest.approx(20 + 190 + 20, abs=2.1)    # short's: after all of long
    assert fcfs["makespan_s"] == pytest.approx(hint["makespan_s"]) == pytest.approx(0.24)   # the same work


def test_overlap_lets_d_go_on_while_a_p_epoch_is_in_flight():
    """a decodes 6 tokens; b's second turn arrives as a starts decoding. Fused, D waits out the P step
    (50 ms) once; with the P epoch in flight, a's D steps (10 ms) go on beside it."""
    cost = plan_sim.Cost(graph=(0.010, 0.0), eager=(0.050, 0.0, 0.0))
    rows = [{"session_id": "a", "turn": 0, "input_length": 4, "output_length": 6},
            {"session_id": "b", "turn": 0, "input_length": 4, "output_length": 1},
            {"session_id": "b", "turn": 1, "input_length": 4, "output_length": 1}]
    fused = plan_sim.simulate(rows, "pd", cost, seed=0)
    overlap = plan_sim.simulate(rows, "pd", cost, seed=0, overlap=True)
    assert fused["makespan_s"] == pytest.approx(0.05 + 0.05 + 4 * 0.01)
    assert overlap["makespan_s"] == pytest.approx(0.05 + 5 * 0.01)
