"""What a run's steps cost by kind, from a server's step log (`--step-log`; bench_seeds.py --step-logs).

Each step is D only, P only, or P and D (fused into one forward, or the step that starts a P epoch
beside D), or D beside an epoch in flight; steps that carry P are binned by their P tokens. Per bin:
steps, median wall ms, median decode rows, and their total seconds: where a mode's time goes; then
the steps that compiled a Triton kernel (the log's `jit_compiles`), each a stall.

With --bound, per run in the log (a server reused over seeds logs one run per seed, in order): what
P cost the run beyond its D steps, and so how far any P/D planner could move this run's makespan.
D rows are priced by a line fitted to the log's D-only steps (a + b * rows); P's cost is every
other step's wall beyond that price (a P-only step's whole wall, a fused step's excess, a D step's
excess beside an epoch in flight). A planner that ran the same P at the log's large-batch rate (the
median us/token of its steps of >= BULK_TOKENS P tokens and at most 2 D rows) with no one waiting ends at `bound_floor` of
this run; with P free, at `bound_free`. At P1 the critical session decodes through nearly the whole
run, so these bound pd against the mode that made the log.
With --d-speed A B, per run of two logs of the same seeds: the median over row counts of A's D-only
graph steps' median wall over B's at the same row count. The replay is the same kernels in every
mode, so this is the two servers' speed on identical work, the yardstick for a makespan ratio. Logs
that time the replay on the GPU (`d_gpu_s`, CUDA events) split it: the GPU's ratio, and each side's
host ms a step (wall less GPU time, median over the same row counts), so a difference in speed is
placed on the device or on the host.
    python -m e2e.gpu report step-costs [--bound [--json OUT]] STEPLOG...   (rank0.jsonl[.gz]; a directory: its rank0 log)
    python -m e2e.gpu report step-costs --d-speed STEPLOG_A STEPLOG_B
"""
from __future__ import annotations

import gzip
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

P_BINS = (128, 256, 512, 1024, 4096)
BULK_TOKENS = 4096      # P-only steps this large run near the prefill kernels' best rate
RUN_START_TOKENS = 8192  # a run starts with its burst of first turns: this much P within 3 steps of an idle P step


def read(path: Path) -> list[dict]:
    if path.is_dir():
        path = next(p for p in (path / "rank0.jsonl", path / "rank0.jsonl.gz") if p.exists())
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def kind(step: dict) -> str:
    d, p = step["decode_rows"], step["prefill_tokens"]
    name = "D" if not p else "P" if not d else "P+D"
    if step.get("p_flight") is not None:
        name += " beside P"
    elif step.get("p_pending"):
        name += " (epoch)"
    return name


def p_bin(tokens: int) -> int:
    """The bin's index: 0 no P, then one per P_BINS bound, the last past them all."""
    if not tokens:
        return 0
    return next((i + 1 for i, b in enumerate(P_BINS) if tokens <= b), len(P_BINS) + 1)


def bin_name(i: int) -> str:
    return "-" if i == 0 else f"<={P_BINS[i - 1]}" if i <= len(P_BINS) else f">{P_BINS[-1]}"


def costs(steps: list[dict]) -> list[dict]:
    """One row per (kind, P bin), step 0 (the warm-up) left out."""
    bins: dict = defaultdict(list)
    for s in steps:
        if s["step"] > 0:
            bins[(kind(s), p_bin(s["prefill_tokens"]))].append(s)
    rows = []
    for (k, b), ss in sorted(bins.items()):
        walls = [s["wall_s"] * 1e3 for s in ss]
        rows.append({"kind": k, "p_tokens": bin_name(b), "steps": len(ss), "wall_ms": statistics.median(walls),
                     "decode_rows": statistics.median(s["decode_rows"] for s in ss), "total_s": sum(walls) / 1e3})
    return rows


def compiled(steps: list[dict]) -> list[dict] | None:
    """The steps that compiled kernels, with their wall and kernel names; None for a log from before
    the field existed."""
    if not any("jit_compiles" in s for s in steps):
        return None
    return [{"step": s["step"], "wall_ms": s["wall_s"] * 1e3, "prefill_tokens": s["prefill_tokens"],
             "decode_rows": s["decode_rows"], "kernels": s["jit_compiles"]} for s in steps if s.get("jit_compiles")]


def runs(steps: list[dict]) -> list[list[dict]]:
    """The log cut into runs: the warm-up (step 0) dropped; a run starts at a step with no D rows
    that begins a burst (RUN_START_TOKENS of P in it and the next two steps; the first request of a
    burst often runs alone, and the rest right after it belong to the same run)."""
    live = [s for s in steps if s["step"] > 0]
    opens = [s["decode_rows"] == 0 and s["prefill_tokens"] > 0
             and sum(x["prefill_tokens"] for x in live[i:i + 3]) >= RUN_START_TOKENS for i, s in enumerate(live)]
    starts = [i for i, o in enumerate(opens) if o and not (i and opens[i - 1])]
    return [live[a:b] for a, b in zip(starts, starts[1:] + [len(live)])]


def d_only(step: dict) -> bool:
    """A step of D rows alone: no P in it and no P epoch in flight beside it."""
    return not step["prefill_tokens"] and step.get("p_flight") is None


def d_line(steps: list[dict]) -> tuple[float, float]:
    """Least squares a + b * rows over the D-only steps, in seconds."""
    d = [(s["decode_rows"], s["wall_s"]) for s in steps if d_only(s)]
    if len(d) < 2:
        raise ValueError(f"{len(d)} D-only steps: too few to price a D row")
    n, sx, sy = len(d), sum(r for r, _ in d), sum(w for _, w in d)
    sxx, sxy = sum(r * r for r, _ in d), sum(r * w for r, w in d)
    b = (n * sxy - sx * sy) / (n * sxx - sx * sx) if n * sxx != sx * sx else 0.0
    return (sy - b * sx) / n, b


def d_price(step: dict, line: tuple[float, float]) -> float:
    """What the step's D rows would cost as a D-only step (nothing for a step without them)."""
    return line[0] + line[1] * step["decode_rows"] if step["decode_rows"] else 0.0


def bound(run: list[dict], line: tuple[float, float], bulk_s_per_token: float) -> dict:
    total = sum(s["wall_s"] for s in run)
    p_tokens = sum(s["prefill_tokens"] for s in run)
    p_cost = sum(s["wall_s"] - d_price(s, line) for s in run if s["prefill_tokens"] or s.get("p_flight") is not None)
    floor = p_tokens * bulk_s_per_token
    return {"steps": len(run), "total_s": total, "p_tokens": p_tokens, "p_cost_s": p_cost, "p_share": p_cost / total,
            "p_floor_s": floor, "bound_floor": (total - p_cost + floor) / total, "bound_free": (total - p_cost) / total}


def bounds(steps: list[dict]) -> list[dict]:
    live = [s for s in steps if s["step"] > 0]
    line = d_line(live)
    # `mixed` runs its bursts as chunks with a row or two of D riding along: priced out
    bulk = [(s["wall_s"] - d_price(s, line)) / s["prefill_tokens"]
            for s in live if s["decode_rows"] <= 2 and s["prefill_tokens"] >= BULK_TOKENS]
    if not bulk:
        raise ValueError(f"no step of >= {BULK_TOKENS} P tokens and <= 2 D rows to take P's large-batch rate from")
    rate = statistics.median(bulk)
    return [{"run": i, "d_ms": (line[0] * 1e3, line[1] * 1e3), "bulk_us_per_token": rate * 1e6, **bound(r, line, rate)}
            for i, r in enumerate(runs(live))]


def d_speed(a: list[dict], b: list[dict], min_steps: int = 5) -> list[dict]:
    """Per run (paired in order): A's D-only graph step wall over B's, the median over the row counts
    both ran at least `min_steps` times (each side's median wall at that count); where both logs timed
    the replay on the GPU, the same for that time (`gpu_ratio`) and each side's host ms (`host_ms_a`,
    `host_ms_b`: median over those counts of the median wall less GPU time), else None."""
    def by_rows(run):
        out: dict = defaultdict(list)
        for s in run:
            if d_only(s) and s.get("graph"):
                out[s["decode_rows"]].append((s["wall_s"], s.get("d_gpu_s")))
        return out
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    ra, rb = runs(a), runs(b)
    if len(ra) != len(rb):
        raise ValueError(f"the logs hold {len(ra)} and {len(rb)} runs: not the same seeds")
    rows = []
    for i, (x, y) in enumerate(zip(map(by_rows, ra), map(by_rows, rb))):
        common = [r for r in x if len(x[r]) >= min_steps and len(y.get(r, ())) >= min_steps]
        wall = lambda side, r: statistics.median(w for w, _ in side[r])
        row = {"run": i, "row_counts": len(common),
               "ratio": med([wall(x, r) / wall(y, r) for r in common]),
               "gpu_ratio": None, "host_ms_a": None, "host_ms_b": None}
        timed = lambda side, r: [(w, g) for w, g in side[r] if g is not None]
        both = [r for r in common if len(timed(x, r)) >= min_steps and len(timed(y, r)) >= min_steps]
        if both:
            gpu = lambda side, r: statistics.median(g for _, g in timed(side, r))
            host = lambda side, r: statistics.median(w - g for w, g in timed(side, r)) * 1e3
            row.update(gpu_ratio=med([gpu(x, r) / gpu(y, r) for r in both]),
                       host_ms_a=med([host(x, r) for r in both]), host_ms_b=med([host(y, r) for r in both]))
        rows.append(row)
    return rows


def main(argv: list[str]) -> int:
    cmd = " ".join(["python -m e2e.gpu report step-costs", *argv])
    if argv[:1] == ["--d-speed"]:
        if len(argv) != 3:
            print(__doc__, file=sys.stderr)
            return 2
        rows = d_speed(read(Path(argv[1])), read(Path(argv[2])))
        timed = any(r["gpu_ratio"] is not None for r in rows)
        print(f"{'run':>4}{'row counts':>12}{'D step A / B':>14}"
              + (f"{'GPU A / B':>11}{'host ms A':>11}{'host ms B':>11}" if timed else ""))
        for r in rows:
            extra = ""
            if timed:
                extra = "".join(f"{'-':>11}" if r[k] is None else f"{r[k]:>11.{3 if k == 'gpu_ratio' else 2}f}"
                                for k in ("gpu_ratio", "host_ms_a", "host_ms_b"))
            print(f"{r['run']:>4}{r['row_counts']:>12}{r['ratio']:>14.3f}{extra}")
        return 0
    want_bound = "--bound" in argv
    argv = [a for a in argv if a != "--bound"]
    out = None
    if "--json" in argv:
        i = argv.index("--json")
        out, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    if not argv or (out and not want_bound):
        print(__doc__, file=sys.stderr)
        return 2
    found = {}
    for arg in argv:
        steps = read(Path(arg))
        if want_bound:
            try:
                found[arg] = bounds(steps)
            except ValueError as e:   # e.g. a tiny dry run: no burst large enough to price P by
                print(f"{arg}: no bound: {e}")
                found[arg] = {"error": str(e)}
                continue
            print(f"{arg}\n{'run':>4}{'steps':>7}{'total s':>9}{'P tokens':>10}{'P cost s':>10}{'P share':>9}"
                  f"{'P floor s':>11}{'bound floor':>13}{'bound free':>12}")
            for r in found[arg]:
                print(f"{r['run']:>4}{r['steps']:>7}{r['total_s']:>9.2f}{r['p_tokens']:>10}{r['p_cost_s']:>10.2f}"
                      f"{r['p_share']:>9.3f}{r['p_floor_s']:>11.2f}{r['bound_floor']:>13.3f}{r['bound_free']:>12.3f}")
            print(f"  D step {r['d_ms'][0]:.2f} ms + {r['d_ms'][1]:.3f} ms/row; P at {r['bulk_us_per_token']:.1f} us/token "
                  f"in steps of >= {BULK_TOKENS} P tokens")
            continue
        rows = costs(steps)
        print(f"{arg}\n{'kind':>14}{'P tokens':>10}{'steps':>7}{'wall ms':>9}{'D rows':>8}{'total s':>9}")
        for r in rows:
            print(f"{r['kind']:>14}{r['p_tokens']:>10}{r['steps']:>7}{r['wall_ms']:>9.1f}{r['decode_rows']:>8.1f}"
                  f"{r['total_s']:>9.2f}")
        stalls = compiled(steps)
        if stalls is None:
            print("  (no jit_compiles in this log: written before the engine counted Triton compiles)")
        for c in stalls or ():
            print(f"  step {c['step']} compiled {', '.join(c['kernels'])}: {c['wall_ms']:.0f} ms "
                  f"({c['prefill_tokens']} P tokens, {c['decode_rows']} D rows)")
    if out:
        sources = {arg: source_meta(Path(arg)) for arg in found}
        for arg, rows in found.items():
            seeds = (sources[arg] or {}).get("seeds")
            if isinstance(rows, list) and seeds and len(seeds) == len(rows):
                for r, seed in zip(rows, seeds):
                    r["seed"] = seed
        meta = {"command": cmd, "what": "per run of each step log: P's cost beyond D and the makespan bounds; "
                "a run's seed where its log's bench meta.json names as many seeds as the log has runs",
                "bulk_tokens": BULK_TOKENS, "sources": sources}
        out.write_text(json.dumps({"meta": meta, "logs": found}, indent=1))
    return 0


def source_meta(log: Path) -> dict | None:
    """What the bench_seeds meta.json above a step log says of the run that wrote it: commit, machine,
    nproc, topology; and the seeds its server ran, in order: from the log's name (steps-<mode>-s0-1-2),
    or, for a log named before that (steps-<mode>[-b<N>]), from its block in the meta.json, which a
    later call on the same directory may have rewritten (then the log's run count will not match)."""
    at = log if log.is_dir() else log.parent
    meta_path = next((d / "meta.json" for d in (at, *at.parents) if (d / "meta.json").is_file()), None)
    meta = json.loads(meta_path.read_text()) if meta_path else {}
    named, block = re.search(r"-s(\d+(?:-\d+)*)$", at.name), re.search(r"-b(\d+)$", at.name)
    blocks = meta.get("blocks") or []
    if named:
        seeds = [int(x) for x in named.group(1).split("-")]
    elif block:   # steps-<mode>-b<N>: block N's seeds, if the meta.json has that block
        b = int(block.group(1))
        seeds = blocks[b]["seeds"] if b < len(blocks) else None
    else:         # steps-<mode>: block 0's, or the call's seeds from before blocks
        seeds = blocks[0]["seeds"] if blocks else meta.get("seeds")
    if meta_path is None and not named:
        return None
    return {"meta": str(meta_path) if meta_path else None, "seeds": seeds,
            **{k: meta.get(k) for k in ("commit", "machine", "nproc", "topology", "pressures")}}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
