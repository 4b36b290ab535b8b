"""The rendezvous simulator against closed forms of its own protocol model, and its inputs."""
import json
import math

import numpy as np
import pytest

import os
import sys

# the simulator and its drivers are tools beside their scripts in e2e/, not part of the package
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "e2e"))
from rdvrounds import StepTimes, logged_calls, turnstile  # noqa: E402
from rdvsim import Calibration, Net, fit_wake_p, simulate  # noqa: E402

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


def test_a_spinning_waiter_skips_its_own_wake_up_and_a_polled_one_every_wake_up():
    """Every wake-up late by 2 ms (p = 1): at 2 ranks a call's one round wakes three threads on its path
    (the sender's loop thread for the receiver's ready notice, the receiver's loop thread for the data,
    then its waiter). A waiter that spins past the arrival skips the last (2 ms less); a polled
    transport, read by the spinning threads themselves, skips all three; a window too short for the data
    to arrive in skips none."""
    base = Calibration(hop_s=[50e-6], post_s=5e-6, rx_s=0.0, wake_p=1.0, wake_s=[2e-3])
    p50 = lambda **kw: float(np.percentile(simulate("dissemination", 2, Calibration(**{**base.__dict__, **kw}),
                                                    calls=20, seed=1).latency[2:], 50))
    none = p50()
    waiter = p50(spin="all", spin_s=5e-3)
    polled = p50(spin="all", spin_s=5e-3, polled=True)
    assert none > 6e-3 and waiter == pytest.approx(none - 2e-3, abs=1e-4) and polled < 0.2e-3
    assert p50(spin="all", spin_s=10e-6, polled=True) == pytest.approx(none, abs=1e-4)
    assert p50(spin="last", spin_s=5e-3) == pytest.approx(waiter, abs=1e-4)   # one round: the last is the only


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


def _skewed_log(d, rounds=50, late=1e-3, tr=20e-6, enq=5e-4, p=1e-3):
    """Two ranks on one clock: rank 1 reaches pre-D `late` after rank 0, both leave `tr` after
    it arrived; post-D after the same D enqueue, `tr` each."""
    d.mkdir()
    t, rows = 0.0, [[], []]
    for j in range(rounds):
        for r in (0, 1):
            p_wait = p + (late if r else 0.0)
            pre = tr + (late if r == 0 else 0.0)
            rows[r].append({"step": j, "rendezvous": "dissemination", "round_t": [[t, p_wait, pre, enq, tr]]})
        t += p + late + tr + enq + tr
    for r in (0, 1):
        (d / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows[r]))
    return d


def test_logged_calls_split_the_wait_for_the_peer_from_the_transport(tmp_path):
    res, kind = logged_calls(sorted(str(p) for p in _skewed_log(tmp_path / "a").glob("rank*.jsonl")))
    assert kind == "dissemination" and res.entry.shape == (100, 2)
    assert np.allclose(res.latency[0::2, 0], 1e-3 + 20e-6) and np.allclose(res.latency[0::2, 1], 20e-6)
    assert np.allclose(res.transport(), 20e-6)      # after the last arrival: the transport only
    assert np.allclose(res.entry[1::2] - res.exit[0::2], 5e-4)


def test_replay_of_a_gpu_host_log_uses_the_given_calibration_without_a_core_pool(tmp_path):
    # a log the model can reproduce: dissemination at 2 ranks = 2 crossings after the last arrival
    from rdv_sim import replay
    d = _skewed_log(tmp_path / "g", tr=2 * L)
    out = replay(str(d), _const(), None, "gpu")
    assert out["host"] == "gpu" and out["ranks"] == 2 and out["rounds"] == 50
    assert out["measured"]["p99_s"] == pytest.approx(1e-3 + 2 * L)
    assert out["simulated"]["p99_s"] == pytest.approx(out["measured"]["p99_s"], rel=0.02)
    assert out["simulated"]["mean_s"] == pytest.approx(out["measured"]["mean_s"], rel=0.05)
    assert L - 1e-12 <= out["simulated_after_last"]["p50_s"] <= 2 * L + 1e-12
    # the same log on a one-core pool with slow posts is much slower: the pool is not applied silently
    slow = replay(str(d), Calibration(hop_s=[L], post_s=300e-6, rx_s=300e-6), 1, "here")
    assert slow["simulated"]["mean_s"] > 1.3 * out["simulated"]["mean_s"]


def test_fit_wake_p_recovers_the_probability_behind_a_tail():
    rng = np.random.default_rng(0)
    cal = Calibration(hop_s=[L], post_s=0.0, rx_s=0.0, wake_s=rng.uniform(50e-6, 600e-6, 200).tolist())
    truth = Calibration(**{**cal.__dict__, "wake_p": 5e-3})
    target = float(np.median([np.percentile(simulate("dissemination", 2, truth, 3000, seed=s).latency[4:], 99)
                              for s in (7, 8, 9)]))
    assert target > 3 * np.percentile(simulate("dissemination", 2, cal, 300).latency, 50)
    p = fit_wake_p("dissemination", cal, target)
    assert 2.5e-3 < p < 1e-2
    # out of range: the bounds, not a guess
    assert fit_wake_p("dissemination", cal, 1e-9) == 1e-5 and fit_wake_p("dissemination", cal, 1.0) == 0.1
    with pytest.raises(ValueError, match="wake_s"):
        fit_wake_p("dissemination", _const(), target)


def test_engine_fitted_adds_the_logged_excess_after_the_last_arrival(tmp_path):
    # the log's transport is 2 crossings + 100 us that the model lacks; the fitted constant
    # puts the replay's after-last-arrival p50 onto the logged one
    from rdv_sim import engine_fitted, replay
    d = _skewed_log(tmp_path / "e", tr=2 * L + 100e-6)
    eng = {"dissemination": replay(str(d), _const(), None, "gpu")}
    c, info = engine_fitted(_const(), eng)
    assert 80e-6 < info["engine_extra_s"]["dissemination"] < 110e-6 and "gather" not in c.fixed_s
    again = info["check_2_ranks"]["dissemination"]
    assert again["simulated_after_last"]["p50_s"] == pytest.approx(again["measured_after_last"]["p50_s"], rel=0.1)
    assert again["d_wait_added"]["replayed"]["p50_s"] == pytest.approx(
        again["d_wait_added"]["measured"]["p50_s"], rel=0.1)


def test_steplog_tail_blames_the_late_rank_s_p_wait(tmp_path):
    from rdv_steplog_tail import analyse
    r = analyse(str(_skewed_log(tmp_path / "t", late=2e-3, p=2e-3)))
    assert r["ranks"] == 2 and r["impl"] == "dissemination"
    # the slowest calls are rank 0 waiting 2 ms for rank 1, whose P (not its round call) was late
    assert r["over_p99"]["waiting_share"] == pytest.approx(2e-3 / (2e-3 + 20e-6))
    assert r["pre_d_skew"]["p50_s"] == pytest.approx(2e-3) and r["pre_d_skew"]["top10_called_diff_mean_s"] == 0.0
    assert r["after_last_arrival"]["p99_s"] == pytest.approx(20e-6)
    # post-D follows the 0.5 ms D enqueue, pre-D 2 ms of P: two bins of 49 calls
    assert [(b["idle_from_s"], b["calls"]) for b in r["after_last_by_idle"]] == [(50e-6, 49), (1e-3, 49)]
