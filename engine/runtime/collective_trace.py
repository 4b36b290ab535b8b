"""Cross-rank trace of collective enqueues and the same-order checker (docs/DISTRIBUTED.md).

Per rank, time-ordered records (epoch, boundary, phase, collective, group, lane, enqueue time).
The checker takes every rank's records and verifies that any two registered collectives that
two ranks both enqueued appear in the same order on both: the condition under which crossed
P/D orders cannot close a cycle.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class Trace:
    rank: int
    records: list[dict] = field(default_factory=list)

    def record(self, *, epoch: int | None, boundary: int | None, phase: str, collective: str,
               group: Iterable[int] = (), lane: str = "", key: str | None = None,
               registered: bool = True) -> dict:
        """`key` names the logical collective across ranks (e.g. 'D:12' or 'P:3:5'); the default
        is derived from phase, epoch and boundary."""
        rec = {"rank": self.rank, "t_ns": time.monotonic_ns(), "epoch": epoch, "boundary": boundary,
               "phase": phase, "collective": collective, "group": list(group), "lane": lane,
               "key": key or f"{phase}:{epoch}:{boundary}:{collective}", "registered": registered}
        self.records.append(rec)
        return rec

    def write_jsonl(self, path: str) -> None:
        with open(path, "w") as f:
            for r in self.records:
                f.write(json.dumps(r) + "\n")


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def check_order(traces: dict[int, list[dict]]) -> list[str]:
    """Violations (empty when consistent): for every pair of ranks, the registered collectives
    both enqueued must appear in the same relative order."""
    seqs = {}
    for rank, recs in traces.items():
        recs = sorted((r for r in recs if r.get("registered", True)), key=lambda r: r["t_ns"])
        keys = [r["key"] for r in recs]
        if len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})[:3]
            return [f"rank {rank} enqueued collective keys more than once: {dup}"]
        seqs[rank] = keys
    out = []
    ranks = sorted(seqs)
    for i, a in enumerate(ranks):
        for b in ranks[i + 1:]:
            common = set(seqs[a]) & set(seqs[b])
            sa = [k for k in seqs[a] if k in common]
            sb = [k for k in seqs[b] if k in common]
            if sa != sb:
                j = next(n for n, (x, y) in enumerate(zip(sa, sb)) if x != y)
                out.append(f"ranks {a} and {b} disagree at position {j}: "
                           f"rank {a} enqueued {sa[j]} where rank {b} enqueued {sb[j]}")
    return out
