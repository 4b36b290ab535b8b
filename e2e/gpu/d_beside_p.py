"""What a P epoch's thread costs D's engine steps on one GPU, by GIL switch interval.

pd on one rank runs each P epoch on a thread of its own (runtime/solo_p.py). Its kernels compete
with D's for the GPU, and its Python (issuing them) competes with D's step loop for the GIL: each
time D's loop blocks in a synchronize it resumes only when P's thread reaches the switch interval
(e2e/gil_handoff.py, 5 ms by default). This separates the two. For each interval it times engine
decode steps (a batch at ctx tokens, graph replays) alone, then while a thread runs P forwards of
the P1 epoch shape (8 segments of 32 new tokens over 1,792 cached) back to back on a stream of its
own, eager and through P's piecewise graphs, and a thread that only spins in Python (the GIL and
nothing else). Against `alone`, `spin` is the host's share and `eager`/`graphed` host plus GPU.

    python -m e2e.gpu bench d-beside-p OUT.json [--intervals 5,0.5,0.2] [--steps 20] [--batch 64] [--ctx 2048]
    DEVICE=cpu python -m e2e.gpu bench d-beside-p OUT.json     # the tiny preset on the CPU: a dry run
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from .bench_engine import p_batch, p_runs
from .harness import parser
from pdrollout.engine.protocol.config import ControlSettings, EngineConfig, load_preset
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.scheduler.request import SamplingParams


def build(cpu: bool, batch: int, ctx: int, decode_steps: int) -> Engine:
    cfg = load_preset("tiny" if cpu else "qwen3-30b-a3b")
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(cfg))
    device = dict(device="cpu", dtype="float32", num_blocks=4096) if cpu else \
        dict(device="cuda", dtype="bfloat16", kv_cache_bytes=40 << 30)
    # pd, as the engine whose epochs this stands for: D on its stream at high priority (one rank)
    e = Engine(EngineConfig(model=str(tmp), random_weights=True, mode="pd", max_running=batch,
                            block_size=16, control=ControlSettings(prefill_budget_tokens=8192), **device))
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(2, cfg["vocab_size"], (ctx,), generator=g).tolist()
        e.submit(f"r{i}", ids, SamplingParams(max_new_tokens=decode_steps + 8, ignore_eos=True))
    while any(not r.output for r in e.schedulers[0].reqs.values()):
        e.step()
    for _ in range(3):
        e.step()
    return e


def sync(e) -> None:
    if e.worker.cuda:
        torch.cuda.synchronize(e.worker.device)


def timed_steps(e, steps: int) -> float:
    sync(e)
    t = time.perf_counter()
    for _ in range(steps):
        e.step()
    sync(e)
    return (time.perf_counter() - t) / steps * 1e3


def beside(e, steps: int, work) -> tuple[float, int]:
    """Engine steps' mean ms while a thread repeats `work` (None: spin in Python); its repeats."""
    w, stop, count = e.worker, threading.Event(), [0]

    def loop():
        if work is None:
            while not stop.is_set():
                for _ in range(1000):
                    pass
                count[0] += 1
            return
        if not w.cuda:
            while not stop.is_set():
                work()
                count[0] += 1
            return
        torch.cuda.set_device(w.device)
        s = w.streams.get("p") or torch.cuda.Stream(w.device)   # P's own stream, as an epoch's
        with torch.cuda.stream(s):
            while not stop.is_set():
                work()
                s.synchronize()   # as a P epoch ends (solo_p.py)
                count[0] += 1

    th = threading.Thread(target=loop, name="P")
    th.start()
    time.sleep(0.05)
    try:
        return timed_steps(e, steps), count[0]
    finally:
        stop.set()
        th.join()


def main() -> int:
    ap = parser(steps=20, batch=64, ctx=2048)
    ap.add_argument("--intervals", default="5,0.5,0.2")
    a = ap.parse_args()
    cpu = os.environ.get("DEVICE") == "cpu"
    batch, ctx, steps = (4, 64, min(a.steps, 3)) if cpu else (a.batch, a.ctx, a.steps)
    intervals = [float(x) for x in a.intervals.split(",")]
    e = build(cpu, batch, ctx, steps * (1 + 4 * len(intervals)))
    w = e.worker
    pb = p_batch(w, 2, 8, 32, torch.Generator().manual_seed(2)) if cpu else \
        p_batch(w, 8, 32, 1792, torch.Generator().manual_seed(2))

    def run(fn):
        def once():
            pb.prefill_plan = None   # a new batch's plan, as each epoch builds one
            fn()
        return once
    works = {"spin": None, **{k: run(fn) for k, fn in p_runs(w, pb).items()}}
    default = sys.getswitchinterval()
    rows = []
    try:
        for iv in intervals:
            sys.setswitchinterval(iv / 1e3)
            row = {"interval_ms": iv, "alone_step_ms": timed_steps(e, steps)}
            for name, work in works.items():
                row[f"{name}_step_ms"], row[f"{name}_repeats"] = beside(e, steps, work)
                row[f"{name}_over_alone"] = row[f"{name}_step_ms"] / row["alone_step_ms"]
            rows.append(row)
    finally:
        sys.setswitchinterval(default)
    meta = {"command": "python -m e2e.gpu bench d-beside-p " + " ".join(sys.argv[1:]),
            "commit": os.environ.get("COMMIT"), "machine": os.environ.get("MACHINE"),
            "device": "cpu" if cpu else torch.cuda.get_device_name(), "nproc": 1, "topology": "EP1/ADP1",
            "batch": batch, "ctx": ctx, "steps": steps, "p_tokens": pb.input_ids.shape[0],
            "p_graphs": "graphed" in works}
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    kinds = list(works)
    print(f"{'interval ms':>12}{'alone ms':>10}" + "".join(f"{k + ' ms':>12}{'×':>7}" for k in kinds))
    for r in rows:
        print(f"{r['interval_ms']:>12}{r['alone_step_ms']:>10.2f}" +
              "".join(f"{r[k + '_step_ms']:>12.2f}{r[k + '_over_alone']:>7.3f}" for k in kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
