"""Issue 22 on the two-H200 machine: the rendezvous transports at 2 ranks on a GPU host, the
simulator's calibration there, a device-side (NCCL) exchange for reference, and engine step logs.

Usage (repo root, nvidia-h200-x2; spawns its own 2 rank processes, no torchrun needed):
    source e2e/gpu/env.sh; export NCCL_NVLS_ENABLE=0
    python -m e2e.gpu tests rendezvous OUT [--rounds 2000] [--reps 3] [--skip-engine]
Stages (each recorded in OUT/rendezvous2.json; a stage that cannot run says why there and on
stdout, it is never left out silently):
  calib   gloo ping-pong between 2 processes (receives posted ahead), post and message costs,
          each transport's local Python cost for n = 2..256 (e2e/bench_rendezvous.py --calib)
  bench   gather and dissemination side by side, 2 ranks, --reps fresh process pairs
  nccl    the same 6-int64 row exchanged by an NCCL all_gather on the GPUs: pinned host row ->
          device -> all_gather -> host (what a device-side rendezvous would cost from the host)
  engine  `pdrollout generate --nproc 2 --adp 1 --ep 2 --device cuda --mode pd` (fine-grained,
          span 1) with each transport and --step-log OUT/steplog-<transport>: the GPU's rank skew
          and D enqueue times for the simulator (needs pydantic: carry .whl/ as for `tests stall`)
Then here: python e2e/rdv_sim.py --bench results/rendezvous/bench-cpu.json --gpu OUT/rendezvous2.json
           --gpu-steplogs OUT/steplog-gather OUT/steplog-dissemination --out results/rendezvous
           (the full command: docs/DISTRIBUTED.md, "The simulator")
Prints a short table last. DEVICE=cpu: a dry run of the mechanics (gloo instead of NCCL);
REQUESTS=32 (engine stage); PDROLLOUT_COMMIT=<sha> names the commit where the copy has no .git.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from .. import bench_rendezvous as B  # noqa: E402
from .harness import parser, run_group  # noqa: E402

DEVICE = os.environ.get("DEVICE", "cuda")


def _device_exchange(ctx, iters: int, warmup: int):
    import torch
    import torch.distributed as dist
    cuda = DEVICE == "cuda" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(ctx.rank)
        dev = torch.device("cuda", ctx.rank)
        g = dist.new_group([0, 1], backend="nccl")
    else:
        dev = torch.device("cpu")
        g = dist.new_group([0, 1], backend="gloo")
    row_h = torch.zeros(6, dtype=torch.int64, pin_memory=cuda)
    out_h = torch.zeros(12, dtype=torch.int64, pin_memory=cuda)
    row_d = torch.zeros(6, dtype=torch.int64, device=dev)
    out_d = torch.zeros(12, dtype=torch.int64, device=dev)
    lat = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        row_h[3] = i
        row_d.copy_(row_h, non_blocking=True)
        dist.all_gather_into_tensor(out_d, row_d, group=g)
        out_h.copy_(out_d, non_blocking=True)
        if cuda:
            torch.cuda.current_stream().synchronize()
        rows = out_h.tolist()
        if i >= warmup:
            lat.append(time.perf_counter() - t0)
        assert rows[3] == rows[9] == i
    return {"lat": lat, "backend": "nccl" if cuda else "gloo (dry run)"}


def stage_nccl(iters: int) -> dict:
    from ranks import run_ranks
    outs = run_ranks(_device_exchange, 2, (iters, 200), timeout_s=300)
    res = [o.result for o in outs]
    if any(not isinstance(r, dict) or "lat" not in r for r in res):
        return {"error": [(o.exitcode, str(o.result)[-2000:]) for o in outs]}
    return {"backend": res[0]["backend"], **B.stats([x for r in res for x in r["lat"]])}


def stage_engine(out: str, timeout_s: int = 600) -> dict:
    try:
        import pydantic  # noqa: F401
    except ImportError as e:
        return {"skipped": f"pydantic not importable ({e}): carry its wheel in .whl/ (see e2e/gpu/env.sh)"}
    work = "/tmp/pdrollout-rdv2"
    os.makedirs(work, exist_ok=True)
    from pdrollout.engine.model.checkpoint import write_checkpoint
    from pdrollout.engine.protocol.config import load_preset
    import random
    cfg = load_preset("tiny")
    cfg.update(vocab_size=1024, hidden_size=1024, intermediate_size=1024, moe_intermediate_size=256,
               num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
               num_experts=16, num_experts_per_tok=4)
    if not os.path.exists(f"{work}/model/config.json"):
        write_checkpoint(cfg, f"{work}/model", seed=0, dtype="bfloat16" if DEVICE == "cuda" else "float32")
    rng = random.Random(0)
    with open(f"{work}/reqs.jsonl", "w") as f:
        for i in range(int(os.environ.get("REQUESTS", "32"))):
            plen = rng.choice([16, 32, 64, 128, 256])
            f.write(json.dumps({"rid": f"r{i}", "input_ids": [rng.randrange(2, 1000) for _ in range(plen)],
                                "sampling_params": {"max_new_tokens": rng.choice([16, 32]), "temperature": 0,
                                                    "ignore_eos": True}}) + "\n")
    engine = {"block_size": 16, "num_blocks": 2048, "max_running": 32, "mixed_chunk_tokens": 256, "cuda_graphs": False}
    control = {"ordering": "fine-grained", "span": 1, "activation": "on", "prefill_budget_tokens": 256}
    res = {}
    for kind in ("gather", "dissemination"):
        log = os.path.join(out, f"steplog-{kind}")
        args = [sys.executable, "-m", "pdrollout.engine.cli", "generate", "--model", f"{work}/model",
                "--requests", f"{work}/reqs.jsonl", "--mode", "pd", "--device", DEVICE,
                "--dtype", "bfloat16" if DEVICE == "cuda" else "float32", "--nproc", "2", "--adp", "1", "--ep", "2",
                "--engine-config", json.dumps(engine), "--control", json.dumps(control),
                "--rendezvous", kind, "--step-log", log]
        t0 = time.monotonic()
        rc, stdout, stderr = run_group(args, timeout_s)   # no rank may outlive its run (and hold a GPU)
        rounds = []
        for r in range(2):
            path = os.path.join(log, f"rank{r}.jsonl")
            if os.path.exists(path):
                rounds += [t for line in open(path) for t in json.loads(line).get("round_t", [])]
        lat = [t[2] for t in rounds] + [t[4] for t in rounds]
        res[kind] = {"rc": rc, "wall_s": round(time.monotonic() - t0, 1), "steplog": log,
                     "completed": sum('"output_ids"' in line for line in stdout.splitlines()),
                     "rounds_logged": len(rounds), "stderr_tail": stderr[-3000:] if rc != 0 else "",
                     **({"rendezvous": B.stats(lat)} if lat else {})}
    return res


def main() -> None:
    ap = parser(rounds=2000, reps=3)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    meta = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "machine": B.machine(),
            "commit": B.commit(), "nproc": [2], "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": DEVICE,
            "rounds": args.rounds, "reps": args.reps}
    try:
        meta["gpus"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                      capture_output=True, text=True, timeout=30).stdout.split("\n")[:2]
    except (OSError, subprocess.SubprocessError):
        meta["gpus"] = []
    result = {"meta": meta}

    def save():
        with open(os.path.join(args.out, "rendezvous2.json"), "w") as f:
            json.dump(result, f, indent=1)

    print(f"machine: {meta['machine']} gpus {meta['gpus']}", flush=True)
    result["calib"] = B.run_calib()
    save()
    result["runs"] = B.run_bench([2], ["gather", "dissemination"], args.rounds, 200, 100, args.reps)
    result["summary"] = B.summarize(result["runs"])
    save()
    result["nccl"] = stage_nccl(args.rounds)
    save()
    if args.skip_engine:
        result["engine"] = {"skipped": "--skip-engine"}
    else:
        result["engine"] = stage_engine(args.out)
    save()
    import numpy as np
    cal = result["calib"]
    print(f"\ncalibration: ping-pong rtt p50 {np.median(cal['rtt_s']) * 1e6:.1f} us, p99 "
          f"{np.percentile(cal['rtt_s'], 99) * 1e6:.1f} us; post {cal['post_s'] * 1e6:.1f} us")
    n = result["nccl"]
    if "p50_s" in n:
        print(f"device-side exchange ({n['backend']}): p50 {n['p50_s'] * 1e3:.3f} ms, p99 {n['p99_s'] * 1e3:.3f} ms")
    else:
        print(f"device-side exchange: failed {n}")
    for k, e in (result["engine"].items() if "skipped" not in result["engine"] else []):
        r = e.get("rendezvous")
        print(f"engine {k}: rc {e['rc']}, {e['completed']} requests, {e['rounds_logged']} rounds logged"
              + (f", rendezvous p50 {r['p50_s'] * 1e3:.3f} ms p99 {r['p99_s'] * 1e3:.3f} ms" if r else ""))
    if "skipped" in result["engine"]:
        print(f"engine stage skipped: {result['engine']['skipped']}")
    print(f"wrote {os.path.join(args.out, 'rendezvous2.json')}\n")
    print(B.table(result["summary"]), flush=True)


if __name__ == "__main__":
    main()
