"""What a step that carries P costs beside its parts alone, on one GPU, with a kernel profile.

At P1 most steps that carry P fuse a continuation's few hundred new tokens into D's step (`mixed`,
and pd below `solo_fuse_tokens`); the step log put such a step at ~24.5 ms against ~13 ms for a
D-only graph replay and ~14.4 ms for a P-only step (HISTORY.md, thirteenth session). Both parts stream the same expert
weights, so fused they should cost little more than the larger one. This times, on a `mixed`
engine with `batch` rows decoding at `ctx` tokens:
  d        engine steps with D rows only (graph replays)
  fused n  engine steps that also carry one continuation of n new tokens over a row's cached
           prompt (its first token only, so the batch stays as it is)
  p n      the same P alone through P's piecewise graphs (issued and complete; its issue time)
then profiles a few steps of each (torch.profiler): GPU kernel time per step by kernel, and the
step's wall beside its kernels' sum (the gap is the GPU waiting on the host).

    python -m e2e.gpu bench fused-step OUT.json [--batch 32] [--ctx 2048] [--new 32,128,512] [--steps 8]
    DEVICE=cpu python -m e2e.gpu bench fused-step OUT.json     # the tiny preset on the CPU: a dry run
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from .bench_engine import p_batch, p_runs
from .harness import parser
from pdrollout.engine.protocol.config import EngineConfig, load_preset
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.scheduler.request import SamplingParams


def build(cpu: bool, batch: int, ctx: int, steps: int, **config) -> tuple[Engine, list[list[int]]]:
    cfg = load_preset("tiny" if cpu else "qwen3-30b-a3b")
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(cfg))
    device = dict(device="cpu", dtype="float32", num_blocks=4096) if cpu else \
        dict(device="cuda", dtype="bfloat16", kv_cache_bytes=40 << 30)
    e = Engine(EngineConfig(model=str(tmp), random_weights=True, mode="mixed", max_running=batch + 1,
                            block_size=16, **device, **config))
    g = torch.Generator().manual_seed(0)
    prompts = []
    for i in range(batch):
        prompts.append(torch.randint(2, cfg["vocab_size"], (ctx,), generator=g).tolist())
        e.submit(f"r{i}", prompts[-1], SamplingParams(max_new_tokens=steps, ignore_eos=True))
    while any(not r.output for r in e.schedulers[0].reqs.values()):
        e.step()
    return e, prompts


def sync(e) -> None:
    if e.worker.cuda:
        torch.cuda.synchronize(e.worker.device)


class Continuations:
    """One continuation per step: a running row's prompt and n new tokens (a prefix-cache hit on
    the prompt), one new token, so the decode batch is the same after the step."""

    def __init__(self, e: Engine, prompts: list[list[int]], vocab: int):
        self.e, self.prompts, self.vocab, self.count = e, prompts, vocab, 0
        self.g = torch.Generator().manual_seed(1)

    def submit(self, n: int) -> None:
        base = self.prompts[self.count % len(self.prompts)]
        self.e.submit(f"c{self.count}", base + torch.randint(2, self.vocab, (n,), generator=self.g).tolist(),
                      SamplingParams(max_new_tokens=1, ignore_eos=True))
        self.count += 1


def timed(e, steps: int, before=None) -> tuple[float, list[int]]:
    """Median wall ms of `steps` engine steps (each synchronized), and the P tokens each carried."""
    walls, p = [], []
    for _ in range(steps):
        if before:
            before()
        sync(e)
        t = time.perf_counter()
        e.step()
        sync(e)
        walls.append((time.perf_counter() - t) * 1e3)
        p.append(e.records[-1].prefill_tokens)
    return statistics.median(walls), p


def p_alone(e, n: int, ctx: int, reps: int) -> dict:
    """One segment of n new tokens over ctx cached ones, through P's graphs (eager if none)."""
    w = e.worker
    batch = p_batch(w, 1, n, ctx, torch.Generator().manual_seed(3))
    runs = p_runs(w, batch)
    name, run = ("graphed", runs["graphed"]) if "graphed" in runs else ("eager", runs["eager"])
    walls, issues = [], []
    for _ in range(reps + 2):
        batch.prefill_plan = None
        sync(e)
        t0 = time.perf_counter()
        run()
        t1 = time.perf_counter()
        sync(e)
        walls.append((time.perf_counter() - t0) * 1e3)
        issues.append((t1 - t0) * 1e3)
    return {"how": name, "ms": statistics.median(walls[2:]), "issue_ms": statistics.median(issues[2:])}


def profile(e, steps: int, before=None) -> dict:
    """Kernel time per step by kernel (µs), their sum, and the steps' wall (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile as prof
    sync(e)
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t = time.perf_counter()
        for _ in range(steps):
            if before:
                before()
            e.step()
            sync(e)
        wall = (time.perf_counter() - t) * 1e3 / steps
    by = defaultdict(float)
    for ev in p.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by[ev.name] += ev.device_time / steps   # µs
    top = sorted(by.items(), key=lambda kv: -kv[1])[:20]
    return {"wall_ms": wall, "kernel_ms": sum(by.values()) / 1e3,
            "kernels_us": [{"name": k[:90], "us": round(v, 1)} for k, v in top]}


def main() -> int:
    ap = parser(batch=32, ctx=2048, steps=8)
    ap.add_argument("--new", default="32,128,512")
    ap.add_argument("--profile-new", type=int, default=128, help="the fused step's P tokens when profiled")
    a = ap.parse_args()
    cpu = os.environ.get("DEVICE") == "cpu"
    batch, ctx, steps = (4, 64, 2) if cpu else (a.batch, a.ctx, a.steps)
    news = [min(int(x), 16) if cpu else int(x) for x in a.new.split(",")]
    runs = 2 + len(news) * 2 + (0 if cpu else 2)   # D-only, fused per n, profiled (each `steps`)
    e, prompts = build(cpu, batch, ctx, steps * (runs + 2) + 8)
    cont = Continuations(e, prompts, e.worker.cfg.vocab_size)
    for n in news:   # first-use work (graph buckets, tiles) out of the timed steps
        timed(e, 2, lambda n=n: cont.submit(n))
    d_ms, _ = timed(e, steps)
    rows = []
    for n in news:
        ms, carried = timed(e, steps, lambda n=n: cont.submit(n))
        if any(c != n for c in carried):   # the prompt must be a hit: P is the n new tokens only
            raise SystemExit(f"fused steps of {n} new tokens carried {carried} P tokens")
        alone = p_alone(e, n, ctx, steps)
        rows.append({"new": n, "fused_ms": ms, "p_alone_ms": alone["ms"], "p_alone_issue_ms": alone["issue_ms"],
                     "p_alone_how": alone["how"], "fused_over_d": ms / d_ms,
                     "fused_over_sum": ms / (d_ms + alone["ms"]), "fused_over_max": ms / max(d_ms, alone["ms"])})
    prof = {}
    if not cpu:
        pn = a.profile_new
        prof = {"d": profile(e, steps), f"fused_{pn}": profile(e, steps, lambda: cont.submit(pn))}
    meta = {"command": "python -m e2e.gpu bench fused-step " + " ".join(sys.argv[1:]),
            "commit": os.environ.get("COMMIT"), "machine": os.environ.get("MACHINE"),
            "device": "cpu" if cpu else torch.cuda.get_device_name(), "nproc": 1, "topology": "EP1/ADP1",
            "batch": batch, "ctx": ctx, "steps": steps, "mode": "mixed"}
    Path(a.out).write_text(json.dumps({"meta": meta, "d_step_ms": d_ms, "rows": rows, "profile": prof}, indent=1))
    print(f"D-only step {d_ms:.2f} ms (batch {batch}, ctx {ctx})")
    print(f"{'new':>6}{'fused ms':>10}{'P alone':>9}{'issue':>7}{'/D':>7}{'/sum':>7}{'/max':>7}")
    for r in rows:
        print(f"{r['new']:>6}{r['fused_ms']:>10.2f}{r['p_alone_ms']:>9.2f}{r['p_alone_issue_ms']:>7.2f}"
              f"{r['fused_over_d']:>7.3f}{r['fused_over_sum']:>7.3f}{r['fused_over_max']:>7.3f}")
    for name, p in prof.items():
        print(f"\n{name}: wall {p['wall_ms']:.2f} ms a step, kernels {p['kernel_ms']:.2f} ms")
        for k in p["kernels_us"][:12]:
            print(f"  {k['us']:>9.1f} µs  {k['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
