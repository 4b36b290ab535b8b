"""Issue 22: where the engine's rendezvous tail comes from, read off step logs of one host.

    python e2e/rdv_steplog_tail.py DIR [DIR ...] [--out FILE.json]

DIR holds rank<N>.jsonl written by `--step-log` (round_t per round: t_start, p_wait, pre, enq,
post; t_start is time.monotonic(), one clock for every rank of one host). Per run it reports:
  split     every call's latency = waiting for the last rank to arrive + after that (the
            transport's share); for the calls over the p99, how much of their time was waiting
  skew      what makes a rank arrive late at pre-D: the difference of the ranks' round calls
            (the foreground) vs of their P waits (P reaching its layer boundary), top 10 %
  idle      the share after the last arrival by how long the ranks were out of the rendezvous
            before the call (back-to-back post-D vs after P's layer or D's forward)
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rendezvous import commit, machine  # noqa: E402
from rdvrounds import logged_calls, round_times  # noqa: E402
from rdvsim import quantiles  # noqa: E402

IDLE_EDGES_S = [0.0, 50e-6, 1e-3, 5e-3, float("inf")]


def analyse(path: str) -> dict:
    paths = sorted(glob.glob(os.path.join(path, "rank*.jsonl")))
    res, kind = logged_calls(paths)
    t, _ = round_times(paths)
    lat, after = res.latency[2:], res.transport()[2:]       # round 0 left out, as in rdv_sim
    big = lat >= np.percentile(lat, 99)
    # pre-D arrival skew between the first and the last rank, and its two parts
    ent = t[:, 1:, 0] + t[:, 1:, 1]
    last, first = ent.argmax(axis=0), ent.argmin(axis=0)
    cols = np.arange(ent.shape[1])
    skew = ent[last, cols] - ent[first, cols]
    called = t[last, cols + 1, 0] - t[first, cols + 1, 0]
    top = skew >= np.percentile(skew, 90)
    idle = (res.entry[2:] - res.exit[1:-1]).min(axis=1)     # every rank out of the previous call this long
    call_after = after.max(axis=1)
    by_idle = []
    for a, b in zip(IDLE_EDGES_S[:-1], IDLE_EDGES_S[1:]):
        m = (idle >= a) & (idle < b)
        if m.sum() >= 5:
            by_idle.append({"idle_from_s": a, "idle_to_s": b, "calls": int(m.sum()), **quantiles(call_after[m])})
    return {"steplog": path, "impl": kind, "ranks": int(t.shape[0]), "rounds": int(t.shape[1]),
            "latency": quantiles(lat), "after_last_arrival": quantiles(after),
            "over_p99": {"calls": int(big.sum()), "waiting_share": float(1 - after[big].sum() / lat[big].sum())},
            "pre_d_skew": {**quantiles(skew), "top10_called_diff_mean_s": float(called[top].mean()),
                           "top10_skew_mean_s": float(skew[top].mean())},
            "after_last_by_idle": by_idle}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--out")
    args = ap.parse_args()
    runs = [analyse(d) for d in args.dirs]
    ms = lambda q: f"{q['p50_s'] * 1e3:.3f} / {q['p99_s'] * 1e3:.3f}"
    for r in runs:
        s = r["pre_d_skew"]
        print(f"{r['steplog']} ({r['impl']}, {r['ranks']} ranks, {r['rounds']} rounds; p50 / p99 ms)")
        print(f"  latency {ms(r['latency'])}, after the last arrival {ms(r['after_last_arrival'])}; calls over "
              f"the p99: {r['over_p99']['waiting_share']:.0%} of their time waiting for the last rank")
        print(f"  pre-D skew {ms(s)}; top 10 %: skew {s['top10_skew_mean_s'] * 1e3:.3f} ms mean, of which the "
              f"round calls {s['top10_called_diff_mean_s'] * 1e3:.3f} ms (the rest: P reaching its boundary)")
        for b in r["after_last_by_idle"]:
            print(f"  idle {b['idle_from_s'] * 1e3:g}-{b['idle_to_s'] * 1e3:g} ms before the call: {b['calls']} calls, "
                  f"after the last arrival {ms(b)}")
    if args.out:
        # meta before opening the file: truncating a tracked output would mark the tree dirty
        meta = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "machine": machine(),
                "commit": commit()}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
