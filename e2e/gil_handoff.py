"""What a busy P thread costs D's thread on the host: the GIL handoff, by switch interval.

pd on one rank runs a P epoch on a thread of its own (runtime/solo_p.py) whose time goes to issuing
an eager forward in Python (~85 % of its wall time on the CPU: docs/perf/HISTORY.md, sixteenth
session). D's step loop gives the GIL up whenever it blocks (a stream synchronize, a host copy) and
needs it back at once; CPython hands it back only when the holder reaches its switch interval (5 ms
by default), so each block can cost D up to one interval. This measures that, with no GPU: a thread
spinning in Python (P) and a loop that blocks for `--block-ms` and times how late it resumes (D),
for each interval, plus how much Python the busy thread still ran (P's share of the host).

    python3 e2e/gil_handoff.py [--block-ms 2] [--rounds 200] [--intervals 5,1,0.5,0.2] [--out OUT.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time


def measure(interval_ms: float, block_ms: float, rounds: int) -> dict:
    sys.setswitchinterval(interval_ms / 1e3)
    stop = threading.Event()
    spins = [0]

    def busy():   # P's issuing thread: Python bytecode, never blocking
        n = 0
        while not stop.is_set():
            for _ in range(1000):
                n += 1
            spins[0] = n

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    time.sleep(0.05)
    late = []
    t0 = time.perf_counter()
    for _ in range(rounds):
        a = time.perf_counter()
        time.sleep(block_ms / 1e3)       # releases the GIL, as a synchronize does
        late.append((time.perf_counter() - a) * 1e3 - block_ms)
    wall = time.perf_counter() - t0
    stop.set()
    t.join()
    late.sort()
    return {"interval_ms": interval_ms, "block_ms": block_ms, "rounds": rounds,
            "late_median_ms": statistics.median(late), "late_p90_ms": late[int(0.9 * (len(late) - 1))],
            "late_max_ms": late[-1], "busy_spins_per_s": spins[0] / wall}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-ms", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--intervals", default="5,1,0.5,0.2")
    ap.add_argument("--out")
    a = ap.parse_args()
    default = sys.getswitchinterval()
    rows = [measure(float(i), a.block_ms, a.rounds) for i in a.intervals.split(",")]
    sys.setswitchinterval(default)
    # a blocking call with no busy thread beside it: what the sleep itself overshoots by
    a0 = time.perf_counter()
    for _ in range(a.rounds):
        time.sleep(a.block_ms / 1e3)
    alone = ((time.perf_counter() - a0) / a.rounds * 1e3) - a.block_ms
    print(f"{'interval ms':>12}{'late median':>13}{'p90':>8}{'max':>8}{'busy Mspin/s':>14}")
    for r in rows:
        print(f"{r['interval_ms']:>12}{r['late_median_ms']:>13.3f}{r['late_p90_ms']:>8.3f}{r['late_max_ms']:>8.3f}"
              f"{r['busy_spins_per_s'] / 1e6:>14.1f}")
    print(f"no busy thread: {alone:.3f} ms late per block (the sleep's own overshoot)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": {"python": sys.version.split()[0], "command": "python3 e2e/gil_handoff.py " +
                                " ".join(sys.argv[1:])}, "alone_late_ms": alone, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
