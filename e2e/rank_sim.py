"""The multi-rank engine on a virtual clock: one engine Scheduler per attention replica (requests to
the replica with the fewest, as engine.py routes them), the closed loop of a trace, and each step's
cost from `rank_cost.RankModel`. Validates the old code's structure against the two-GPU runs of
docs/perf/one-stack/small-x2 (each seed's overheads fitted on the other seeds' logs), then projects
the new code's structure on 2 GPUs and on 16 (EP16/ADP8, H20-class), the interference swept:

    python e2e/rank_sim.py --out results/cost-model.json

A model, not a measurement: the projection holds as far as the validation rows say it does.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parent))
import plan_sim   # noqa: E402
from plan_sim import fit, read_steps   # noqa: E402
from rank_cost import H20, Links, RankModel, fit_old, joint_steps, new_structure   # noqa: E402

from pdrollout.engine.protocol.config import ControlSettings, EngineConfig, ModelConfig, load_preset   # noqa: E402
from pdrollout.engine.scheduler.request import SamplingParams   # noqa: E402
from pdrollout.engine.scheduler.scheduler import Scheduler   # noqa: E402
from pdrollout.engine.workload.trace import generate   # noqa: E402

RUNS = "docs/perf/one-stack/small-x2"
MODES = ("normal", "mixed", "pd")
LAYERS = 12                      # the `small` preset
# Two H200s, NVLink 4: 450 GB/s a direction (NVIDIA H200 datasheet); a gloo gather: 0.184 ms p50
# (docs/perf/HISTORY.md, "Rendezvous latency", two H200s, bench), the part of a step's exchange that grows
# with the rank count.
NVLINK_B_S, GATHER2_S = 450e9, 0.184e-3
# 16 ranks over two nodes: DeepEP's low-latency kernels at EP16 on H800 + CX7 400 Gb/s, 128 tokens,
# 7168 hidden, top-8: dispatch 118 us at 63 GB/s, combine 195 us at 74 GB/s (deepseek-ai/DeepEP,
# docs/legacy.md, "Low-latency kernels with pure RDMA"): the slower, 63 GB/s, per byte. The gather and
# a crossed round at 16 ranks, 25 us between nodes: 1.32 ms a gather call, 1.73 ms of D wait a round
# (dissemination) (docs/DISTRIBUTED.md, "EP16 over two nodes").
RDMA16_B_S, GATHER16_S, ROUND16_S = 63e9, 1.32e-3, 1.73e-3


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


def project(old: RankModel, seeds: list[int], interference: list[float], preset16: str) -> dict:
    """The new code's structure: 2 GPUs (ADP2/EP2, ATP1, H200) and 16 (EP16/ADP8, ATP2, H20-class)."""
    two = replace(old, structure=new_structure(1), links=replace(old.links, round_s=0.0))
    sixteen = replace(old, n=16, adp=8, chip=H20, structure=new_structure(2),
                      links=Links(16, old.links.alpha_s, RDMA16_B_S,
                                  old.links.exchange_s - GATHER2_S + GATHER16_S, ROUND16_S))
    out = {}
    for name, model, preset in (("2gpu", two, "small"), ("16gpu", sixteen, preset16)):
        per = out[name] = {"preset": preset, "nproc": model.n, "adp": model.adp, "chip": model.chip.name,
                           "structure": model.structure.__dict__, "links": model.links.__dict__, "rows": []}
        for seed in seeds:
            rows = generate(preset, seed)
            base = {m: simulate(rows, m, model, seed=seed) for m in ("normal", "mixed")}
            if name == "2gpu":   # beside it: the old code on 2 GPUs and one GPU (plan_sim), same model
                for m in MODES:
                    base[f"old_{m}"] = simulate(rows, m, old, seed=seed)
                    base[f"1gpu_{m}"] = plan_sim.simulate(rows, m, old.cost, seed=seed)
            for f in interference:
                pd = simulate(rows, "pd", replace(model, interference=f), seed=seed)
                per["rows"].append({"seed": seed, "interference": f, "pd": pd, **base,
                                    "pd/normal": pd["makespan_s"] / base["normal"]["makespan_s"],
                                    "pd/mixed": pd["makespan_s"] / base["mixed"]["makespan_s"]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=RUNS, help="the two-GPU runs' folder (small-sS.json, steplog-*)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--interference", default="0,0.1,0.2,0.3,0.4,0.5")
    ap.add_argument("--preset16", default="gpu", help="the trace for 16 GPUs (8 replicas)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip() or None
    val = {"all_seeds": validate(a.runs, seeds, held_out=False), "held_out": validate(a.runs, seeds)}
    old = fitted(a.runs, seeds)
    result = {"meta": {"command": " ".join(["python", "e2e/rank_sim.py", *(argv or sys.argv[1:])]), "commit": head,
                       "machine": f"{platform.node()} (CPU)", "seeds": seeds, "pressure": "P1",
                       "nproc": [2, 16], "topology": "validation: ADP2/EP2 on 2 H200s (old code); projection: "
                       "ADP2/EP2 on 2 H200s, EP16/ADP8 (ATP2) on 16 H20-class GPUs (new code)",
                       "layers": LAYERS, "fit_all_seeds": old.meta, "cost_1gpu": old.cost.__dict__},
              "validation": val, "projection": project(old, seeds, [float(x) for x in a.interference.split(",")],
                                                       a.preset16)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print("| seed | mode | measured s | simulated s (fit: all seeds) | error | held out: simulated s | error |")
    print("|---|---|---|---|---|---|---|")
    for seed in seeds:
        for m in MODES:
            r, h = val["all_seeds"][seed][m], val["held_out"][seed][m]
            print(f"| {seed} | {m} | {r['measured_makespan_s']:.2f} | {r['makespan_s']:.2f} | {100 * r['error']:+.1f} % "
                  f"| {h['makespan_s']:.2f} | {100 * h['error']:+.1f} % |")
    for name, per in result["projection"].items():
        print(f"\n{name} ({per['chip']}, {per['preset']}): | interference | normal s | mixed s | pd s | pd/normal | pd/mixed |")
        for f in sorted({r["interference"] for r in per["rows"]}):
            rs = [r for r in per["rows"] if r["interference"] == f]
            med = lambda k: statistics.median(r[k]["makespan_s"] if isinstance(r[k], dict) else r[k] for r in rs)
            print(f"| {f:.1f} | {med('normal'):.2f} | {med('mixed'):.2f} | {med('pd'):.2f} | "
                  f"{med('pd/normal'):.3f} | {med('pd/mixed'):.3f} |")
        if name == "2gpu":
            print("old code / 1 GPU (median s): " + ", ".join(f"{m}: {med('old_' + m):.2f} / {med('1gpu_' + m):.2f}"
                                                      for m in MODES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
