"""Benchmark (not a test): the per-step control plane, before and after, in real rank processes over
gloo on this host (docs/PERF.md, "The per-step control plane").

    python e2e/bench_plan_channel.py [--worlds 2 4 8 16] [--rows 64] [--steps 60] [--blocks 4] [--out FILE]

Per step rank 0 hands every rank a decode plan of `--rows` rows a replica (contexts around 2k tokens,
block 16: a new block every 16 steps a row) and gathers one report a rank (the replica leaders' tokens):
  before  the whole StepPlan pickled to every rank (`broadcast_object_list`) and the reports pickled
          back (`gather_object`): what engine.py did up to 8ce552a;
  after   runtime/plan_channel.py: each rank its replica's rows in the binary layout, one scatter,
          one gather.
Both run in the same processes, in alternating blocks of steps. Every rank sleeps 2 ms between its
plan and its report (a step's work, so the ranks settle). Per step:
  bytes     a rank's plan as received, its report as sent (the largest rank's);
  cpu       thread time inside the control plane's calls: rank 0's, and the slowest other rank's;
  path      the critical path on the host's shared monotonic clock: rank 0 starts the plan -> the last
            rank holds its decoded plan, plus the last rank starts its report -> rank 0 holds every
            report decoded. It includes waking each rank's process: on this 2-core VM 16 ranks share
            2 cores, on a GPU host each rank has its own.
Prints a Markdown table last; --out writes the JSON (meta: command, machine, commit, topology).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEP_WORK_S = 0.002


def topology(world: int) -> tuple[int, int]:
    """(ADP, EP): two ranks an attention replica past two ranks (EP16/ADP8 at 16), ADP2 at two."""
    return (2, 2) if world == 2 else (world // 2, world)


class Decode:
    """`rows` decode rows a replica, each a step further, a block appended every 16 tokens (block tables
    as the scheduler keeps them)."""

    def __init__(self, adp: int, rows: int, seed: int = 0) -> None:
        from pdrollout.engine.scheduler.kv_pool import BlockTable   # the scheduler's: one tuple until it changes
        rng = random.Random(seed)
        self.reqs = [[[f"conv-{a}-{i}-turn-3", 2000 + rng.randrange(96),
                       BlockTable(range((a * rows + i) * 400, (a * rows + i) * 400 + 126))]
                      for i in range(rows)] for a in range(adp)]
        self.rng = rng

    def plan(self, step: int):
        from pdrollout.engine.protocol.config import ControlSettings
        from pdrollout.engine.protocol.plan import NewRequest, Phase, ReplicaWork, RowSpec, StepPlan
        from pdrollout.engine.scheduler.request import SamplingParams
        works = []
        for reqs in self.reqs:
            rows = []
            for q in reqs:
                q[1] += 1
                if q[1] % 16 == 0:
                    q[2].append(q[2][-1] + 1)
                rows.append(RowSpec(q[0], Phase.DECODE, q[1], (self.rng.randrange(151936),), q[2].frozen(), True))
            works.append(ReplicaWork(tuple(rows)))
        new = tuple(NewRequest(q[0], a, SamplingParams(temperature=0.0)) for a, reqs in enumerate(self.reqs)
                    for q in reqs) if step == 0 else ()
        return StepPlan(step, ControlSettings().model_dump(), tuple(works), new)


def _ranks(ctx, rows: int, steps: int, blocks: int):
    import torch.distributed as dist
    from pdrollout.engine.protocol.plan import StepReport
    from pdrollout.engine.protocol.topology import Topology
    from pdrollout.engine.runtime.plan_channel import PlanChannel
    adp, ep = topology(ctx.world)
    topo = Topology(ctx.world, adp, ep)
    me, leader = topo.replica(ctx.rank), topo.local_index(ctx.rank) == 0
    gen = Decode(adp, rows)
    ch = PlanChannel(topo, ctx.rank)
    out = []
    step = 0
    for b in range(2 * blocks + 1):   # block 0 warms both paths up (the first plan makes every slot)
        arm = "before" if b % 2 else "after"
        for _ in range(steps if b else 4):
            plan = gen.plan(step) if ctx.rank == 0 else None
            dist.barrier()
            t0, c0 = time.monotonic(), time.thread_time()
            rec = {"arm": arm, "step": step, "warm": b == 0}
            if arm == "before":
                box = [plan]
                dist.broadcast_object_list(box, src=0)
                plan = box[0]
                rec["plan_bytes"] = len(pickle.dumps(plan))
            elif ctx.rank == 0:
                ch.send(plan)
                rec["plan_bytes"] = ch.last.plan_bytes
            else:
                plan = ch.recv()
                rec["plan_bytes"] = ch.last.plan_bytes
            rec["t_plan"], rec["cpu"] = time.monotonic(), time.thread_time() - c0
            time.sleep(STEP_WORK_S)
            w = plan.replicas[me]
            report = StepReport(ctx.rank, step, {r.rid: (r.tokens[0] + 1, None) for r in w.decode} if leader else {})
            rec["t_report"], c0 = time.monotonic(), time.thread_time()
            if arm == "before":
                reports = [None] * ctx.world if ctx.rank == 0 else None
                dist.gather_object(report, reports, dst=0)
                rec["report_bytes"] = len(pickle.dumps(report))
            elif ctx.rank == 0:
                reports = ch.gather(report)
                rec["report_bytes"] = ch.last.report_bytes
            else:
                ch.report(report)
                rec["report_bytes"] = ch.last.report_bytes
            rec["t_done"], rec["cpu"] = time.monotonic(), rec["cpu"] + time.thread_time() - c0
            if ctx.rank == 0:   # the reports came back whole: every leader's tokens
                got = sum(len(r.tokens) for r in reports)
                assert got == rows * adp, (arm, step, got)
            rec["t0"] = t0
            out.append(rec)
            step += 1
    if ctx.rank == 0:
        ch.send(type(gen.plan(0))(step, {}, stop=True))
    else:
        assert ch.recv().stop
    return out


def summarize(world: int, outs) -> dict:
    import statistics
    per_rank = [o.result for o in outs]
    res = {}
    for arm in ("before", "after"):
        steps = [i for i, r in enumerate(per_rank[0]) if r["arm"] == arm and not r["warm"]]
        path, cpu0, cpuw, pb, rb = [], [], [], [], []
        for i in steps:
            r0, others = per_rank[0][i], [p[i] for p in per_rank[1:]]
            plan_path = max(o["t_plan"] for o in others) - r0["t0"]
            report_path = r0["t_done"] - max(o["t_report"] for o in others)
            path.append(plan_path + report_path)
            cpu0.append(r0["cpu"])
            cpuw.append(max(o["cpu"] for o in others))
            pb.append(max(o["plan_bytes"] for o in others))
            rb.append(max(o["report_bytes"] for o in others))
        q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]
        res[arm] = {"steps": len(steps), "plan_bytes": statistics.median(pb), "report_bytes": statistics.median(rb),
                    "path_ms_p50": 1e3 * statistics.median(path), "path_ms_p90": 1e3 * q(path, 0.9),
                    "cpu0_ms_p50": 1e3 * statistics.median(cpu0), "cpu_rank_ms_p50": 1e3 * statistics.median(cpuw)}
    return res


def table(runs: list[dict]) -> str:
    lines = ["| ranks (ADP/EP) | arm | plan bytes a rank | report bytes a rank | rank 0 CPU ms | slowest other rank's CPU ms "
             "| critical path ms p50 (p90) |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        for arm in ("before", "after"):
            s = run["summary"][arm]
            lines.append(f"| {run['world']} ({run['adp']}/{run['ep']}) | {arm} | {s['plan_bytes']:,.0f} | {s['report_bytes']:,.0f} | "
                         f"{s['cpu0_ms_p50']:.3f} | {s['cpu_rank_ms_p50']:.3f} | {s['path_ms_p50']:.3f} ({s['path_ms_p90']:.3f}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--rows", type=int, default=64, help="decode rows a replica")
    ap.add_argument("--steps", type=int, default=60, help="steps a block")
    ap.add_argument("--blocks", type=int, default=4, help="blocks of each arm, alternating")
    ap.add_argument("--out")
    a = ap.parse_args()
    from bench_rendezvous import commit, machine
    from ranks import assert_ok, run_ranks
    runs = []
    for w in a.worlds:
        t0 = time.monotonic()
        outs = run_ranks(_ranks, w, (a.rows, a.steps, a.blocks), timeout_s=1800)
        assert_ok(outs)
        adp, ep = topology(w)
        runs.append({"world": w, "adp": adp, "ep": ep, "summary": summarize(w, outs), "wall_s": time.monotonic() - t0})
        print(json.dumps(runs[-1]), flush=True)
    meta = {"command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]), "commit": commit(),
            "machine": machine(), "rows_a_replica": a.rows, "steps_a_block": a.steps, "blocks": a.blocks,
            "step_work_s": STEP_WORK_S, "load_avg": os.getloadavg(),
            "topology": {str(r["world"]): {"adp": r["adp"], "ep": r["ep"]} for r in runs}}
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=1)
    print(table(runs))


if __name__ == "__main__":
    main()
