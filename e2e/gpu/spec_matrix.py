"""Issue 23's matrix from bench_seeds.py outputs: precision (BF16/FP8) × speculation (off/on) × mode,
each cell the median over seeds (min–max), with pd's ratios against `normal` and `mixed` of the
same variant and seed (the paper's P/D-vs-Normal delta under each precision and MTP setting) and
each variant against BF16 with speculation off in the same mode (what FP8 or MTP costs or gains).

    python -m e2e.gpu report spec-matrix OUT.json DIR [DIR ...]   # DIR: a bench_seeds.py OUT (any pressure)

A (variant, pressure, seed, mode) found in several DIRs is taken from the last one given: list the
calls in order and a re-run replaces the earlier run. A ratio needs both runs; a missing cell is "–".
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .bench_seeds import spread

MODES = ("normal", "mixed", "pd")


def runs(dirs: list[Path]) -> tuple[dict, list[dict]]:
    """(variant, pressure, seed, mode) -> its mode's results; and each DIR's meta (command, commit)."""
    found, metas = {}, []
    for d in dirs:
        meta = d / "meta.json"
        if meta.exists():
            m = json.loads(meta.read_text())
            metas.append({"dir": str(d), "command": m.get("command"), "commit": m.get("commit"),
                          **{k: m.get(k) for k in ("machine", "nproc", "topology", "preset", "model_preset")},
                          "invocations": [{"command": i.get("command"), "commit": i.get("commit")}
                                          for i in m.get("invocations", [])]})
        for res in sorted(d.glob("*/*-s*/*/results.json")):
            mode_dir = res.parent
            pressure, _, seed = mode_dir.parent.name.rpartition("-s")
            r = json.loads(res.read_text())["modes"].get(mode_dir.name)
            if r is not None:
                found[(mode_dir.parent.parent.name, pressure, int(seed), mode_dir.name)] = r
    return found, metas


def ratio(a: dict | None, b: dict | None, key: str = "makespan_s") -> float | None:
    return a[key] / b[key] if a and b and a.get(key) and b.get(key) else None


def matrix(found: dict, base: str) -> dict:
    variants = sorted({k[0] for k in found}, key=lambda v: (v != base, v))
    table = {}
    for pressure in sorted({k[1] for k in found}):
        seeds = sorted({k[2] for k in found if k[1] == pressure})
        rows = {}
        for v in variants:
            get = lambda mode, s, var=v: found.get((var, pressure, s, mode))
            ran = [get(m, s) for m in MODES for s in seeds if get(m, s)]
            if not ran:
                continue
            field = lambda key, ran=ran: next((r[key] for r in ran if r.get(key) is not None), None)
            row = {"weights": field("weights"), "speculative": field("speculative"),
                   "speculative_k": field("speculative_k") or 0}
            for mode in MODES:
                cell = [get(mode, s) for s in seeds]
                row[mode] = {"seeds": [s for s, c in zip(seeds, cell) if c],
                             "makespan_s": spread([c and c["makespan_s"] for c in cell]),
                             "p99_ttft_ms": spread([c and c["p99_ttft_ms"] for c in cell]),
                             "decode_step_ms": spread([c and c.get("mean_decode_step_ms") for c in cell]),
                             "accept_length": spread([c and c.get("spec_accept_length") for c in cell]),
                             "vs_base": spread([ratio(get(mode, s), found.get((base, pressure, s, mode)))
                                                for s in seeds])}
            row["pd_vs_normal"] = spread([ratio(get("pd", s), get("normal", s)) for s in seeds])
            row["pd_vs_mixed"] = spread([ratio(get("pd", s), get("mixed", s)) for s in seeds])
            row["p99_ttft_pd_vs_normal"] = spread([ratio(get("pd", s), get("normal", s), "p99_ttft_ms")
                                                   for s in seeds])
            rows[v] = row
        table[pressure] = rows
    return table


def markdown(table: dict) -> str:
    def cell(s, f=lambda x: f"{x:.3f}"):
        if s is None:
            return "–"
        n = "" if s["n"] >= 3 else f" [{s['n']} seed{'s' if s['n'] > 1 else ''}]"
        return f"{f(s['median'])} ({f(s['min'])}–{f(s['max'])}){n}"
    sec = lambda x: f"{x:.2f}"
    lines = []
    for pressure, rows in table.items():
        lines += [f"**{pressure}** (median over seeds (min–max); ratios per seed, then the median)", "",
                  "| variant | normal s | mixed s | pd s | pd / normal | pd / mixed | p99 TTFT pd / normal "
                  "| pd vs BF16 off pd | normal vs BF16 off normal | tokens per D row (pd) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for v, r in rows.items():
            lines.append(f"| {v} | {cell(r['normal']['makespan_s'], sec)} | {cell(r['mixed']['makespan_s'], sec)} | "
                         f"{cell(r['pd']['makespan_s'], sec)} | {cell(r['pd_vs_normal'])} | {cell(r['pd_vs_mixed'])} | "
                         f"{cell(r['p99_ttft_pd_vs_normal'])} | {cell(r['pd']['vs_base'])} | "
                         f"{cell(r['normal']['vs_base'])} | {cell(r['pd']['accept_length'])} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, dirs = Path(argv[0]), [Path(d) for d in argv[1:]]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        print(f"not a directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    found, metas = runs(dirs)
    if not found:
        print(f"no results.json under {', '.join(map(str, dirs))}", file=sys.stderr)
        return 1
    base = "base" if any(k[0] == "base" for k in found) else sorted(k[0] for k in found)[0]
    table = matrix(found, base)
    out.write_text(json.dumps({"meta": {"command": "python -m e2e.gpu report spec-matrix " + " ".join(argv),
                                        "baseline_variant": base, "calls": metas,
                                        "seeds": sorted({k[2] for k in found})},
                               "table": table}, indent=1))
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
