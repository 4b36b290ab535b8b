"""Benchmark (not a test): turnstile rendezvous latency on CPU gloo for 2/4/8 ranks.

    python e2e/bench_rendezvous.py [--worlds 2 4 8] [--rounds 500]

Each round is one pre-D and one post-D rendezvous (what a turnstile round costs on the host),
with no device work, so the figure is the transport alone. Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import os
import platform
import time


def _rank(ctx, rounds: int, warmup: int):
    import torch.distributed as dist
    from pdrollout.engine.runtime.rendezvous import Rendezvous
    rdv = Rendezvous(dist.new_group(list(range(ctx.world))), world=ctx.world)
    for i in range(warmup):
        rdv.pre_d(0, i, True)
        rdv.post_d(0, i, True, expect=True)
    rdv.latencies.clear()
    t0 = time.perf_counter()
    for i in range(rounds):
        a = rdv.pre_d(1, i, ctx.rank % 2 == 0)
        rdv.post_d(1, i, a.d_any, expect=a.d_any)
    wall = time.perf_counter() - t0
    return {"stats": rdv.stats(), "round_s": wall / rounds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=50)
    args = ap.parse_args()
    from ranks import run_ranks
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load avg {os.getloadavg()[0]:.1f}")
    print("| ranks | rendezvous | mean ms | p50 ms | p99 ms | round (2 rendezvous) ms |")
    print("|---|---|---|---|---|---|")
    for w in args.worlds:
        outs = run_ranks(_rank, w, (args.rounds, args.warmup), timeout_s=600)
        res = [o.result for o in outs]
        if any(not isinstance(r, dict) or "stats" not in r for r in res):
            raise SystemExit(f"world {w} failed: {[(o.exitcode, o.result) for o in outs]}")
        s = res[0]["stats"]  # rank 0's view; all ranks wait for the slowest, so views agree
        rnd = max(r["round_s"] for r in res)
        print(f"| {w} | {s['count']} | {s['mean_s'] * 1e3:.3f} | {s['p50_s'] * 1e3:.3f} | "
              f"{s['p99_s'] * 1e3:.3f} | {rnd * 1e3:.3f} |", flush=True)


if __name__ == "__main__":
    main()
