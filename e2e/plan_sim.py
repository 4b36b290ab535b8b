"""The planner on a virtual clock: the engine's own Scheduler and policies, driven by a trace's closed
loop (what `pdrollout bench` does over HTTP), with each step's time from a cost model fitted to one
GPU's step logs. For trying planner changes (admission order, segment sizing) on CPU before GPU time.

    python e2e/plan_sim.py --steplogs 'docs/perf/one-stack/small-x2/steplog-small-s*-1gpu-*' \
        --measured 'docs/perf/one-stack/small-x2/small-s*.json' --preset small --seeds 0,1,2 --out OUT.json

It first fits the cost model (a decode-only step as a graph replay: a + b*rows; a step that carries P,
run eagerly: a + b*rows + c*prefill tokens), then validates: each mode's simulated makespan and p99
TTFT beside the measured ones of the same trace. Then it runs the planner variants given (--variant
NAME:JSON, control settings and the bench's priority hint) on every seed. A model, not a measurement:
what it says about a variant holds only as far as the validation rows say it does.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdrollout.engine.protocol.config import ControlSettings, EngineConfig, ModelConfig, load_preset
from pdrollout.engine.scheduler.request import SamplingParams
from pdrollout.engine.scheduler.scheduler import Scheduler
from pdrollout.engine.workload.bench import synthetic_ids
from pdrollout.engine.workload.trace import PRESSURE, generate, sessions, work_left


@dataclass
class Cost:
    graph: tuple[float, float]            # a, b: a + b * rows
    eager: tuple[float, float, float]     # a, b, c: a + b * rows + c * prefill tokens

    def step_s(self, rows: int, prefill_tokens: int) -> float:
        if prefill_tokens == 0:
            return self.graph[0] + self.graph[1] * rows
        a, b, c = self.eager
        return a + b * rows + c * prefill_tokens


def read_steps(patterns: list[str]) -> list[dict]:
    steps = []
    for pat in patterns:
        for d in sorted(glob.glob(pat)):
            for f in sorted(Path(d).glob("rank0.jsonl*")):
                opener = gzip.open if f.suffix == ".gz" else open
                with opener(f, "rt") as fh:
                    steps += [json.loads(line) for line in fh if line.strip()]
    return steps


def fit(steps: list[dict]) -> Cost:
    """Least squares per kind; the first steps (warm-up, graph capture) are in the logs, so the median
    residual is what the fit is judged by, in `validate`."""
    g = [(s["decode_rows"], s["wall_s"]) for s in steps if s["prefill_tokens"] == 0 and s["decode_rows"]]
    e = [(s["decode_rows"], s["prefill_tokens"], s["wall_s"]) for s in steps if s["prefill_tokens"]]
    if len(g) < 2 or len(e) < 3:
        raise SystemExit(f"too few steps to fit: {len(g)} decode-only, {len(e)} with P")
    xg = np.array([[1.0, r] for r, _ in g])
    ag, bg = np.linalg.lstsq(xg, np.array([w for _, w in g]), rcond=None)[0]
    xe = np.array([[1.0, r, p] for r, p, _ in e])
    ae, be, ce = np.linalg.lstsq(xe, np.array([w for *_, w in e]), rcond=None)[0]
    return Cost((float(ag), float(max(bg, 0.0))), (float(ae), float(max(be, 0.0)), float(ce)))


class Clients:
    """The closed loop's clients on a virtual clock: a session's next turn is released once its last one
    finished plus the trace's wait (scaled by the pressure); its context grows by what the engine answered."""

    def __init__(self, rows: list[dict], pressure: str, seed: int, vocab: int, now: list[float]) -> None:
        self.trajs = list(sessions(rows).values())
        self.scale, self.seed, self.vocab, self.now = PRESSURE[pressure], seed, vocab, now
        self.ready = [(0.0, i, 0) for i in range(len(self.trajs))]   # (release time, session, turn)
        self.context: dict[int, list[int]] = {i: [] for i in range(len(self.trajs))}
        self.live: dict[str, tuple[int, int, float]] = {}          # rid -> (session, turn, release)
        self.first: dict[str, float] = {}
        self.ttft: list[float] = []
        self.end = 0.0

    def released(self):
        """(rid, prompt ids, trace row, session, turn) of each turn due by now."""
        for item in sorted(x for x in self.ready if x[0] <= self.now[0]):
            self.ready.remove(item)
            t, i, k = item
            row = self.trajs[i][k]
            ids = self.context[i] + synthetic_ids(self.seed, i, row["turn"], row["input_length"], self.vocab)
            self.context[i] = ids
            rid = f"{i}-{k}"
            self.live[rid] = (i, k, t)
            yield rid, ids, row, i, k

    def answered(self, outputs) -> None:
        for out in outputs:
            i, k, t = self.live[out.rid]
            if out.new_token_ids:
                self.context[i] = self.context[i] + out.new_token_ids
                self.first.setdefault(out.rid, self.now[0])
            if out.finished:
                del self.live[out.rid]
                self.ttft.append(1000 * (self.first[out.rid] - t))
                self.end = self.now[0]
                if k + 1 < len(self.trajs[i]):
                    wait = self.trajs[i][k + 1].get("delay_ms", 0) * self.scale / 1000.0
                    self.ready.append((self.now[0] + wait, i, k + 1))

    def idle(self, mode: str, flight_end: float | None) -> bool:
        """Nothing ran this step: jump the clock to the next release or epoch end; False when all is done."""
        if flight_end is None and not self.ready:
            if not self.live:
                return False
            raise RuntimeError(f"{mode}: nothing runs and nothing is released: {sorted(self.live)}")
        self.now[0] = max(self.now[0], min([x[0] for x in self.ready] + ([flight_end] if flight_end else [])))
        return True

    def summary(self, d_wait: list[float], steps: int) -> dict:
        return {"makespan_s": self.end, "p99_ttft_ms": float(np.percentile(self.ttft, 99)),
                "mean_decode_wait_ms": 1000 * statistics.fmean(d_wait) if d_wait else 0.0, "steps": steps}


def simulate(rows: list[dict], mode: str, cost: Cost, *, seed: int, pressure: str = "P1",
             control: dict | None = None, priority: str = "none", vocab: int = 151936,
             max_running: int = 64, num_blocks: int = 1 << 16, overlap: bool = False) -> dict:
    """One closed-loop replay on a virtual clock; makespan, p99 TTFT, mean D wait, steps."""
    now = [0.0]
    cfg = EngineConfig(model="sim", mode=mode, block_size=16, max_running=max_running)
    mcfg = ModelConfig.from_dict(load_preset("qwen3-30b-a3b"))
    sched = Scheduler(cfg, mcfg, num_blocks, clock=lambda: now[0])
    ctl = ControlSettings.model_validate(control or {})
    clients = Clients(rows, pressure, seed, vocab, now)
    d_wait, n_steps = [], 0
    flight = None      # overlap: (when the P epoch in flight ends, its launched P rows)

    def finish(launched) -> None:
        sched.apply_result(launched, {r.req.rid: (1, None) for r in launched.rows if r.samples}, now[0])
        clients.answered(sched.outputs())

    while clients.ready or clients.live:
        for rid, ids, row, i, k in clients.released():
            left = work_left(clients.trajs[i], k) if priority == "critical-path" else 0
            sched.submit(rid, ids, SamplingParams(max_new_tokens=row["output_length"], ignore_eos=True),
                         priority=left)
        if flight is not None and now[0] >= flight[0]:
            flight = finish(flight[1])
        launched = sched.plan_step(ctl, p_busy=flight is not None)
        if launched is None:
            if not clients.idle(mode, flight[0] if flight else None):
                break       # the epoch that just finished was the last work
            continue
        d_wait += launched.decode_waits
        n_steps += 1
        plan = launched.plan
        if overlap and plan.prefill and plan.decode:
            # what-if: the P epoch runs on its own stream while D steps go on as graph replays beside it
            # (the multi-rank engine's P epoch in flight, on one GPU), no interference between them
            d_part, p_part = launched.split()
            flight = (now[0] + cost.step_s(0, plan.prefill_tokens), p_part)
            now[0] += cost.step_s(len(plan.decode), 0)
            finish(d_part)
            continue
        now[0] += cost.step_s(len(plan.decode), plan.prefill_tokens)
        finish(launched)
    return clients.summary(d_wait, n_steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steplogs", action="append", required=True, help="glob of step-log dirs (1 GPU)")
    ap.add_argument("--measured", help="glob of results JSON with the measured 1gpu figures per mode")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--pressure", default="P1")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:JSON",
                    help='a pd planner variant: control settings plus "priority" (none|critical-path) and '
                         '"overlap" (what-if: a P epoch on its own stream while D steps replay beside it)')
    ap.add_argument("--p-step-ms", type=float, metavar="MS",
                    help="what-if: the fixed cost of a step that carries P (fitted: ~17 ms), e.g. with graphs")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    cost = fit(read_steps(a.steplogs))
    if a.p_step_ms is not None:
        cost = Cost(cost.graph, (a.p_step_ms / 1e3, *cost.eager[1:]))
    seeds = [int(s) for s in a.seeds.split(",")]
    measured = {}
    for f in sorted(glob.glob(a.measured or "")):
        d = json.loads(Path(f).read_text())
        measured[d["meta"]["seed"]] = d.get("1gpu", {})
    variants = {"normal": ("normal", {}, "none", False), "mixed": ("mixed", {}, "none", False),
                "pd": ("pd", {}, "none", False)}
    for v in a.variant:
        name, _, body = v.partition(":")
        spec = json.loads(body or "{}")
        control = {k: x for k, x in spec.items() if k not in ("priority", "overlap")}
        variants[name] = ("pd", control, spec.get("priority", "none"), bool(spec.get("overlap")))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip() or None
    result = {"meta": {"command": " ".join(sys.argv), "commit": head, "machine": f"{platform.node()} (CPU)",
                       "preset": a.preset, "pressure": a.pressure, "seeds": seeds,
                       "nproc": 1, "topology": "1 GPU (cost model)", "cost": cost.__dict__}, "seeds": {}}
    for seed in seeds:
        rows = generate(a.preset, seed)
        per = result["seeds"][seed] = {}
        for name, (mode, control, prio, overlap) in variants.items():
            per[name] = simulate(rows, mode, cost, seed=seed, pressure=a.pressure, control=control, priority=prio,
                                 overlap=overlap)
            if name in measured.get(seed, {}):
                m = measured[seed][name]
                per[name]["measured"] = {k: m[k] for k in ("makespan_s", "p99_ttft_ms", "mean_decode_wait_ms")}
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"cost model: graph {cost.graph[0] * 1e3:.2f} ms + {cost.graph[1] * 1e3:.3f} ms/row; eager "
          f"{cost.eager[0] * 1e3:.2f} ms + {cost.eager[1] * 1e3:.3f} ms/row + {cost.eager[2] * 1e6:.2f} us/P token")
    print("| seed | variant | makespan s (measured) | /normal | /mixed | p99 TTFT ms (measured) |")
    print("|---|---|---|---|---|---|")
    for seed, per in result["seeds"].items():
        for name, r in per.items():
            m = r.get("measured", {})
            ms = f" ({m['makespan_s']:.2f})" if m else ""
            mt = f" ({m['p99_ttft_ms']:.0f})" if m else ""
            print(f"| {seed} | {name} | {r['makespan_s']:.2f}{ms} | {r['makespan_s'] / per['normal']['makespan_s']:.3f} "
                  f"| {r['makespan_s'] / per['mixed']['makespan_s']:.3f} | {r['p99_ttft_ms']:.0f}{mt} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
