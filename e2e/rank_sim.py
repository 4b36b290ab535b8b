"""The multi-rank engine on a virtual clock: one engine Scheduler per attention replica (requests to
the replica with the fewest, as engine.py routes them), the closed loop of a trace, and each step's
cost from `rank_cost.RankModel`. Validates the old code's structure against the two-GPU runs of
docs/perf/one-stack/small-x2 (each seed's overheads fitted on the other seeds' logs). Today's code is
projected from what it sends (rank_cost.d_wire) in e2e/rank_project.py:

    python e2e/rank_sim.py --out results/cost-model.json

A model of the old code, not a measurement, and not today's code.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parent))
import plan_sim   # noqa: E402
from plan_sim import fit, read_steps   # noqa: E402
from rank_cost import RankModel, fit_old, joint_steps   # noqa: E402

from pdrollout.engine.protocol.config import ControlSettings, EngineConfig, ModelConfig, load_preset   # noqa: E402
from pdrollout.engine.scheduler.request import SamplingParams   # noqa: E402
from pdrollout.engine.scheduler.scheduler import Scheduler   # noqa: E402
from pdrollout.engine.workload.trace import generate   # noqa: E402

RUNS = "docs/perf/one-stack/small-x2"
MODES = ("normal", "mixed", "pd")
LAYERS = 12                      # the `small` preset
# Two H200s, NVLink 4: 450 GB/s a direction (NVIDIA H200 datasheet)
NVLINK_B_S = 450e9


def simulate(rows: list[dict], mode: str, model: RankModel, *, seed: int, pressure: str = "P1",
             vocab: int = 151936, max_running: int = 64, num_blocks: int = 1 << 16) -> dict:
    """One closed-loop replay over the model's replicas; makespan, p99 TTFT, mean D wait, steps."""
    now = [0.0]
    cfg = EngineConfig(model="sim", mode=mode, block_size=16, max_running=max_running)
    mcfg = ModelConfig.from_dict(load_preset("qwen3-30b-a3b"))
    scheds = [Scheduler(cfg, mcfg, num_blocks, clock=lambda: now[0]) for _ in range(model.adp)]
    ctl = ControlSettings()
    clients = plan_sim.Clients(rows, pressure, seed, vocab, now)
    d_wait, n_steps, p_steps = [], 0, 0
    flight = None   # (when the P epoch in flight ends, its launched P parts per replica)

    def finish(parts) -> None:
        for s, x in zip(scheds, parts):
            if x is not None:
                s.apply_result(x, {r.req.rid: (1, None) for r in x.rows if r.samples}, now[0])
        clients.answered(o for s in scheds for o in s.outputs())

    while clients.ready or clients.live:
        for rid, ids, row, _, _ in clients.released():
            r = min(range(len(scheds)), key=lambda j: (len(scheds[j].reqs), j))   # engine.py's routing
            scheds[r].submit(rid, ids, SamplingParams(max_new_tokens=row["output_length"], ignore_eos=True))
        if flight is not None and now[0] >= flight[0]:
            parts, flight = flight[1], None
            finish(parts)
        launched = [s.plan_step(ctl, p_busy=flight is not None) for s in scheds]
        if all(x is None for x in launched):
            if not clients.idle(mode, flight[0] if flight else None):
                break
            continue
        n_steps += 1
        d_wait += [w for x in launched if x for w in x.decode_waits]
        rows_r = [len(x.plan.decode) if x else 0 for x in launched]
        ptok = [x.plan.prefill_tokens if x else 0 for x in launched]
        if model.structure.overlap and mode == "pd" and any(ptok) and any(rows_r):
            # the engine's span: the P epoch goes on under the next D steps (engine._spans)
            p_steps += 1
            split = [x.split() if x else (None, None) for x in launched]
            flight = (now[0] + model.p_epoch_s(ptok), [p for _, p in split])
            now[0] += model.d_step_s(rows_r, beside_p=True)
            finish([d for d, _ in split])
        elif any(ptok):
            p_steps += 1
            now[0] += model.p_step_s(rows_r, ptok, pd=mode == "pd")
            finish(launched)
        else:
            now[0] += model.d_step_s(rows_r, beside_p=flight is not None)
            finish(launched)
    return {**clients.summary(d_wait, n_steps), "p_steps": p_steps}


def measured(root: str, seed: int) -> dict:
    return json.loads(Path(f"{root}/small-s{seed}.json").read_text())["2gpu"]


def fitted(root: str, seeds: list[int]) -> RankModel:
    """The one-GPU compute fit (every 1-GPU log) and the old code's overheads on `seeds`' 2-GPU logs."""
    cost = fit(read_steps([f"{root}/steplog-small-s*-1gpu-*"]))
    runs = {m: {seed: joint_steps(f"{root}/steplog-small-s{seed}-2gpu-{m}") for seed in seeds} for m in MODES}
    # rank 0's time outside the ranks' logged steps, per step (3.2-4.8 ms a step in these runs)
    outside = sum(measured(root, seed)[m]["makespan_s"] - sum(s["wall_s"] for s in steps)
                  for m in MODES for seed, steps in runs[m].items())
    n = sum(len(steps) for m in MODES for steps in runs[m].values())
    flat = {m: [s for steps in runs[m].values() for s in steps] for m in MODES}
    return fit_old(cost, flat, LAYERS, outside / n, NVLINK_B_S)


def validate(root: str, seeds: list[int], held_out: bool = True) -> dict:
    """Each seed's makespan per mode from a model fitted on the other seeds' two-GPU logs
    (`held_out`), or on every seed's (what the projection uses)."""
    out = {}
    for seed in seeds:
        model = fitted(root, [s for s in seeds if s != seed] if held_out and len(seeds) > 1 else seeds)
        rows, meas = generate("small", seed), measured(root, seed)
        out[seed] = {"fit": model.meta}
        for mode in MODES:
            sim = simulate(rows, mode, model, seed=seed)
            m = meas[mode]["makespan_s"]
            out[seed][mode] = {**sim, "measured_makespan_s": m, "error": sim["makespan_s"] / m - 1}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=RUNS, help="the two-GPU runs' folder (small-sS.json, steplog-*)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip() or None
    val = {"all_seeds": validate(a.runs, seeds, held_out=False), "held_out": validate(a.runs, seeds)}
    old = fitted(a.runs, seeds)
    result = {"meta": {"command": " ".join(["python", "e2e/rank_sim.py", *(argv or sys.argv[1:])]), "commit": head,
                       "machine": f"{platform.node()} (CPU)", "seeds": seeds, "pressure": "P1",
                       "nproc": 2, "topology": "ADP2/EP2 on 2 H200s (the old code)",
                       "layers": LAYERS, "fit_all_seeds": old.meta, "cost_1gpu": old.cost.__dict__},
              "validation": val}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print("| seed | mode | measured s | simulated s (fit: all seeds) | error | held out: simulated s | error |")
    print("|---|---|---|---|---|---|---|")
    for seed in seeds:
        for m in MODES:
            r, h = val["all_seeds"][seed][m], val["held_out"][seed][m]
            print(f"| {seed} | {m} | {r['measured_makespan_s']:.2f} | {r['makespan_s']:.2f} | {100 * r['error']:+.1f} % "
                  f"| {h['makespan_s']:.2f} | {100 * h['error']:+.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
