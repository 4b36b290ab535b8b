"""When first tokens arrive, per mode, from a bench's per-request records (records-<mode>.jsonl).

Under pd with its P epochs beside D, first tokens come in batches: every request whose P rode in one
epoch gets its token when the epoch ends. This groups first tokens that land within --window of each
other and prints, per run: the median TTFT, the batches' median spacing, requests and new (uncached)
prompt tokens per batch. Requests released in the first --skip seconds (the t=0 burst) are left out.
Usage: python -m e2e.gpu report ttft DIR...   (any directory holding records-*.jsonl, searched down)
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path


def batches(records: list[dict], window_s: float) -> list[tuple[float, int, int]]:
    """(time, requests, new prompt tokens) of each batch of first tokens."""
    out: list[list] = []
    for r in sorted(records, key=lambda r: r["first_token_s"]):
        new = r["prompt_tokens"] - (r["cached_tokens"] or 0)
        if out and r["first_token_s"] - out[-1][0] < window_s:
            out[-1][1] += 1
            out[-1][2] += new
        else:
            out.append([r["first_token_s"], 1, new])
    return [tuple(b) for b in out]


def summary(records: list[dict], window_s: float, skip_s: float) -> dict:
    late = [r for r in records if r["release_s"] >= skip_s and r["first_token_s"] is not None]
    bs = batches(late, window_s)
    gaps = [b[0] - a[0] for a, b in zip(bs, bs[1:])]
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    return {"requests": len(late), "median_ttft_ms": 1e3 * med([r["first_token_s"] - r["release_s"] for r in late]),
            "batches": len(bs), "median_gap_ms": 1e3 * med(gaps),
            "median_requests_per_batch": med([b[1] for b in bs]), "median_new_tokens_per_batch": med([b[2] for b in bs])}


def record_runs(dirs: list[str]):
    """(run name, its records) for every records-<mode>.jsonl under each of `dirs`, in path order
    (committed ones are gzipped: records-<mode>.jsonl.gz)."""
    for d in dirs:
        for f in sorted(p for p in Path(d).rglob("records-*") if p.name.endswith((".jsonl", ".jsonl.gz"))):
            mode = f.name.removeprefix("records-").removesuffix(".gz").removesuffix(".jsonl")
            with (gzip.open(f, "rt") if f.suffix == ".gz" else f.open()) as lines:
                yield str(f.parent.relative_to(d)) + "/" + mode, [json.loads(line) for line in lines]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--window", type=float, default=0.003, help="seconds: first tokens closer than this are one batch")
    ap.add_argument("--skip", type=float, default=1.0, help="leave out requests released before this (s)")
    a = ap.parse_args()
    print(f"{'run':<40}{'reqs':>6}{'p50 TTFT ms':>13}{'batches':>9}{'gap ms':>8}{'reqs/b':>8}{'tokens/b':>10}")
    for name, records in record_runs(a.dirs):
        s = summary(records, a.window, a.skip)
        print(f"{name:<40}{s['requests']:>6}{s['median_ttft_ms']:>13.0f}{s['batches']:>9}{s['median_gap_ms']:>8.0f}"
              f"{s['median_requests_per_batch']:>8.0f}{s['median_new_tokens_per_batch']:>10.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
