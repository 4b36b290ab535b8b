"""Issue 22: validate the rendezvous simulator against measured runs, then simulate 8-256 ranks.

    python e2e/rdv_sim.py --bench BENCH.json [--steplogs DIR ...] [--gpu RENDEZVOUS2.json]
                          [--engine-figures FIG.json] [--out DIR] [--quick]

--bench     e2e/bench_rendezvous.py --calib output (this machine): the calibration and the
            measured 2/4/8-process figures the simulator is validated against (core pool = the
            machine's cores, the model fitted at 2 ranks only).
--steplogs  engine step logs (`--step-log`, one host): replayed per round (each rank's logged gap
            before pre-D and D enqueue time) and compared with the logged rendezvous latencies;
            their pooled per-rank deviations are the skew of the fleet runs.
--gpu       e2e/gpu/rendezvous2.py output (two H200s): calibration of the GPU host (preferred for
            the fleet when present; its 2-rank bench is the validation point there).
--engine-figures  rendezvous latencies measured inside the engine on H200 hosts (docs/PERF.md),
            used until --gpu exists: the hop scaled so the 2-rank gather mean matches (everything
            taken as transport, an upper bound), checked against the 4-rank figure.
Fleet: 8..256 ranks, 8 ranks per node, messages between nodes pay --inter-us more (assumed;
nothing here measures a second host), plus a sweep of that for EP16 over two nodes.
Writes DIR/sim.json (meta: command, machine, commit, inputs) and DIR/*.png; prints tables.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rendezvous import commit, machine  # noqa: E402
from pdrollout.engine.workload.rdvsim import (TRANSPORTS, Calibration, Net, StepTimes,  # noqa: E402
                                                 fit_fixed, quantiles, simulate, turnstile)

SIZES = [8, 16, 32, 64, 128, 256]
MS = 1e3


def calibration(calib: dict, source: str) -> Calibration:
    return Calibration.from_pingpong(calib["rtt_s"], calib["post_s"], calib["rx_s"],
                                     {k: tuple(v) for k, v in calib["local"]["fit_a_b_s"].items()}, source)


def measured(summary: list[dict]) -> dict:
    return {(r["world"], r["impl"]): r for r in summary}


def fit(cal: Calibration, meas: dict, cores) -> Calibration:
    """A copy with each transport's per-call constant fitted to the measured 2-rank p50."""
    cal = Calibration(**{**cal.__dict__, "fixed_s": dict(cal.fixed_s)})
    c2 = cores(2) if callable(cores) else cores
    for k in TRANSPORTS:
        if (2, k) in meas:
            cal.fixed_s[k] = fit_fixed(k, cal, meas[(2, k)]["p50_s"]["median"], cores=c2)
    return cal


def calls_for(kind: str, n: int, quick: bool) -> int:
    if kind == "gather":
        c = 400 if n <= 16 else 120 if n <= 32 else 40 if n <= 64 else 12 if n <= 128 else 4
    else:
        c = 400 if n <= 64 else 200
    return max(4, c // 4) if quick else c


def sim_q(kind, n, cal, calls, cores=None, net=None, seeds=(1, 2, 3)) -> dict:
    """Median over seeds of the pooled (every rank, every call after a warm-up) quantiles."""
    qs = []
    for s in seeds:
        r = simulate(kind, n, cal, calls + 4, net=net, cores=cores, seed=s)
        qs.append(quantiles(r.latency[4:]))
    return {m: float(np.median([q[m] for q in qs])) for m in ("p50_s", "p99_s", "mean_s")}


def validate_bench(local: dict, runs: list[dict], cores, quick: bool) -> list[dict]:
    """Per repetition: the calibration measured in that run's own processes (ping-pong blocks
    between its transport blocks), the per-call constants fitted to that repetition's 2-rank
    p50, the core pool = `cores`; then every world of the repetition is predicted."""
    by = {(r["world"], r["rep"], r["impl"]): r for r in runs}
    calib = {(r["world"], r["rep"]): r["calib"] for r in runs if isinstance(r.get("calib"), dict)}
    sims: dict = {}
    for rep in sorted({r["rep"] for r in runs}):
        if (2, rep) not in calib:
            continue
        c2 = calibration({**calib[(2, rep)], "local": local}, "")
        meas2 = {(2, k): {"p50_s": {"median": by[(2, rep, k)]["p50_s"]}} for k in TRANSPORTS if (2, rep, k) in by}
        fixed = fit(c2, meas2, cores).fixed_s
        for (w, rp), cw in calib.items():
            if rp != rep:
                continue
            cal = calibration({**cw, "local": local}, "")
            cal.fixed_s = dict(fixed)
            for k in TRANSPORTS:
                if (w, rep, k) in by:
                    sims.setdefault((w, k), []).append(
                        (by[(w, rep, k)], sim_q(k, w, cal, 200 if quick else 600, cores=cores, seeds=(rep + 1,))))
    rows = []
    for (w, k), pairs in sorted(sims.items()):
        row = {"world": w, "impl": k, "reps": len(pairs), "measured": {}, "simulated": {}}
        for x in ("p50_s", "p99_s", "mean_s"):
            m = [p[0][x] for p in pairs]
            sm = [p[1][x] for p in pairs]
            row["measured"][x] = {"median": float(np.median(m)), "min": min(m), "max": max(m)}
            row["simulated"][x] = {"median": float(np.median(sm)), "min": min(sm), "max": max(sm)}
        for x in ("p50_s", "p99_s"):
            row[f"err_{x}"] = row["simulated"][x]["median"] / row["measured"][x]["median"] - 1.0
        rows.append(row)
    return rows


def replay(path: str, cal: Calibration, cores) -> dict:
    """Each logged round: the ranks' logged gaps (previous round left -> pre-D entered) and D
    enqueue times, the simulated rendezvous on top; against the logged pre/post latencies."""
    files = sorted(glob.glob(os.path.join(path, "rank*.jsonl")))
    per_rank, kind = [], None
    for p in files:
        rows = [json.loads(x) for x in open(p) if x.strip()]
        kind = rows[0].get("rendezvous", "gather")
        per_rank.append([t for e in rows for t in e.get("round_t", [])])
    n, k = len(per_rank), min(len(r) for r in per_rank)
    t = np.array([r[:k] for r in per_rank])
    enter = t[:, :, 0] + t[:, :, 1]
    leave = enter + t[:, :, 2:].sum(axis=2)
    gap = np.concatenate([np.zeros((n, 1)), enter[:, 1:] - leave[:, :-1]], axis=1).T    # [round, rank]
    enq = t[:, :, 3].T
    gaps = lambda c, _rng: gap[c // 2] if c % 2 == 0 else enq[c // 2]
    r = simulate(kind, n, cal, 2 * k, cores=cores, seed=5, gaps=gaps)
    logged = np.concatenate([t[:, 1:, 2].ravel(), t[:, 1:, 4].ravel()])
    sim = r.latency[2:]
    out = {"steplog": path, "ranks": n, "rounds": k, "impl": kind,
           "measured": quantiles(logged), "simulated": quantiles(sim)}
    for x in ("p50_s", "p99_s"):
        out[f"err_{x}"] = out["simulated"][x] / out["measured"][x] - 1.0
    return out


def engine_scaled(cal: Calibration, fig: dict, cores=None) -> tuple[Calibration, dict]:
    """Scale the hop so the 2-rank gather mean equals the engine's (bisection on the factor)."""
    target = fig["gather"]["2"]["mean_s"]
    lo, hi = 0.1, 100.0
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        c = cal.scaled(mid, "")
        if sim_q("gather", 2, c, 300, cores=cores, seeds=(1,))["mean_s"] < target:
            lo = mid
        else:
            hi = mid
    f = (lo * hi) ** 0.5
    c = cal.scaled(f, f"{cal.source}, hop x{f:.2f} so the 2-rank gather mean = the engine's {target * MS:.2f} ms")
    check = {}
    for w, m in fig["gather"].items():
        s = sim_q("gather", int(w), c, 300, cores=cores)
        check[w] = {"measured": m, "simulated": s, "err_mean": s["mean_s"] / m["mean_s"] - 1.0}
        print(f"  engine figures, gather at {w} ranks: measured mean {m['mean_s'] * MS:.3f} ms, "
              f"scaled model {s['mean_s'] * MS:.3f} ms", flush=True)
    return c, {"factor": f, "check": check, "source": fig.get("source", "")}


def fleet(cal: Calibration, steps: StepTimes | None, inter_s: float, quick: bool, log) -> list[dict]:
    rows = []
    for n in SIZES:
        net = Net(8, inter_s)
        for k in TRANSPORTS:
            t0 = time.monotonic()
            calls = calls_for(k, n, quick)
            row = {"ranks": n, "impl": k, "calls": calls,
                   "back_to_back": sim_q(k, n, cal, calls, net=net, seeds=(1,) if n >= 128 else (1, 2, 3))}
            if steps is not None:
                ts = turnstile(k, n, cal, steps, max(2, calls // 2), net=net, seed=1)
                row["turnstile"] = ts
            rows.append(row)
            log(f"  {cal.source[:40]} n={n} {k}: p50 {row['back_to_back']['p50_s'] * MS:.3f} ms "
                f"p99 {row['back_to_back']['p99_s'] * MS:.3f} ms ({time.monotonic() - t0:.0f} s)")
    return rows


def noise(cal: Calibration, inter_s: float, quick: bool) -> list[dict]:
    """Dissemination at 256 ranks when a woken thread runs late with probability p by d (OS
    noise, preemption): what the p99 goal asks of the hosts."""
    rows = []
    for p in (0.0, 1e-4, 1e-3, 1e-2):
        for dur in (20e-6, 200e-6, 2e-3):
            c = Calibration(**{**cal.__dict__, "wake_p": p, "wake_s": [dur]})
            q = sim_q("dissemination", 256, c, 50 if quick else 300, net=Net(8, inter_s), seeds=(1,))
            rows.append({"wake_p": p, "wake_s": dur, **q})
            if p == 0.0:
                break
    return rows


def ep16(cal: Calibration, steps, sweep_us, quick) -> list[dict]:
    rows = []
    for us in sweep_us:
        for k in TRANSPORTS:
            net = Net(8, us * 1e-6)
            row = {"inter_us": us, "impl": k, "back_to_back": sim_q(k, 16, cal, calls_for(k, 16, quick), net=net)}
            if steps is not None:
                row["turnstile"] = turnstile(k, 16, cal, steps, 200 if not quick else 50, net=net, seed=1)
            rows.append(row)
    return rows


def plots(out: str, result: dict) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    files = []
    colors = {"gather": "tab:red", "dissemination": "tab:blue"}
    v = result["validation"]["bench"]
    if v:
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        for i, m in enumerate(("p50_s", "p99_s")):
            for k in TRANSPORTS:
                rs = [r for r in v if r["impl"] == k]
                w = [r["world"] for r in rs]
                med = np.array([r["measured"][m]["median"] for r in rs]) * MS
                err = np.array([[r["measured"][m]["median"] - r["measured"][m]["min"] for r in rs],
                                [r["measured"][m]["max"] - r["measured"][m]["median"] for r in rs]]) * MS
                ax[i].errorbar(w, med, yerr=err, fmt="o-", color=colors[k], label=f"{k} measured", capsize=3)
                ax[i].plot(w, [r["simulated"][m]["median"] * MS for r in rs], "x--", color=colors[k],
                           label=f"{k} simulated")
            ax[i].set_xscale("log", base=2)
            ax[i].set_yscale("log")
            ax[i].set_xlabel("processes")
            ax[i].set_ylabel(f"{m[:3]} latency (ms)")
            ax[i].set_title(f"{m[:3]}: measured (median, min-max of reps) vs simulated", fontsize=9)
            ax[i].legend(fontsize=7)
        fig.tight_layout()
        p = os.path.join(out, "validation.png")
        fig.savefig(p, dpi=110)
        files.append(p)
        plt.close(fig)
    for name, sc in result["fleet"].items():
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for k in TRANSPORTS:
            rs = [r for r in sc["rows"] if r["impl"] == k]
            n = [r["ranks"] for r in rs]
            ax.plot(n, [r["back_to_back"]["p50_s"] * MS for r in rs], "o-", color=colors[k], label=f"{k} p50")
            ax.plot(n, [r["back_to_back"]["p99_s"] * MS for r in rs], "s--", color=colors[k], label=f"{k} p99")
            if "turnstile" in rs[0]:
                ax.plot(n, [r["turnstile"]["rendezvous"]["p99_s"] * MS for r in rs], ":", color=colors[k],
                        label=f"{k} p99 with step-log skew")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"ranks (8 per node, +{sc['inter_us']:.0f} us between nodes, assumed)")
        ax.set_ylabel("rendezvous latency (ms)")
        ax.set_title(f"simulated: {name}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = os.path.join(out, f"fleet-{name}.png")
        fig.savefig(p, dpi=110)
        files.append(p)
        plt.close(fig)
    return files


def fmt(q) -> str:
    return f"{q['p50_s'] * MS:.3f} / {q['p99_s'] * MS:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True)
    ap.add_argument("--steplogs", nargs="*", default=[])
    ap.add_argument("--gpu")
    ap.add_argument("--engine-figures")
    ap.add_argument("--skew-from", help="step-log directory for the fleet's skew (default: the last --steplogs)")
    ap.add_argument("--inter-us", type=float, default=25.0, help="extra one-way latency between nodes (assumed)")
    ap.add_argument("--sweep-us", type=float, nargs="+", default=[0, 10, 25, 50, 100])
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="fewer simulated calls (a smoke run)")
    ap.add_argument("--replot", action="store_true", help="only redraw the plots of --out/sim.json")
    args = ap.parse_args()
    log = lambda s: print(s, flush=True)
    if args.replot:
        print(plots(args.out, json.load(open(os.path.join(args.out, "sim.json")))))
        return
    bench = json.load(open(args.bench))
    cores = bench["meta"]["machine"]["cores"]
    meas = measured(bench["summary"])
    base = calibration(bench["calib"], f"loopback here ({bench['meta']['machine']['cpu']}, {cores} cores)")
    result = {"meta": {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "machine": machine(),
                       "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "inputs": {"bench": args.bench, "bench_meta": bench["meta"], "steplogs": args.steplogs,
                                  "gpu": args.gpu, "engine_figures": args.engine_figures},
                       "inter_us_assumed": args.inter_us, "nproc": SIZES},
              "calibration": {"here": base.dump()}, "validation": {}, "fleet": {}}
    # validation here: each repetition calibrated in its own processes, a pool of the machine's
    # cores (our processes' contention; the other tenants' show up as the pauses)
    log("validation against this machine's bench:")
    local = bench["calib"]["local"]
    result["validation"]["bench"] = validate_bench(local, bench["runs"], cores, args.quick)
    here_fit = fit(base, meas, cores)
    result["validation"]["steplogs"] = [replay(d, here_fit, cores) for d in args.steplogs]
    steps = None
    skew_from = args.skew_from or (args.steplogs[-1] if args.steplogs else None)
    if skew_from:
        steps = StepTimes.from_step_logs(sorted(glob.glob(os.path.join(skew_from, "rank*.jsonl"))), source=skew_from)
        result["skew"] = {"source": steps.source, "ranks": steps.ranks, "rounds": steps.rounds,
                          "abs_gap_dev_p50_p99_s": [float(np.percentile(np.abs(steps.gap_dev_s), q)) for q in (50, 99)],
                          "abs_enq_dev_p50_p99_s": [float(np.percentile(np.abs(steps.enq_dev_s), q)) for q in (50, 99)],
                          "enq_p50_s": float(np.median(steps.enq_s))}
    # fleet: a core per rank; per-call constants fitted with no pool (all of the 2-rank residue)
    dedicated = fit(Calibration(**{**base.__dict__, "wake_p": 0.0, "wake_s": []}), meas, None)
    dedicated.source = base.source + ", crossings only (no late wake-ups)"
    scenarios = {}
    if args.gpu:
        g = json.load(open(args.gpu))
        gc = fit(calibration(g["calib"], f"H200 host ({g['meta']['machine']['cpu']})"), measured(g["summary"]), None)
        gc.source += f", late wake-ups p={gc.wake_p:.2g}"
        result["calibration"]["gpu"] = gc.dump()
        result["validation"]["gpu"] = validate_bench(g["calib"]["local"], g["runs"], None, args.quick)
        result["gpu_nccl"] = g.get("nccl")
        scenarios["h200-bench"] = gc
    scenarios["here-dedicated"] = dedicated
    result["calibration"]["here_late_wakeups"] = {"wake_p": base.wake_p,
                                                  "wake_s_p50": float(np.median(base.wake_s)) if base.wake_s else 0.0}
    if args.engine_figures:
        fig = json.load(open(args.engine_figures))
        ec, info = engine_scaled(dedicated, fig)
        result["calibration"]["engine_scaled"] = {**ec.dump(), **info}
        scenarios["h200-engine-upper"] = ec
    for name, cal in scenarios.items():
        log(f"fleet: {name}")
        result["fleet"][name] = {"source": cal.source, "inter_us": args.inter_us, "calibration": cal.dump(),
                                 "rows": fleet(cal, steps, args.inter_us * 1e-6, args.quick, log)}
    first = next(iter(scenarios))
    result["ep16"] = {"scenario": first, "rows": ep16(scenarios[first], steps, args.sweep_us, args.quick)}
    result["noise"] = {"scenario": first, "rows": noise(scenarios[first], args.inter_us * 1e-6, args.quick)}
    files = []
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        files = plots(args.out, result)
        result["meta"]["plots"] = [os.path.basename(f) for f in files]
        with open(os.path.join(args.out, "sim.json"), "w") as f:
            json.dump(result, f, indent=1)
    # tables last
    print("\nvalidation (p50 / p99 ms; error = simulated / measured - 1):")
    print("| source | ranks | transport | measured | simulated | err p50 | err p99 |\n|---|---|---|---|---|---|---|")
    for src in ("bench", "gpu"):
        for r in result["validation"].get(src, []):
            m = {x: r["measured"][x]["median"] for x in ("p50_s", "p99_s")}
            sm = {x: r["simulated"][x]["median"] for x in ("p50_s", "p99_s")}
            print(f"| {src} ({r['reps']} reps, medians) | {r['world']} | {r['impl']} | {fmt(m)} | {fmt(sm)} | "
                  f"{r['err_p50_s']:+.0%} | {r['err_p99_s']:+.0%} |")
    for r in result["validation"]["steplogs"]:
        print(f"| engine {os.path.basename(r['steplog'])} | {r['ranks']} | {r['impl']} | {fmt(r['measured'])} | "
              f"{fmt(r['simulated'])} | {r['err_p50_s']:+.0%} | {r['err_p99_s']:+.0%} |")
    for name, sc in result["fleet"].items():
        print(f"\nfleet, {name}: {sc['source']}")
        print("(p50 / p99 ms; back-to-back calls; with the step-log skew: the transport's share (exit - last "
              "arrival) and the D wait both rendezvous add per round)")
        print("| ranks | transport | back-to-back | with skew: transport | D wait added / round |\n|---|---|---|---|---|")
        for r in sc["rows"]:
            ts = r.get("turnstile")
            print(f"| {r['ranks']} | {r['impl']} | {fmt(r['back_to_back'])} | "
                  f"{fmt(ts['transport']) if ts else '-'} | {fmt(ts['d_wait_added']) if ts else '-'} |")
    print(f"\ndissemination at 256 ranks with late wake-ups ({result['noise']['scenario']}; ms):")
    print("| P(a wake-up is late) | by | p50 | p99 |\n|---|---|---|---|")
    for r in result["noise"]["rows"]:
        print(f"| {r['wake_p']:g} | {r['wake_s'] * 1e6:.0f} us | {r['p50_s'] * MS:.3f} | {r['p99_s'] * MS:.3f} |")
    print(f"\nEP16 over two nodes ({result['ep16']['scenario']}; p50 / p99 ms by the assumed extra inter-node latency):")
    print("| inter-node us | transport | back-to-back | D wait added / round |\n|---|---|---|---|")
    for r in result["ep16"]["rows"]:
        ts = r.get("turnstile")
        print(f"| {r['inter_us']:.0f} | {r['impl']} | {fmt(r['back_to_back'])} | {fmt(ts['d_wait_added']) if ts else '-'} |")


if __name__ == "__main__":
    main()
