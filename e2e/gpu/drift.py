"""Does the same decode step run at one speed for minutes? One graph replayed back to back, the
GPU's temperatures, power and clocks sampled beside it.

Identical servers running identical work (the same greedy tokens, same_tokens.py) end up to a few per
cent apart, and their D steps' GPU time differs by as much; the SM clock sat at its maximum through
those runs (docs/perf/HISTORY.md, eighteenth to twenty-first sessions). What else moves a bandwidth-bound
kernel's speed over tens of seconds: the memory's temperature (DRAM refreshes more often when hot),
power capping below nvidia-smi's clock readings. This replays the `batch`-row decode graph at `ctx`
in chunks for `hot` seconds, rests `rest` seconds, replays again for `again` seconds, and samples
`nvidia-smi` every `sample_ms` (GPU and memory temperature, power, SM and memory clocks, throttle
reasons). Per second: the replay's median ms beside each sample's median; then the correlation of
replay time with each.

    python -m e2e.gpu bench drift OUT.json [--batch 64] [--ctx 2048] [--hot 150] [--rest 30] [--again 40]
    DEVICE=cpu python -m e2e.gpu bench drift OUT.json     # the tiny preset on the CPU (engine steps): a dry run
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from .fused_step import build
from .harness import parser

FIELDS = ("temperature.gpu", "temperature.memory", "power.draw", "clocks.sm", "clocks.mem",
          "clocks_throttle_reasons.active")


def sampler(path: Path, every_ms: int):
    if shutil.which("nvidia-smi") is None:
        return None
    return subprocess.Popen(["nvidia-smi", f"--query-gpu=timestamp,{','.join(FIELDS)}", "--format=csv,noheader,nounits",
                             f"--loop-ms={every_ms}"], stdout=path.open("w"), stderr=subprocess.DEVNULL)


def read_samples(path: Path, t0_wall: float) -> list[dict]:
    """nvidia-smi's rows as {t (s since t0), field: float | None}."""
    out = []
    if not path.exists():
        return out
    for row in csv.reader(path.open()):
        if len(row) != 1 + len(FIELDS):
            continue
        try:
            t = time.mktime(time.strptime(row[0].strip().split(".")[0], "%Y/%m/%d %H:%M:%S")) + \
                float("0." + row[0].strip().split(".")[1]) - t0_wall
        except (ValueError, IndexError):
            continue
        vals = {}
        for name, v in zip(FIELDS, row[1:]):
            v = v.strip()
            try:
                vals[name] = float(int(v, 16)) if v.startswith("0x") else float(v)
            except ValueError:
                vals[name] = None     # "[N/A]": not reported on this GPU
        out.append({"t": t, **vals})
    return out


def main() -> None:
    ap = parser(batch=64, ctx=2048)
    ap.add_argument("--hot", type=float, default=150.0, help="seconds of replays before the rest")
    ap.add_argument("--rest", type=float, default=30.0, help="seconds of an idle GPU between the two stretches")
    ap.add_argument("--again", type=float, default=40.0, help="seconds of replays after the rest")
    ap.add_argument("--chunk", type=int, default=10, help="replays timed together")
    ap.add_argument("--sample-ms", type=int, default=100)
    a = ap.parse_args()
    cpu = os.environ.get("DEVICE") == "cpu"
    if cpu:
        a.batch, a.ctx, a.hot, a.rest, a.again, a.chunk = 2, 32, 1.0, 0.2, 0.5, 1
    e, _ = build(cpu, a.batch, a.ctx, steps=2000 if cpu else 64)   # steps: tokens a row may take
    for _ in range(3):   # D rows decoding: the graph's inputs hold a real step
        e.step()
    graphs = e.worker.graphs
    if graphs is not None:
        graph = graphs.graphs[graphs.bucket(a.batch)][0]
        run_chunk = lambda: [graph.replay() for _ in range(a.chunk)]
    else:                # the CPU: engine steps stand in
        run_chunk = lambda: [e.step() for _ in range(a.chunk)]
    samples_path = Path(a.out).with_suffix(".smi.csv")
    proc = sampler(samples_path, a.sample_ms)
    t0, t0_wall = time.perf_counter(), time.time()
    chunks = []   # (s since t0, ms a replay, stretch)

    def stretch(name: str, seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            if graphs is not None:
                s, f = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                run_chunk()
                f.record()
                f.synchronize()
                ms = s.elapsed_time(f) / a.chunk
            else:
                c = time.perf_counter()
                run_chunk()
                ms = (time.perf_counter() - c) * 1e3 / a.chunk
            chunks.append((time.perf_counter() - t0, ms, name))

    stretch("hot", a.hot)
    time.sleep(a.rest)
    stretch("again", a.again)
    if proc is not None:
        proc.terminate()
        proc.wait()
    samples = read_samples(samples_path, t0_wall)
    # per whole second: the replays' median and each field's median
    by_s: dict[int, dict] = defaultdict(lambda: {"ms": [], **{f: [] for f in FIELDS}})
    for t, ms, _ in chunks:
        by_s[int(t)]["ms"].append(ms)
    for smp in samples:
        for f in FIELDS:
            if smp[f] is not None:
                by_s[int(smp["t"])][f].append(smp[f])
    seconds = []
    for s in sorted(by_s):
        row = {"s": s, **{k: (statistics.median(v) if v else None) for k, v in by_s[s].items()}}
        seconds.append(row)
    busy = [r for r in seconds if r["ms"] is not None]
    corr = {}
    for f in FIELDS:
        pairs = [(r["ms"], r[f]) for r in busy if r[f] is not None]
        if len(pairs) >= 5 and np.std([p[1] for p in pairs]) > 0:
            corr[f] = float(np.corrcoef(np.array(pairs).T)[0, 1])
    ms = [c[1] for c in chunks]
    per_stretch = {name: statistics.median([c[1] for c in chunks if c[2] == name]) for name in ("hot", "again")
                   if any(c[2] == name for c in chunks)}
    windows = [statistics.median(r["ms"] for r in busy[i:i + 10]) for i in range(0, len(busy), 10)]
    res = {"meta": {"commit": os.environ.get("COMMIT", ""), "machine": os.environ.get("MACHINE", ""),
                    "gpu": "cpu" if cpu else torch.cuda.get_device_name(), "nproc": 1, "topology": "EP1/ADP1",
                    "batch": a.batch, "ctx": a.ctx, "hot_s": a.hot, "rest_s": a.rest, "again_s": a.again,
                    "chunk": a.chunk, "sample_ms": a.sample_ms, "samples": len(samples)},
           "replay_ms": {"median": statistics.median(ms), "p10": float(np.percentile(ms, 10)),
                         "p90": float(np.percentile(ms, 90)), "min": min(ms), "max": max(ms)},
           "stretch_median_ms": per_stretch,
           "ten_second_windows_ms": windows,
           "ten_second_windows_max_over_min": max(windows) / min(windows),
           "correlation_with_replay_ms": corr, "seconds": seconds}
    e.shutdown()
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "seconds"}, indent=1))


if __name__ == "__main__":
    main()
