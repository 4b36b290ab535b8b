"""The ordering ladder's makespan on the tiny trace, on a multi-rank `pdrollout serve` (not a test).

One fresh `pdrollout serve --mode pd --nproc N --adp D --ep E --slots S` per rung, its control set at
start, the closed-loop bench client (engine/workload/bench.py) replays the trace, and the turnstile
counters are scraped from /metrics. Usage:
  python e2e/bench_mp_ladder.py --model DIR [--pressure P1] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
import urllib.request

from pdrollout.engine.workload.bench import replay
from pdrollout.engine.workload.servers import serve
from pdrollout.engine.workload.trace import generate

RUNGS = [("normal", {"ordering": "normal"}),
         ("global-complete", {"ordering": "global-complete"}),
         ("global-enqueue", {"ordering": "global-enqueue"}),
         ("fine-grained K=1", {"ordering": "fine-grained", "span": 1}),
         ("fine-grained auto", {"ordering": "fine-grained", "span": "auto"})]


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--pressure", default="P1", help="trace wait multiplier (P1: no waits)")
    ap.add_argument("--nproc", default="4")
    ap.add_argument("--adp", default="2")
    ap.add_argument("--ep", default="4")
    ap.add_argument("--slots", default="1")
    ap.add_argument("--activation", default="auto")
    ap.add_argument("--out", default="/tmp/pdrollout-ladder")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = generate(a.preset, 0)
    results = []
    for name, control in RUNGS:
        control = {"activation": a.activation, **control}
        extra = ("--nproc", a.nproc, "--adp", a.adp, "--ep", a.ep, "--slots", a.slots,
                 "--engine-config", json.dumps({"control": control}), "--log-level", "warning")
        t0 = time.monotonic()
        with serve(a.model, "pd", os.path.join(a.out, f"server-{name.replace(' ', '_')}.log"),
                   extra_args=extra) as live:
            summary, _ = replay(live.url, rows, pressure=a.pressure, seed=0, progress=False, watch=live.died)
            m = urllib.request.urlopen(live.url + "/metrics", timeout=30).read().decode()
        r = {"rung": name, "control": control, "makespan_s": summary["makespan_s"],
             "output_tokens": summary["total_output_tokens"],
             "rounds": _metric(m, "pdrollout:turnstile_rounds_total"),
             "rendezvous": _metric(m, "pdrollout:turnstile_rendezvous_seconds_count"),
             "rendezvous_s": _metric(m, "pdrollout:turnstile_rendezvous_seconds_sum"),
             "stalls": _metric(m, "pdrollout:stalls_total"), "wall_s": time.monotonic() - t0}
        results.append(r)
        print(json.dumps(r), flush=True)
    with open(os.path.join(a.out, "ladder.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("| rung | makespan s | turnstile rounds | rendezvous | mean rendezvous ms | stalls |")
    print("|---|---|---|---|---|---|")
    for r in results:
        mean = 1e3 * r["rendezvous_s"] / r["rendezvous"] if r["rendezvous"] else 0.0
        print(f"| {r['rung']} | {r['makespan_s']:.2f} | {r['rounds']:.0f} | {r['rendezvous']:.0f} | "
              f"{mean:.2f} | {r['stalls']:.0f} |")


if __name__ == "__main__":
    main()
