"""Did two runs of one trace generate the same tokens? From bench records (records-<mode>.jsonl,
each request's `output_digest`).

Greedy decoding on random weights has near-flat logits: a token can flip with the batch its row
shares (another GEMM shape, another rounding), and a closed loop's batches differ from run to run. A
flipped token changes that session's later turns (their context holds it) and what its rows route
to, so two identical servers need not run the same work. For every pair of runs given, per session
and turn: whether the outputs are equal, and each session's first turn that differs.
Usage: python -m e2e.gpu report same-tokens DIR...   (directories holding records-*.jsonl, searched down)
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

from .ttft_epochs import record_runs


def compare(a: list[dict], b: list[dict]) -> dict:
    """Requests matched by (session, turn): how many outputs are equal, of the first turns, and
    each session's first differing turn (its turn count when none differs)."""
    da = {(r["session_id"], r["turn"]): r.get("output_digest") for r in a}
    db = {(r["session_id"], r["turn"]): r.get("output_digest") for r in b}
    keys = sorted(da.keys() & db.keys())
    if not keys or any(da[k] is None or db[k] is None for k in keys):
        raise SystemExit("records without output_digest (written before it was recorded): nothing to compare")
    first: dict[str, int] = {}
    for sid, turn in keys:
        if da[(sid, turn)] != db[(sid, turn)]:
            first[sid] = min(first.get(sid, turn), turn)
    turns = {sid: 1 + max(t for s, t in keys if s == sid) for sid, _ in keys}
    firsts = [first.get(sid, n) for sid, n in turns.items()]
    equal = sum(da[k] == db[k] for k in keys)
    zero = [k for k in keys if k[1] == 0]
    return {"requests": len(keys), "equal": equal, "first_turns_equal": sum(da[k] == db[k] for k in zero),
            "first_turns": len(zero), "sessions_all_equal": len(turns) - len(first), "sessions": len(turns),
            "median_first_differing_turn": statistics.median(firsts)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--json", default=None, help="write the comparisons here too")
    a = ap.parse_args()
    runs = list(record_runs(a.dirs))
    if len(runs) < 2:
        print(f"need two runs or more, found {len(runs)}", file=sys.stderr)
        return 2
    out = []
    for (na, ra), (nb, rb) in itertools.combinations(runs, 2):
        c = {"a": na, "b": nb, **compare(ra, rb)}
        out.append(c)
        print(f"{na} / {nb}: {c['equal']}/{c['requests']} outputs equal, first turns {c['first_turns_equal']}/"
              f"{c['first_turns']}, sessions all equal {c['sessions_all_equal']}/{c['sessions']}, "
              f"median first differing turn {c['median_first_differing_turn']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
