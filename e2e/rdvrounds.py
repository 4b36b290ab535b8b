"""Turnstile rounds from engine step logs (`--step-log`), for the rendezvous simulator (rdvsim.py).

`round_times()` reads the ranks' logged rounds; `logged_calls()` turns one logged run into a
`Result` (a logged call splits like a simulated one); `StepTimes` holds per-rank gaps before the
pre-D rendezvous and D enqueue times between the two; `turnstile()` simulates rounds with them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from rdvsim import Calibration, Net, Result, quantiles, simulate


def round_times(paths: list[str]) -> tuple[np.ndarray, str]:
    """The ranks' logged `round_t` rows, cut to the shortest rank: [rank, round, 5] (t_start,
    p_wait, pre, enq, post), and the logged transport."""
    per_rank, kind = [], "gather"
    for p in sorted(paths):
        rows = [json.loads(x) for x in open(p) if x.strip()]
        if rows:
            kind = rows[0].get("rendezvous", kind)
        per_rank.append([t for e in rows for t in e.get("round_t", [])])
    k = min((len(r) for r in per_rank), default=0)
    return np.array([r[:k] for r in per_rank]).reshape(len(per_rank), k, 5), kind


def logged_calls(paths: list[str]) -> tuple[Result, str]:
    """The rendezvous calls of one logged run as a Result (call 2j = round j's pre-D, 2j+1 its
    post-D), so that the logged latency splits like a simulated one: `transport()` = after the
    last rank arrived, the rest = waiting for it. Needs one host: every rank's t_start is
    time.monotonic() of the same clock. Post-D entry = pre-D exit + D enqueue (the lock between
    them, microseconds, is left out)."""
    t, kind = round_times(paths)
    n, k = t.shape[:2]
    entry = np.zeros((2 * k, n))
    exit_ = np.zeros((2 * k, n))
    entry[0::2] = (t[:, :, 0] + t[:, :, 1]).T
    exit_[0::2] = entry[0::2] + t[:, :, 2].T
    entry[1::2] = exit_[0::2] + t[:, :, 3].T
    exit_[1::2] = entry[1::2] + t[:, :, 4].T
    return Result(entry, exit_), kind


@dataclass
class StepTimes:
    """Per logged round: the common gap before pre-D and common D enqueue time (median over
    ranks), and the pooled per-rank deviations from them (scaled so that a deviation drawn i.i.d.
    per rank has the logged spread: x sqrt(n0 / (n0 - 1)) for deviations from an n0-rank mean)."""
    gap_s: np.ndarray
    enq_s: np.ndarray
    gap_dev_s: np.ndarray
    enq_dev_s: np.ndarray
    ranks: int
    rounds: int
    source: str = ""

    @classmethod
    def from_step_logs(cls, paths: list[str], source: str = "") -> "StepTimes":
        t, _ = round_times(paths)                               # [rank, round, 5]
        n0, k = t.shape[:2]
        if n0 < 2 or k < 2:
            raise ValueError(f"step logs need >= 2 ranks with >= 2 timed rounds, got {n0} ranks, {k} rounds")
        enter = t[:, :, 0] + t[:, :, 1]                         # pre-D entered (same clock on one host)
        leave = enter + t[:, :, 2] + t[:, :, 3] + t[:, :, 4]
        gap = enter[:, 1:] - leave[:, :-1]                      # previous round left -> this one entered
        enq = t[:, 1:, 3]
        scale = math.sqrt(n0 / (n0 - 1))
        dev = lambda x: ((x - x.mean(axis=0)) * scale).ravel()
        return cls(np.median(gap, axis=0), np.median(enq, axis=0), dev(gap), dev(enq), n0, k - 1, source)

    def draw(self, rng: np.random.Generator, n: int, rounds: int) -> tuple[np.ndarray, np.ndarray]:
        j = rng.integers(0, len(self.gap_s), size=rounds)
        gap = self.gap_s[j][:, None] + rng.choice(self.gap_dev_s, size=(rounds, n))
        enq = self.enq_s[j][:, None] + rng.choice(self.enq_dev_s, size=(rounds, n))
        return np.maximum(gap, 0.0), np.maximum(enq, 0.0)


def turnstile(kind: str, n: int, cal: Calibration, steps: StepTimes, rounds: int, net: Net | None = None,
              cores: float | None = None, seed: int = 0) -> dict:
    """Rounds of pre-D, D enqueue, post-D with step-log gaps and enqueue times. Returns the
    rendezvous latency (both kinds, every rank), the transport share, and the D wait the two
    rendezvous add per round (pre + post on a rank, averaged over ranks, per round)."""
    rng = np.random.default_rng(seed + 1)
    gap, enq = steps.draw(rng, n, rounds)

    def gaps(c, _rng):     # call 2j = pre-D of round j (after the gap), 2j+1 = post-D (after D)
        return gap[c // 2] if c % 2 == 0 else enq[c // 2]

    res = simulate(kind, n, cal, 2 * rounds, net, cores, seed, gaps)
    lat = res.latency
    per_round = (lat[0::2] + lat[1::2]).mean(axis=1)
    return {"rendezvous": quantiles(lat), "transport": quantiles(res.transport()),
            "d_wait_added": quantiles(per_round)}
