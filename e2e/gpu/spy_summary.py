"""Where one thread's time went, from py-spy's folded stacks (`py-spy record --threads -f raw`, as
`bench_seeds.py --py-spy` writes them): the samples whose stack passes through a frame matching
--match (default `_epoch`: pd's P epoch on its thread, runtime/solo_p.py), then
  * inclusive share per frame of our code (engine/, operator/): which layer or op issues the most,
  * self share per leaf frame (Python or native: a CUDA launch, a GIL wait, the allocator),
  * self share per leaf's library (the part of a native frame name after ' (' or the file).
Usage: python -m e2e.gpu profile spy pyspy.txt [--match _epoch] [--top 25] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

OURS = re.compile(r"pdrollout/(engine|operator)/|/(engine|operator)/[a-z_]+/?[a-z_]*\.py")


def parse(lines) -> list[tuple[list[str], int]]:
    """Folded stacks: 'root;...;leaf COUNT' per line, root first."""
    stacks = []
    for n, line in enumerate(lines, 1):
        line = line.rstrip("\n")
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            raise ValueError(f"line {n}: not 'frame;frame;... COUNT': {line[:120]!r}")
        stacks.append((stack.split(";"), int(count)))
    return stacks


def library(frame: str) -> str:
    """'func (file.py:12)' -> 'file.py'; 'cuLaunchKernel (libcuda.so.1)' -> 'libcuda.so.1'."""
    m = re.search(r"\(([^()]*)\)\s*$", frame)
    if not m:
        return frame
    where = m.group(1).rsplit(":", 1)[0]
    return where.rsplit("/", 1)[-1]


def summarize(stacks, match: str, top: int) -> dict:
    mine = [(frames, c) for frames, c in stacks if any(match in f for f in frames)]
    total = sum(c for _, c in mine)
    if not total:
        raise ValueError(f"no sampled stack passes through a frame matching {match!r} "
                         f"({sum(c for _, c in stacks)} samples in all)")
    inclusive, leaves, libs = Counter(), Counter(), Counter()
    for frames, c in mine:
        for f in dict.fromkeys(f for f in frames if OURS.search(f)):   # once per stack (recursion)
            inclusive[f] += c
        leaves[frames[-1]] += c
        libs[library(frames[-1])] += c

    def share(counter):
        return [{"frame": f, "share": c / total, "samples": c} for f, c in counter.most_common(top)]
    return {"match": match, "samples": total, "ours_inclusive": share(inclusive), "leaf_self": share(leaves),
            "library_self": share(libs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folded")
    ap.add_argument("--match", default="_epoch")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json")
    a = ap.parse_args()
    try:
        s = summarize(parse(Path(a.folded).read_text().splitlines()), a.match, a.top)
    except ValueError as e:
        print(f"spy_summary: {e}", file=sys.stderr)
        return 2
    if a.json:
        Path(a.json).write_text(json.dumps(s, indent=1))
    print(f"{s['samples']} samples through {a.match!r}")
    for key, title in (("ours_inclusive", "our frames, inclusive"), ("leaf_self", "leaf frames, self"),
                       ("library_self", "leaf libraries, self")):
        print(f"\n{title}:")
        for r in s[key]:
            print(f"{100 * r['share']:6.1f} %  {r['frame'][:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
