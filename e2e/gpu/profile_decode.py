"""Where a decode step's GPU time goes: torch.profiler over eager decode forwards (the same kernels the
CUDA graph replays) of the Qwen3-30B-A3B shape at batch 64. Prints the top kernels by GPU time.
With --prefill: one engine step that prefills --rows prompts of --row-tokens each instead (default
an 8k-token chunk, 4 × 2,048), with its wall time beside its kernel time (the gap is host work).
Usage: python -m e2e.gpu profile decode [--layers 48] [--batch 64] [--ctx 2048] [--prefill]
           [--rows 4 --row-tokens 2048] [--experts-kernel auto] [--qk-prologue auto] --out profile.txt
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pdrollout.engine.protocol.config import ControlSettings, EngineConfig, load_preset
from pdrollout.engine.protocol.plan import Phase, RowSpec
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.scheduler.request import SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--out", default="profile.txt")
    ap.add_argument("--prefill", action="store_true")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--row-tokens", type=int, default=2048)
    ap.add_argument("--experts-kernel", default="auto")
    ap.add_argument("--qk-prologue", default="auto")
    ap.add_argument("--add-norm", default="auto")
    a = ap.parse_args()
    cfg = load_preset("qwen3-30b-a3b")
    cfg["num_hidden_layers"] = a.layers
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(cfg))
    e = Engine(EngineConfig(model=str(tmp), device="cuda", dtype="bfloat16", random_weights=True, mode="normal",
                            max_running=a.batch, kv_cache_bytes=40 << 30, cuda_graphs=False,
                            experts_kernel=a.experts_kernel, qk_prologue=a.qk_prologue, add_norm=a.add_norm,
                            control=ControlSettings(prefill_budget_tokens=a.rows * a.row_tokens)))
    g = torch.Generator().manual_seed(0)
    if a.prefill:
        return profile_prefill(e, cfg, g, a)
    for i in range(a.batch):
        e.submit(f"r{i}", torch.randint(2, cfg["vocab_size"], (a.ctx,), generator=g).tolist(),
                 SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    reqs = e.schedulers[0].reqs
    while any(r.status.value != "decode" for r in reqs.values()):
        e.step()
    e.step()      # one engine decode step: every row now holds the block its next position needs
    rows = [RowSpec(r.rid, Phase.DECODE, len(r.tokens) - 1, (r.tokens[-1],), tuple(r.reservation.blocks), True)
            for r in reqs.values()]
    w = e.worker
    for _ in range(2):                     # warm-up (Triton compile)
        w.model(w.batches.build(rows, Phase.DECODE), w.kv)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            w.model(w.batches.build(rows, Phase.DECODE), w.kv)
        torch.cuda.synchronize()
    avg = prof.key_averages()
    table = avg.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60)
    # Per forward: what the kernels add up to and how many there are; a graph replay slower than the
    # sum is paying per-kernel gaps, one at the sum is paying for the kernels themselves.
    kernels = [k for k in avg if k.self_device_time_total > 0]
    total_ms = sum(k.self_device_time_total for k in kernels) / 1e3 / 3
    launches = sum(k.count for k in kernels) / 3
    text = (f"3 eager decode forwards, batch {a.batch}, ctx {a.ctx}, {a.layers} layers (table totals are for all 3); "
            f"per forward: {total_ms:.3f} ms of kernel time in {launches:.0f} kernels\n" + table)
    Path(a.out).write_text(text)
    print(text)


def step_phases(e) -> str:
    """Where the step's wall goes beyond its kernels: host time before the forward, the forward on
    the GPU (CUDA events on its stream), the wait after it, and the step's finish (ms)."""
    w, marks = e.worker, {}
    model = w._model

    def timed_model(phase, batch):
        marks["in"] = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = model(phase, batch)
        end.record()
        marks["issued"], marks["events"], marks["batch"] = time.perf_counter(), (start, end), (phase, batch)
        return out
    w._model = timed_model
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        launched = e.launch()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        e.finish(launched)
        t2 = time.perf_counter()
    finally:
        w._model = model
    gpu = marks["events"][0].elapsed_time(marks["events"][1])
    # The same forward again on the step's own batch, outside the step: a forward slower inside the
    # step than here is slowed by its surroundings (the allocator, other threads), not by its batch.
    phase, batch = marks["batch"]
    walls, issues = [], []
    for _ in range(3):
        batch.prefill_plan = None
        torch.cuda.synchronize()
        s0 = time.perf_counter()
        model(phase, batch)
        s1 = time.perf_counter()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - s0)
        issues.append(s1 - s0)
    return (f"step phases (ms): before the forward {1e3 * (marks['in'] - t0):.1f}, forward issued in "
            f"{1e3 * (marks['issued'] - marks['in']):.1f}, forward on the GPU {gpu:.1f}, launch to synced "
            f"{1e3 * (t1 - t0):.1f}, finish {1e3 * (t2 - t1):.1f}; the step's batch again alone: issued in "
            f"{1e3 * sorted(issues)[1]:.1f}, wall {1e3 * sorted(walls)[1]:.1f}\n")


ALLOC_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def host_trace(e, out: Path) -> str:
    """One step under the CPU+CUDA profiler: the host calls that cost the most (a synchronizing
    call inside the forward shows here), the allocator's device calls during the step, and a
    Chrome trace beside the table."""
    before = torch.cuda.memory_stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        e.step()
        torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    prof.export_chrome_trace(str(out.with_suffix(".trace.json")))
    alloc = ", ".join(f"{k} +{after.get(k, 0) - before.get(k, 0)}" for k in ALLOC_KEYS)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)
    return f"the step's allocator calls: {alloc}\nhost time by call (one step, CPU+CUDA profiler):\n{table}"


def profile_prefill(e, cfg, g, a):
    """Six steps of the same shape: two compile and warm, one is timed, one is profiled, one is
    split into phases, the last is traced with the host's calls."""
    for i in range(6 * a.rows):
        e.submit(f"p{i}", torch.randint(2, cfg["vocab_size"], (a.row_tokens,), generator=g).tolist(),
                 SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    e.step(), e.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    e.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        e.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    total = sum(k.self_device_time_total for k in prof.key_averages()) / 1e3
    tokens = a.rows * a.row_tokens
    text = (f"one engine step prefilling {tokens:,} tokens ({a.rows} × {a.row_tokens:,}), {a.layers} layers, "
            f"experts {e.worker.backends.name}: {wall:.1f} ms wall (unprofiled), {total:.1f} ms of kernel time\n"
            + step_phases(e) + table + "\n" + host_trace(e, Path(a.out)))
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
