"""Mode against mode over repeated servers: every (summary, variant, mode) of `bench_seeds.py`
summaries that ran the same configuration is one server of that mode; per seed and mode the median
over its servers stands for the mode, and the ratios are taken between those medians.

One server per mode decides nothing on one H200 below ~5 %: identical servers (same code, same seed,
same plan step for step) end up to 6.6 % apart at P1 (docs/PERF.md, "How to read these figures"). So each seed
also shows how far its identical servers spread (max / min per mode) and the range of pd / `mixed`
over every pair of servers, which is what a single-server table would have drawn from.

    python -m e2e.gpu report repeats [--json OUT.json] [--pressure P1] SUMMARY.json [SUMMARY.json ...]

Only variants with the base configuration pool (no `extra`, bf16, no MTP, no priority); others are
listed as left out.
"""
from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path

from .bench_seeds import spread  # noqa: E402   median, min, max, n

MODES = ("normal", "mixed", "pd")
BASE = {"extra": {}, "weights": "bf16", "mtp_layers": 0, "priority": "none"}


def servers(summaries: list[tuple[str, dict]], pressure: str) -> tuple[dict, list[str]]:
    """{mode: [(server name, {seed: per-seed results})]} over the summaries' base-config variants,
    and the names left out."""
    out: dict = {m: [] for m in MODES}
    left = []
    for src, s in summaries:
        plain = {v["name"] for v in s["meta"]["variants"]
                 if all(v.get(k, d) == d for k, d in BASE.items())}
        for name, row in s["table"].get(pressure, {}).items():
            variant, mode = name.split("/")
            if variant in plain and mode in out:
                out[mode].append((f"{src}:{name}", {int(k): v for k, v in row["per_seed"].items()}))
            else:
                left.append(f"{src}:{name}")
    return out, left


def table(by_mode: dict) -> dict:
    """Per seed present in every mode: servers per mode, median makespan and p99 TTFT per mode, the
    identical servers' spread, and the ratios between the modes' medians; then the median (min–max)
    over seeds of each ratio."""
    seed_sets = [set.union(set(), *(set(per) for _, per in by_mode[m])) for m in MODES]
    if not all(seed_sets):
        missing = [m for m, s in zip(MODES, seed_sets) if not s]
        raise ValueError(f"no server of {', '.join(missing)}: every mode needs at least one")
    seeds = sorted(set.intersection(*seed_sets))
    rows = []
    for seed in seeds:
        mk = {m: [per[seed]["makespan_s"] for _, per in by_mode[m] if seed in per] for m in MODES}
        p99 = {m: [per[seed]["p99_ttft_ms"] for _, per in by_mode[m] if seed in per] for m in MODES}
        med = {m: statistics.median(v) for m, v in mk.items()}
        pairs = [p / x for p, x in itertools.product(mk["pd"], mk["mixed"])]
        rows.append({
            "seed": seed, "servers": {m: len(v) for m, v in mk.items()},
            "makespan_s": med, "p99_ttft_ms": {m: statistics.median(v) for m, v in p99.items()},
            "server_spread": {m: max(v) / min(v) for m, v in mk.items()},
            "pd_vs_normal": med["pd"] / med["normal"], "pd_vs_mixed": med["pd"] / med["mixed"],
            "mixed_vs_normal": med["mixed"] / med["normal"],
            "pd_vs_mixed_pairs": {"min": min(pairs), "max": max(pairs)},
            "p99_ttft_pd_vs_normal": statistics.median(p99["pd"]) / statistics.median(p99["normal"]),
        })
    over = {k: spread([r[k] for r in rows]) for k in
            ("pd_vs_normal", "pd_vs_mixed", "mixed_vs_normal", "p99_ttft_pd_vs_normal")}
    over["server_spread"] = {m: spread([r["server_spread"][m] for r in rows]) for m in MODES}
    return {"seeds": seeds, "per_seed": rows, "over_seeds": over}


def render(t: dict) -> str:
    lines = ["| seed | servers n/m/pd | normal s | mixed s | pd s | identical servers max/min n, m, pd | "
             "pd / normal | pd / mixed | pd / mixed, any pair | p99 TTFT pd / normal |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in t["per_seed"]:
        n, mk, sp = r["servers"], r["makespan_s"], r["server_spread"]
        lines.append(
            f"| {r['seed']} | {n['normal']}/{n['mixed']}/{n['pd']} | {mk['normal']:.2f} | {mk['mixed']:.2f} | "
            f"{mk['pd']:.2f} | {sp['normal']:.3f}, {sp['mixed']:.3f}, {sp['pd']:.3f} | {r['pd_vs_normal']:.3f} | "
            f"{r['pd_vs_mixed']:.3f} | {r['pd_vs_mixed_pairs']['min']:.3f}–{r['pd_vs_mixed_pairs']['max']:.3f} | "
            f"{r['p99_ttft_pd_vs_normal']:.3f} |")
    o = t["over_seeds"]
    c = lambda s: f"**{s['median']:.3f}** ({s['min']:.3f}–{s['max']:.3f})"
    sp = o["server_spread"]
    lines.append(f"| median (min–max) | | | | | {sp['normal']['median']:.3f}, {sp['mixed']['median']:.3f}, "
                 f"{sp['pd']['median']:.3f} | {c(o['pd_vs_normal'])} | {c(o['pd_vs_mixed'])} | | "
                 f"{c(o['p99_ttft_pd_vs_normal'])} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    out, pressure = None, "P1"
    if "--json" in argv:
        i = argv.index("--json")
        out, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    if "--pressure" in argv:
        i = argv.index("--pressure")
        pressure, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    summaries = [(str(Path(a).parent.name), json.loads(Path(a).read_text())) for a in argv]
    by_mode, left = servers(summaries, pressure)
    t = table(by_mode)
    print(render(t))
    if left:
        print(f"\nleft out (not the base configuration): {', '.join(left)}")
    if out:
        metas = [s["meta"] for _, s in summaries]
        meta = {"command": " ".join(["python -m e2e.gpu report repeats", *sys.argv[1:]]), "pressure": pressure,
                "seeds": t["seeds"], "commits": sorted({m.get("commit") for m in metas}),
                "machine": sorted({m.get("machine") for m in metas}), "nproc": sorted({m.get("nproc") for m in metas}),
                "topology": sorted({m.get("topology") for m in metas}), "sources": list(argv),
                "servers": {m: [name for name, _ in v] for m, v in by_mode.items()}, "left_out": left}
        out.write_text(json.dumps({"meta": meta, **t}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
