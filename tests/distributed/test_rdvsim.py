"""The rendezvous simulator against closed forms of its own protocol model, and its inputs."""
import json
import math

import numpy as np
import pytest

from pdrollout.engine.workload.rdvsim import Calibration, Net, StepTimes, simulate, turnstile

L = 10e-6


def _const(**kw) -> Calibration:
    return Calibration(hop_s=[L], post_s=0.0, rx_s=0.0, **kw)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16, 64, 256])
def test_dissemination_costs_one_crossing_per_round_plus_the_first_notice(n):
    # round 0's data waits for the receiver-ready notice (two crossings); every later round's
    # receive was posted during round 0, so its notice is there first (one crossing)
    r = simulate("dissemination", n, _const(), calls=1)
    k = math.ceil(math.log2(n))
    assert np.allclose(r.latency, (k + 1) * L)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_gather_ring_costs_two_crossings_per_step(n):
    # gloo's ring: each half-row send is posted with its receive, so each waits for the notice
    r = simulate("gather", n, _const(), calls=1)
    assert np.allclose(r.latency, 2 * (n - 1) * L)


def test_local_cost_and_constant_add_per_call():
    cal = _const(local_s={"dissemination": (4e-6, 1e-6)}, fixed_s={"dissemination": 7e-6})
    r = simulate("dissemination", 8, cal, calls=1)
    assert np.allclose(r.latency, 4 * L + 4e-6 + 8e-6 + 7e-6)


def test_the_barrier_waits_for_the_last_arrival():
    late = 1e-3
    gaps = lambda c, rng: np.array([late if r == 5 else 0.0 for r in range(8)])
    r = simulate("dissemination", 8, _const(), calls=1, gaps=gaps)
    assert np.all(r.exit >= late) and r.latency[0, 5] < r.latency[0, 0]
    # after the last arrival its flags need log2(8) crossings to reach everyone, and no more
    # than a synchronized start would take
    assert 3 * L - 1e-12 <= r.transport().max() <= 4 * L + 1e-12


def test_inter_node_messages_pay_more():
    near = simulate("dissemination", 16, _const(), calls=1, net=Net(16, 50e-6)).latency.max()
    far = simulate("dissemination", 16, _const(), calls=1, net=Net(8, 50e-6)).latency.max()
    assert near == pytest.approx(5 * L) and far > near + 50e-6


def test_a_shared_core_pool_serializes_the_cpu_work():
    cal = Calibration(hop_s=[L], post_s=20e-6, rx_s=20e-6)
    free = simulate("gather", 8, cal, calls=3).latency[1:].mean()
    one = simulate("gather", 8, cal, calls=3, cores=1).latency[1:].mean()
    assert one > 3 * free


def test_late_wakeups_from_a_ping_pong_and_their_effect():
    rng = np.random.default_rng(0)
    rtt = np.full(10000, 100e-6)
    hit = rng.random(10000) < 0.04
    rtt[hit] += 2e-3
    cal = Calibration.from_pingpong(rtt, post_s=10e-6, rx_s=5e-6, local_s={})
    assert np.allclose(cal.hop_s, 45e-6) and cal.wake_s and np.allclose(cal.wake_s, 2e-3)
    assert 1 - (1 - cal.wake_p) ** 4 == pytest.approx(hit.mean())
    quiet = simulate("dissemination", 2, Calibration(**{**cal.__dict__, "wake_p": 0.0}), calls=3000, seed=1)
    noisy = simulate("dissemination", 2, cal, calls=3000, seed=1)
    assert np.percentile(quiet.latency, 99.9) < 0.2e-3
    # two wake-ups on each rank's path per call: about 2 % of the calls are 2 ms late
    late = (noisy.latency > 1e-3).mean()
    assert 0.01 < late < 0.06 and np.percentile(noisy.latency, 50) < 0.2e-3


def _log(d, ranks, rounds, skew):
    d.mkdir()
    rng = np.random.default_rng(3)
    for r in range(ranks):
        t, lines = 0.0, []
        for j in range(rounds):
            gap = 0.01 + (skew * rng.standard_normal() if r else 0.0)
            lines.append({"step": j, "round_t": [[t, gap, 1e-4, 2e-3, 1e-4]]})
            t += gap + 1e-4 + 2e-3 + 1e-4
        (d / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return sorted(str(p) for p in d.glob("rank*.jsonl"))


def test_step_times_from_step_logs_and_the_skew_they_add(tmp_path):
    flat = StepTimes.from_step_logs(_log(tmp_path / "a", 2, 200, 0.0))
    assert flat.ranks == 2 and flat.rounds == 199
    assert np.allclose(flat.gap_dev_s, 0.0) and np.allclose(flat.enq_s, 2e-3)
    skewed = StepTimes.from_step_logs(_log(tmp_path / "b", 2, 200, 1e-3))
    assert 0.3e-3 < np.std(skewed.gap_dev_s) < 3e-3
    cal = _const()
    a = turnstile("dissemination", 16, cal, flat, rounds=30)
    b = turnstile("dissemination", 16, cal, skewed, rounds=30)
    # skew hides some of the transport behind the wait for the last rank, and adds D wait
    assert 0 < b["transport"]["p50_s"] <= a["transport"]["p50_s"] <= 5 * L + 1e-12
    assert b["d_wait_added"]["p50_s"] > 2 * a["d_wait_added"]["p50_s"]
    with pytest.raises(ValueError, match="2 ranks"):
        StepTimes.from_step_logs(_log(tmp_path / "c", 1, 5, 0.0))
