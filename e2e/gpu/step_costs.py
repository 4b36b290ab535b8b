"""What a run's steps cost by kind, from a server's step log (`--step-log`; bench_seeds.py --step-logs).

Each step is D only, P only, or P and D (fused into one forward, or the step that starts a P epoch
beside D), or D beside an epoch in flight; steps that carry P are binned by their P tokens. Per bin:
steps, median wall ms, median decode rows, and their total seconds: where a mode's time goes; then
the steps that compiled a Triton kernel (the log's `jit_compiles`), each a stall.
    python3 e2e/gpu/step_costs.py STEPLOG...   (rank0.jsonl or rank0.jsonl.gz; a directory: its rank0 log)
"""
from __future__ import annotations

import gzip
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

P_BINS = (128, 256, 512, 1024, 4096)


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


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for arg in argv:
        steps = read(Path(arg))
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
