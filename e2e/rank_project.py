"""Decode tokens/s per GPU of today's multi-rank engine at 48 layers and 64 rows a replica: 2 GPUs
(EP2/ADP2) and 16 (EP16/ADP8, two nodes of 8) against one GPU at batch 64 (docs/PERF.md, "D's bytes and
the cost model"). A model, with a low and a high end:

    python e2e/rank_project.py --gpu EP2_RANK.json --control PLAN_CHANNEL.json --out FILE

A decode step on a rank = its graph's GPU time + its D collectives + the host's per-step work + the
control plane:
  GPU time   the rank's HBM floor (rank_cost.d_floor_bytes, at the copy rate of the --gpu run) times
             a replay/floor ratio measured in that run (e2e/gpu/ep2_rank.py): one GPU its own step's,
             2 GPUs the EP2-rank stand-in's, 16 GPUs (no stand-in) between the two;
  collectives  rank_cost.d_wire (what the code sends, as the step log counts it) over
             rank_cost.Fabric: NVLink in a node, RDMA between nodes, each a latency range;
  host       one GPU's engine step less its replay (planning, sampling), from bench_engine;
  control    the plan channel's per-step critical path at that many CPU ranks (bench_plan_channel.py),
             p50 at the low end, p90 at the high.
Beside a P epoch a D step also stretches by the one-GPU interference (D steps beside P forwards,
1.66-1.94x at batch 64: docs/perf/HISTORY.md, "One H200: the GIL ruled out") and, where P
and D groups cross (ATP2), pays a turnstile round (1.73 ms at 16 ranks, dissemination: DISTRIBUTED.md).
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from rank_cost import Fabric, Link, Shape, d_floor_bytes, d_wire, wire_s   # noqa: E402

LAYERS, ROWS, CTX, HIDDEN, TOPK = 48, 64, 2048, 2048, 8
# NVLink 4: 450 GB/s a direction (H100/H200 SXM); a collective's latency inside a graph: 10 us (small
# all-to-alls between two H100s, NCCL's own latency) to 55 us (the old code's fit on two H200s,
# PERF.md). RDMA: 400 Gb/s a GPU (ConnectX-7), 40-50 GB/s reached; 20-60 us a collective.
NVLINK = {"low": Link(10e-6, 450e9), "high": Link(55e-6, 450e9)}
RDMA = {"low": Link(20e-6, 50e9), "high": Link(60e-6, 40e9)}
BESIDE_P = (1.66, 1.94)            # one GPU: a D step beside P forwards, over alone (batch 64, ctx 2k)
ROUND16_S = 1.73e-3                # a crossed turnstile round at 16 ranks (dissemination, simulated)
ONE_GPU_H200 = "docs/perf/one-gpu-73af422/decode/decode-b64.json"   # replay 19.53 ms, step 21.24 ms


def configs() -> dict:
    return {"1 GPU": (1, 1, 1, 8), "2 GPUs EP2/ADP2": (2, 2, 2, 8), "16 GPUs EP16/ADP8": (16, 8, 16, 8)}


def step(name: str, world: int, adp: int, ep: int, per_node: int, bw: float, ratio: float, host_s: float,
         control_s: float, end: str) -> dict:
    floor_s = d_floor_bytes(world, adp, ep, ROWS, CTX, LAYERS) / bw
    shape = Shape(world, adp, ep, HIDDEN, TOPK, LAYERS, LAYERS)
    fabric = Fabric(per_node, NVLINK[end], RDMA[end])
    wire = d_wire(shape, 0, [ROWS] * adp) if world > 1 else []
    coll_s = max(wire_s(shape, fabric, r, d_wire(shape, r, [ROWS] * adp)) for r in range(world)) if wire else 0.0
    gpu_s = floor_s * ratio
    alone = gpu_s + coll_s + host_s + control_s
    f = BESIDE_P[0] if end == "low" else BESIDE_P[1]
    beside = gpu_s * f + coll_s + host_s + control_s + (ROUND16_S if world // adp > 1 else 0.0)
    tps = lambda t: ROWS * adp / t / world
    return {"config": name, "end": end, "floor_ms": floor_s * 1e3, "ratio": ratio, "gpu_ms": gpu_s * 1e3,
            "collectives_a_step": len(wire), "bytes_a_step": sum(b for _, _, b in wire), "coll_ms": coll_s * 1e3,
            "host_ms": host_s * 1e3, "control_ms": control_s * 1e3, "step_ms": alone * 1e3,
            "tokens_s_per_gpu": tps(alone), "beside_p_step_ms": beside * 1e3, "beside_p_tokens_s_per_gpu": tps(beside)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", help="e2e/gpu/ep2_rank.py's JSON (the EP2 stand-in and one GPU, one call)")
    ap.add_argument("--control", help="e2e/bench_plan_channel.py's JSON (the control plane per step)")
    ap.add_argument("--one-gpu", default=ONE_GPU_H200, help="bench_engine's JSON: host work per step")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    one = json.loads(Path(a.one_gpu).read_text())
    host_s = (one["decode_step_ms"] - one["decode_replay_ms"]) / 1e3
    if a.gpu:   # one GPU's own ratio; 2 GPUs the EP2 stand-in's; 16 GPUs between the two (no stand-in)
        g = json.loads(Path(a.gpu).read_text())
        bw, chip = g["meta"]["copy_bw_tbs"] * 1e12, g["meta"]["gpu"]
        r1, r2 = g["one_gpu"]["replay_over_floor"], g["ep2_rank"]["replay_over_floor"]
    else:
        bw, chip = one["copy_bw_tbs"] * 1e12, one["gpu"]
        r1 = r2 = one["decode_replay_over_floor"]
    ratios = {1: (r1, r1), 2: (r2, r2), 16: (min(r1, r2), max(r1, r2))}
    control = {1: (0.0, 0.0)}
    if a.control:
        c = json.loads(Path(a.control).read_text())
        for run in c["runs"]:
            s = run["summary"]["after"]
            control[run["world"]] = (s["path_ms_p50"] / 1e3, s["path_ms_p90"] / 1e3)
    rows = []
    for name, (world, adp, ep, per_node) in configs().items():
        lo, hi = control.get(world, (0.0, 0.0))
        for end, ratio, ctl in (("low", ratios[world][0], lo), ("high", ratios[world][1], hi)):
            rows.append(step(name, world, adp, ep, per_node, bw, ratio, host_s, ctl if world > 1 else 0.0, end))
    base = {r["end"]: r["tokens_s_per_gpu"] for r in rows if r["config"] == "1 GPU"}
    for r in rows:
        r["vs_1_gpu"] = r["tokens_s_per_gpu"] / base[r["end"]]
        r["beside_p_vs_1_gpu"] = r["beside_p_tokens_s_per_gpu"] / base[r["end"]]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip() or None
    out = {"meta": {"command": " ".join(["python", "e2e/rank_project.py", *(argv or sys.argv[1:])]), "commit": head,
                    "machine": f"{platform.node()} (CPU)", "chip": chip, "copy_bw_tbs": bw / 1e12, "layers": LAYERS,
                    "rows_a_replica": ROWS, "ctx": CTX, "nproc": [1, 2, 16], "seed": None,
                    "topology": {k: {"world": v[0], "adp": v[1], "ep": v[2], "gpus_per_node": v[3]}
                                 for k, v in configs().items()},
                    "inputs": {"gpu": a.gpu, "control": a.control, "one_gpu": a.one_gpu},
                    "assumed": {"nvlink": {k: v.__dict__ for k, v in NVLINK.items()},
                                "rdma": {k: v.__dict__ for k, v in RDMA.items()},
                                "beside_p": BESIDE_P, "round16_s": ROUND16_S, "host_s": host_s}},
           "rows": rows}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"| config ({chip}) | end | floor ms | GPU ms | collectives (a step) | coll ms | host + control ms | step ms | "
          "tokens/s per GPU | vs 1 GPU | beside P: vs 1 GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['end']} | {r['floor_ms']:.2f} | {r['gpu_ms']:.2f} | {r['collectives_a_step']} "
              f"({r['bytes_a_step'] / 1e6:.1f} MB) | {r['coll_ms']:.2f} | {r['host_ms'] + r['control_ms']:.2f} | "
              f"{r['step_ms']:.2f} | {r['tokens_s_per_gpu']:.0f} | {r['vs_1_gpu']:.2f} | {r['beside_p_vs_1_gpu']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
