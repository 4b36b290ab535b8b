"""Two step logs of the same trace, step by step: do they run the same steps, and where do their
times part?

Identical servers (same code, config, seed; same greedy tokens: same_tokens.py) end a P1 run up to a
few per cent apart, though a D graph replayed alone runs at one speed across processes and minutes
(drift.py). This lines two runs' steps up in order and says, per run: how many steps carry the same
rows (`decode_set`: request ids, so only within one run's naming) and attend the same keys
(`decode_ctx_tokens`), and the D-only steps' GPU time (`d_gpu_s`) B against A over the steps that
attend the same keys and over those that do not; the walls of the steps that carry P and of D's.
Usage: python -m e2e.gpu report step-pairs A B [--json OUT]   (step-log directories or files; gzip read)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .step_costs import d_only, read, runs


def ratio(pairs: list[tuple[dict, dict]], key: str) -> float | None:
    a = sum(x[key] for x, _ in pairs)
    return sum(y[key] for _, y in pairs) / a if pairs and a else None


def compare(a: list[dict], b: list[dict]) -> dict:
    pairs = list(zip(a, b))
    shape = [(x, y) for x, y in pairs if (x["decode_rows"], x["prefill_tokens"]) == (y["decode_rows"], y["prefill_tokens"])]
    d = [(x, y) for x, y in shape if d_only(x) and d_only(y) and x["decode_rows"]
         and x.get("d_gpu_s") is not None and y.get("d_gpu_s") is not None]
    logged = "decode_set" in a[0] and "decode_set" in b[0]   # logs before the twenty-first session lack it
    # matched by the keys attended: decode_set digests request ids, and the bench names its
    # requests after a rollout id of each run's own, so sets never match across two runs of it
    same = [(x, y) for x, y in d if logged and x["decode_ctx_tokens"] == y["decode_ctx_tokens"]]
    other = [p for p in d if p not in same]
    return {"steps_a": len(a), "steps_b": len(b), "same_shape": len(shape),
            "same_rows": sum(x["decode_set"] == y["decode_set"] for x, y in shape if x["decode_rows"]) if logged else None,
            "same_ctx": sum(x["decode_ctx_tokens"] == y["decode_ctx_tokens"] for x, y in shape if x["decode_rows"])
            if logged else None,
            "d_timed": len(d), "d_same": len(same), "wall_b_over_a": ratio(pairs, "wall_s"),
            # the walls of the steps that carry P (eager or P's pieces: the host issues them) and of D's
            "p_wall_b_over_a": ratio([(x, y) for x, y in shape if x["prefill_tokens"]], "wall_s"),
            "d_wall_b_over_a": ratio([(x, y) for x, y in shape if not x["prefill_tokens"]], "wall_s"),
            "d_gpu_b_over_a_same": ratio(same, "d_gpu_s"), "d_gpu_b_over_a_other": ratio(other, "d_gpu_s"),
            "d_ctx_b_over_a_other": ratio(other, "decode_ctx_tokens") if logged else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ra, rb = runs(read(Path(args.a))), runs(read(Path(args.b)))
    if not ra or len(ra) != len(rb):
        print(f"runs: {len(ra)} in A, {len(rb)} in B: nothing to line up", file=sys.stderr)
        return 2
    out = [{"run": i, **compare(x, y)} for i, (x, y) in enumerate(zip(ra, rb))]
    fmt = lambda v: "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)
    keys = list(out[0])
    print("  ".join(keys))
    for r in out:
        print("  ".join(fmt(r[k]) for k in keys))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
