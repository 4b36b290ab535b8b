"""Measures of a replay against a fleet (engines behind sglang-router, docs/SERVER.md): per engine that
answered (meta_info.served_by) its share, makespan and TTFT, and how often a session's continuation
turns found their prefix in the cache of the engine they landed on."""
from __future__ import annotations

import numpy as np


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def _first_turns(records) -> dict[str, int]:
    first: dict[str, int] = {}
    for r in records:
        first[r.session_id] = min(first.get(r.session_id, r.turn), r.turn)
    return first


def continuation_hits(records, first: dict[str, int] | None = None) -> dict:
    """Continuation turns (every turn after its session's first, over the whole run: `first`): the
    share with cached_tokens > 0, and cached over prompt tokens. A sticky route keeps both high; a
    scattered one loses the prefix."""
    first = first or _first_turns(records)
    cont = [r for r in records if r.turn > first[r.session_id]]
    prompt = sum(r.prompt_tokens for r in cont)
    return {"continuation_turns": len(cont),
            "continuation_cached_share": sum(r.cached_tokens > 0 for r in cont) / len(cont) if cont else None,
            "continuation_cached_ratio": sum(r.cached_tokens for r in cont) / prompt if prompt else None}


def group_measures(records) -> dict[str, dict]:
    """Per engine that answered: requests, its makespan (first release to last completion of its own
    requests) and TTFT. Records without served_by (an older server) fall in one group, "unknown"."""
    groups: dict[str, list] = {}
    first = _first_turns(records)
    for r in records:
        groups.setdefault(r.served_by or "unknown", []).append(r)
    out = {}
    for name, rs in sorted(groups.items()):
        ttft = [1000 * (r.first_token_s - r.release_s) for r in rs if r.first_token_s is not None]
        out[name] = {"requests": len(rs), "makespan_s": max(r.done_s for r in rs) - min(r.release_s for r in rs),
                     "median_ttft_ms": _pct(ttft, 50), "p99_ttft_ms": _pct(ttft, 99),
                     **continuation_hits(rs, first)}
    return out


def fleet_measures(records) -> dict:
    groups = group_measures(records)
    return {**continuation_hits(records), "engines": len(groups), "groups": groups}


def format_groups(summary: dict) -> str:
    """One line per engine of the run (the fleet's own line is the main table)."""
    lines = [f"{'engine':<28}{'requests':>9}{'makespan s':>12}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}"
             f"{'cont. cached':>17}"]
    cell = lambda v, fmt: "-" if v is None else fmt.format(v)
    for name, g in summary.get("groups", {}).items():
        lines.append(f"{name:<28}{g['requests']:>9}{g['makespan_s']:>12.2f}{cell(g['median_ttft_ms'], '{:.1f}'):>13}"
                     f"{cell(g['p99_ttft_ms'], '{:.1f}'):>13}{cell(g['continuation_cached_share'], '{:.3f}'):>17}")
    return "\n".join(lines)
