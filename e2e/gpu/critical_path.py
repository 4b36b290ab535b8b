"""What a run's makespan is made of, from a bench's per-request records (records-<mode>.jsonl).

The makespan ends with the last session to finish. Its turns run back to back (a turn is released
when the previous one ends, after the trace's tool time): the makespan is that session's start, its
turns' waits for a first token, its decode time and its tool gaps. This prints them per run, and its
decode time per generated token beside the run's other sessions' (what D's steps cost the critical
session, P's interference included). `floor s` is where an engine that took no time at all would
end the run: the latest session's start plus its tool gaps (both the trace's: a turn is released
its tool time after the last one ended); `floor` is that over the run's end, a bound no planner
or kernel can beat.
Usage: python -m e2e.gpu report critical-path DIR...   (any directory holding records-*.jsonl, searched down)
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from .ttft_epochs import record_runs


def sessions(records: list[dict]) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by[r["session_id"]].append(r)
    return {s: sorted(rs, key=lambda r: r["turn"]) for s, rs in by.items()}


def path_of(turns: list[dict]) -> dict:
    """One session's time split: start, first-token waits, decode, gaps between turns (s)."""
    decode = sum(r["done_s"] - r["first_token_s"] for r in turns)
    tokens = sum(r["completion_tokens"] for r in turns)
    return {"end_s": turns[-1]["done_s"], "start_s": turns[0]["release_s"], "turns": len(turns),
            "ttft_s": sum(r["first_token_s"] - r["release_s"] for r in turns), "decode_s": decode,
            "gaps_s": sum(b["release_s"] - a["done_s"] for a, b in zip(turns, turns[1:])),
            "tokens": tokens, "ms_per_token": 1e3 * decode / max(tokens, 1)}


def summary(records: list[dict]) -> dict:
    """The critical (last-ending) session's path, and the others' median decode ms per token."""
    paths = {s: path_of(rs) for s, rs in sessions(records).items()}
    last = max(paths, key=lambda s: paths[s]["end_s"])
    others = [p["ms_per_token"] for s, p in paths.items() if s != last and p["tokens"]]
    floor = max(p["start_s"] + p["gaps_s"] for p in paths.values())
    return {"session": last, **paths[last],
            "others_ms_per_token": statistics.median(others) if others else float("nan"),
            "floor_s": floor, "floor_share": floor / paths[last]["end_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+")
    a = ap.parse_args()
    print(f"{'run':<34}{'session':>11}{'end s':>7}{'turns':>6}{'TTFT s':>8}{'decode s':>9}{'gaps s':>7}"
          f"{'tokens':>7}{'ms/tok':>7}{'others':>7}{'floor s':>8}{'floor':>7}")
    for name, records in record_runs(a.dirs):
        s = summary(records)
        print(f"{name:<34}{s['session']:>11}{s['end_s']:>7.2f}{s['turns']:>6}{s['ttft_s']:>8.2f}{s['decode_s']:>9.2f}"
              f"{s['gaps_s']:>7.2f}{s['tokens']:>7}{s['ms_per_token']:>7.1f}{s['others_ms_per_token']:>7.1f}"
              f"{s['floor_s']:>8.2f}{s['floor_share']:>7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
