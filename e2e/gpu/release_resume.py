"""Issue 18, Must-show 3 on a GPU: /release_memory_occupation then /resume_memory_occupation give the
device memory back and take it again, and the outputs after resume equal those before.

One engine on one GPU, the Qwen3-30B-A3B shape with random bf16 weights built on the device (no
checkpoint on disk), CUDA graphs on. Greedy outputs of a few prompts; then release (weights,
kv_cache, cuda_graph) and measure; resume weights, measure; resume kv_cache and cuda_graph (the
graphs are captured again), measure; the same prompts again. Memory: the device's used bytes
(cudaMemGetInfo), PyTorch's allocated and reserved bytes, and the engine's own count of what its
weights and KV cache hold.
Usage (GPU machine, repo root): source e2e/gpu/env.sh; python -m e2e.gpu tests release-resume OUT_DIR [--layers 24]
Prints a table; writes OUT_DIR/release_resume.json."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdrollout.engine.protocol.config import EngineConfig, load_preset
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.scheduler.request import SamplingParams

GiB = 1 << 30
DEVICE = os.environ.get("DEVICE", "cuda")   # cpu: a dry run of the mechanics on the tiny preset


def measure(engine, what: str) -> dict:
    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info() if cuda else (0, 0)
    own = engine.memory()
    return {"stage": what, "device_used_gib": (total - free) / GiB,
            "allocated_gib": torch.cuda.memory_allocated() / GiB if cuda else 0.0,
            "reserved_gib": torch.cuda.memory_reserved() / GiB if cuda else 0.0,
            "engine_weights_gib": own["weights"] / GiB, "engine_kv_gib": own["kv_cache"] / GiB,
            "released": sorted(engine.released)}


def greedy(engine, prompts, n: int) -> list[list[int]]:
    sp = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}-{time.monotonic_ns()}", p, sp)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
    return [out[k] for k in sorted(out, key=lambda r: int(r.split("-")[0][1:]))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=24, help="of the 30B-A3B shape (48 = the whole model)")
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cfg = load_preset("qwen3-30b-a3b" if DEVICE == "cuda" else "tiny")
    cfg["num_hidden_layers"] = a.layers if DEVICE == "cuda" else cfg["num_hidden_layers"]
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(cfg))
    t0 = time.monotonic()
    engine = Engine(EngineConfig(model=str(tmp), device=DEVICE, dtype="bfloat16" if DEVICE == "cuda" else "float32", mode="pd", random_weights=True,
                                 kv_cache_bytes=int(a.kv_gib * GiB) if DEVICE == "cuda" else 1 << 24, max_running=64))
    load_s = time.monotonic() - t0
    prompts = [[(31 * i + 7 * k) % min(1000, cfg["vocab_size"] - 10) + 10 for k in range(64 + 100 * i)] for i in range(4)]
    rows = [measure(engine, "loaded")]
    before = greedy(engine, prompts, a.tokens)
    rows.append(measure(engine, "after generation"))
    release_s, resume_s = [], []
    for cycle in (1, 2):   # the first release allocates the pinned host arena, the second reuses it
        t = time.monotonic()
        engine.release_memory(["weights", "kv_cache", "cuda_graph"])
        release_s.append(time.monotonic() - t)
        rows.append(measure(engine, f"released (all tags) #{cycle}"))
        t = time.monotonic()
        engine.resume_memory(["weights"])
        rows.append(measure(engine, f"resumed weights #{cycle}"))
        engine.resume_memory(["kv_cache", "cuda_graph"])
        resume_s.append(time.monotonic() - t)
        rows.append(measure(engine, f"resumed kv_cache + cuda_graph #{cycle}"))
    after = greedy(engine, prompts, a.tokens)
    rows.append(measure(engine, "after generation again"))
    equal = before == after
    drop = rows[1]["device_used_gib"] - rows[2]["device_used_gib"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"meta": {"command": " ".join(sys.argv), "commit": os.environ.get("PDROLLOUT_COMMIT", commit),
                       "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__, "layers": a.layers,
                       "kv_gib": a.kv_gib, "load_s": load_s},
              "stages": rows, "release_s": release_s, "resume_s": resume_s, "device_drop_gib": drop,
              "outputs_equal": equal, "before": before, "after": after}
    Path(a.out, "release_resume.json").write_text(json.dumps(result, indent=1))
    print(f"{'stage':32s} {'device used':>12s} {'allocated':>10s} {'reserved':>10s} {'weights':>8s} {'kv':>8s}  GiB")
    for r in rows:
        print(f"{r['stage']:32s} {r['device_used_gib']:12.2f} {r['allocated_gib']:10.2f} {r['reserved_gib']:10.2f} "
              f"{r['engine_weights_gib']:8.2f} {r['engine_kv_gib']:8.2f}")
    print(f"release {' / '.join(f'{x:.2f}' for x in release_s)} s, resume {' / '.join(f'{x:.2f}' for x in resume_s)} s "
          f"(cycles 1 / 2; graphs captured again), device memory given back "
          f"{drop:.2f} GiB, outputs after resume equal before: {equal}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
