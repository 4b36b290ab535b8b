"""Issue 22: validate the rendezvous simulator against measured runs, then simulate 8-256 ranks.

    python e2e/rdv_sim.py --bench BENCH.json [--steplogs DIR ...] [--gpu RENDEZVOUS2.json
                          [--gpu-steplogs DIR ...]] [--skew-from DIR] [--engine-figures FIG.json]
                          [--out DIR] [--quick]
    python e2e/rdv_sim.py --spin-from SIM.json [--out DIR]     # spin-then-wait at 256 ranks (issue 64)

--bench     e2e/bench_rendezvous.py --calib output (this machine): the calibration and the
            measured 2/4/8-process figures the simulator is validated against (core pool = the
            machine's cores, the model fitted at 2 ranks only).
--steplogs  engine step logs (`--step-log`, one host): replayed per round (each rank's logged gap
            before pre-D and D enqueue time) and compared with the logged rendezvous latencies;
            their pooled per-rank deviations are the skew of the fleet runs.
--gpu       `python -m e2e.gpu tests rendezvous` output (two H200s): calibration of the GPU host (preferred for
            the fleet when present; its 2-rank bench is the validation point there). Adds two
            scenarios: h200-bench (the ping-pong's crossings and late wake-ups) and
            h200-tail-fitted (the wake-up probability fitted to the 2-rank dissemination p99).
--gpu-steplogs  step logs of that host's engine runs (rendezvous2's steplog-<transport>):
            replayed like --steplogs but with the GPU calibration and a core per rank.
--skew-from the fleet's rank skew and D enqueue times (default: the last step-log directory).
--engine-figures  rendezvous latencies measured inside the engine on H200s (docs/perf/HISTORY.md, "Rendezvous latency"),
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
from rdvrounds import StepTimes, logged_calls, turnstile  # noqa: E402
from rdvsim import TRANSPORTS, Calibration, Net, fit_fixed, fit_wake_p, quantiles, simulate  # noqa: E402

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


def replay(path: str, cal: Calibration, cores, host: str) -> dict:
    """Each logged round: the ranks' logged gaps (previous round left -> pre-D entered) and D
    enqueue times, the simulated rendezvous on top; against the logged pre/post latencies, whole
    and split: after the last rank arrived (the transport's share) vs waiting for it (skew)."""
    paths = sorted(glob.glob(os.path.join(path, "rank*.jsonl")))
    logged, kind = logged_calls(paths)
    n, k = logged.entry.shape[1], logged.entry.shape[0] // 2
    gap = np.vstack([np.zeros((1, n)), logged.entry[2::2] - logged.exit[1:-1:2]])     # [round, rank]
    enq = logged.entry[1::2] - logged.exit[0::2]
    gaps = lambda c, _rng: gap[c // 2] if c % 2 == 0 else enq[c // 2]
    r = simulate(kind, n, cal, 2 * k, cores=cores, seed=5, gaps=gaps)
    # the D wait both rendezvous add per round (mean over ranks), as the fleet reports it: logged,
    # replayed, and from turnstile()'s i.i.d. per-rank draws of this log (the fleet's skew model)
    per_round = lambda x: (x[0::2] + x[1::2]).mean(axis=1)[1:]
    steps = StepTimes.from_step_logs(paths, source=path)
    d_wait = {"measured": quantiles(per_round(logged.latency)), "replayed": quantiles(per_round(r.latency)),
              "turnstile": turnstile(kind, n, cal, steps, k, cores=cores, seed=1)["d_wait_added"]}
    out = {"steplog": path, "host": host, "ranks": n, "rounds": k, "impl": kind, "d_wait_added": d_wait,
           "measured": quantiles(logged.latency[2:]), "simulated": quantiles(r.latency[2:]),
           "measured_after_last": quantiles(logged.transport()[2:]),
           "simulated_after_last": quantiles(r.transport()[2:])}
    for x in ("p50_s", "p99_s"):
        out[f"err_{x}"] = out["simulated"][x] / out["measured"][x] - 1.0
        out[f"err_after_last_{x}"] = out["simulated_after_last"][x] / out["measured_after_last"][x] - 1.0
    return out


def excursions(g: dict, over: float = 2.0) -> list[float]:
    """The GPU run's ping-pong round trips over `over` x their block's median, as the excess over
    it, pooled over its blocks (the calib stage's and each repetition's)."""
    blocks = [g["calib"]["rtt_s"]] + [r["calib"]["rtt_s"] for r in g["runs"] if isinstance(r.get("calib"), dict)]
    out = []
    for b in blocks:
        b = np.asarray(b)
        m = float(np.median(b))
        out += (b[b > over * m] - m).tolist()
    return out


def tail_fitted(gc: Calibration, meas: dict, delays: list[float]) -> tuple[Calibration, dict]:
    """The GPU host's calibration with late wake-ups by `delays` (the ping-pong's excursions over
    2x the median: a continuous range, so the p99 moves smoothly with p), p fitted so that the
    simulated 2-rank dissemination p99 equals the bench's; gather's 2-rank p99 is then a check,
    not a fit. Per-call constants refitted."""
    base = Calibration(**{**gc.__dict__, "wake_s": list(delays)})
    p = fit_wake_p("dissemination", base, meas[(2, "dissemination")]["p99_s"]["median"])
    c = fit(Calibration(**{**base.__dict__, "wake_p": p, "fixed_s": {}}), meas, None)
    c.source = (f"H200 host, late wake-ups p={p:.2g} (fitted to the 2-rank dissemination p99) by the "
                f"ping-pong's excursions over 2x median ({len(delays)})")
    check = {}
    for kind in TRANSPORTS:
        s = sim_q(kind, 2, c, 3000)
        m = meas[(2, kind)]
        check[kind] = {"measured": {x: m[x]["median"] for x in ("p50_s", "p99_s")}, "simulated": s,
                       **{f"err_{x}": s[x] / m[x]["median"] - 1.0 for x in ("p50_s", "p99_s")}}
    return c, {"wake_p": p, "ping_pong_wake_p": gc.wake_p, "delays_s_p50_p90_max": [
        float(np.percentile(delays, q)) for q in (50, 90, 100)], "check_2_ranks": check}


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


def engine_fitted(gc: Calibration, eng: dict) -> tuple[Calibration, dict]:
    """The GPU host's calibration plus, per transport, the engine's excess after the last
    arrival (logged p50 - replayed p50, at 2 ranks) as one more per-call constant: what the
    rendezvous costs inside the engine that the back-to-back bench does not show. A transport
    without a step log keeps the bench's constant."""
    c = Calibration(**{**gc.__dict__, "fixed_s": dict(gc.fixed_s)})
    extra = {k: max(0.0, r["measured_after_last"]["p50_s"] - r["simulated_after_last"]["p50_s"])
             for k, r in eng.items()}
    for k, x in extra.items():
        c.fixed_s[k] = c.fixed_s.get(k, 0.0) + x
    c.source = "H200 host + the engine's per-call excess (" + ", ".join(
        f"{k} +{x * 1e6:.0f} us" for k, x in extra.items()) + ")"
    check = {}
    for k, r in eng.items():
        again = replay(r["steplog"], c, None, "gpu")
        check[k] = {x: again[x] for x in ("measured", "simulated", "measured_after_last",
                                          "simulated_after_last", "d_wait_added")}
    return c, {"engine_extra_s": extra, "check_2_ranks": check}


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


SPINS = [("none", 0.0, False), ("last", 1e-3, False), ("all", 300e-6, False), ("last", 1e-3, True),
         ("all", 300e-6, True), ("all", 1e-3, True)]


def spin_rows(scenarios: dict, inter_s: float, n: int, quick: bool, log) -> list[dict]:
    """Dissemination at `n` ranks, back to back, with its waits spinning before they sleep: none, the
    last hop's or every hop's, on gloo (the waiter skips its wake-up; gloo's loop thread still wakes
    for each message) or on a polled transport (the spinning thread reads its socket: no wake-up at
    all while it spins)."""
    rows = []
    for name, cal in scenarios.items():
        for spin, spin_s, polled in SPINS:
            c = Calibration(**{**cal.__dict__, "spin": spin, "spin_s": spin_s, "polled": polled})
            t0 = time.monotonic()
            q = sim_q("dissemination", n, c, 50 if quick else 200, net=Net(8, inter_s), seeds=(1,) if quick else (1, 2))
            rows.append({"scenario": name, "ranks": n, "spin": spin, "spin_s": spin_s, "polled": polled, **q})
            log(f"  {name} spin {spin} {spin_s * 1e6:.0f} us {'polled' if polled else 'gloo'}: "
                f"p50 {q['p50_s'] * MS:.3f} p99 {q['p99_s'] * MS:.3f} ms ({time.monotonic() - t0:.0f} s)")
    return rows


def spin_main(args, log) -> None:
    """--spin-from: the calibrations of an earlier run's sim.json, spin variants at 256 ranks."""
    prev = json.load(open(args.spin_from))
    keep = set(Calibration.__dataclass_fields__)
    names = {"h200-bench": "gpu", "h200-tail-fitted": "gpu_tail_fitted", "h200-engine-fitted": "gpu_engine_fitted"}
    scenarios = {k: Calibration(**{f: v for f, v in prev["calibration"][c].items() if f in keep})
                 for k, c in names.items() if c in prev["calibration"]}
    rows = spin_rows(scenarios, args.inter_us * 1e-6, 256, args.quick, log)
    out = {"meta": {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "machine": machine(),
                    "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "nproc": 256,
                    "topology": "256 ranks, 8 a node", "inter_us_assumed": args.inter_us, "seeds": [1, 2],
                    "calibrations_from": args.spin_from, "calibrations_from_meta": prev["meta"]},
           "rows": rows}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "spin.json"), "w") as f:
            json.dump(out, f, indent=1)
    print("| scenario | spin | window us | transport | p50 ms | p99 ms |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['scenario']} | {r['spin']} | {r['spin_s'] * 1e6:.0f} | {'polled' if r['polled'] else 'gloo'} | "
              f"{r['p50_s'] * MS:.3f} | {r['p99_s'] * MS:.3f} |")


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
    gv = result["validation"].get("gpu")
    if gv:   # the GPU host at 2 ranks: bench and engine, measured vs simulated
        eng = {r["impl"]: r for r in result["validation"]["steplogs"] if r.get("host") == "gpu"}
        tf = result["calibration"].get("gpu_tail_fitted", {}).get("check_2_ranks", {})
        ef = result["calibration"].get("gpu_engine_fitted", {}).get("check_2_ranks", {})
        fig, ax = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for i, k in enumerate(TRANSPORTS):
            b = next(r for r in gv if r["impl"] == k and r["world"] == 2)
            labels, bars = [], {"measured": [], "h200-bench": [], "h200-tail-fitted": [], "h200-engine-fitted": []}
            for m in ("p50_s", "p99_s"):
                labels.append(f"bench {m[:3]}")
                for name, v in (("measured", b["measured"][m]["median"]), ("h200-bench", b["simulated"][m]["median"]),
                                ("h200-tail-fitted", tf[k]["simulated"][m] if k in tf else np.nan),
                                ("h200-engine-fitted", np.nan)):
                    bars[name].append(v)
            if k in eng:
                for part, (mk, sk) in (("engine", ("measured", "simulated")),
                                       ("after last", ("measured_after_last", "simulated_after_last"))):
                    for m in ("p50_s", "p99_s"):
                        labels.append(f"{part} {m[:3]}")
                        for name, v in (("measured", eng[k][mk][m]), ("h200-bench", eng[k][sk][m]),
                                        ("h200-tail-fitted", np.nan),
                                        ("h200-engine-fitted", ef[k][sk][m] if k in ef else np.nan)):
                            bars[name].append(v)
            x = np.arange(len(labels))
            style = {"measured": ("gray", 1.0), "h200-bench": (colors[k], 1.0), "h200-tail-fitted": (colors[k], 0.45),
                     "h200-engine-fitted": ("tab:olive", 1.0)}
            for j, (name, v) in enumerate(bars.items()):
                ax[i].bar(x + (j - 1.5) * 0.2, np.array(v) * MS, 0.2, color=style[name][0], alpha=style[name][1],
                          label=name if name == "measured" else f"simulated ({name})")
            ax[i].set_xticks(x, labels, rotation=30, fontsize=7)
            ax[i].set_yscale("log")
            ax[i].set_title(f"{k}, 2 ranks on the H200 host", fontsize=9)
            ax[i].legend(fontsize=7)
        ax[0].set_ylabel("rendezvous latency (ms)")
        fig.tight_layout()
        p = os.path.join(out, "validation-gpu.png")
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
    ap.add_argument("--bench")
    ap.add_argument("--spin-from", help="an earlier run's sim.json: only its calibrations' spin variants at 256 ranks")
    ap.add_argument("--steplogs", nargs="*", default=[])
    ap.add_argument("--gpu")
    ap.add_argument("--gpu-steplogs", nargs="*", default=[],
                    help="step logs of the engine on the --gpu host: replayed with its calibration")
    ap.add_argument("--engine-figures")
    ap.add_argument("--skew-from", help="step-log directory for the fleet's skew (default: the last --steplogs)")
    ap.add_argument("--inter-us", type=float, default=25.0, help="extra one-way latency between nodes (assumed)")
    ap.add_argument("--sweep-us", type=float, nargs="+", default=[0, 10, 25, 50, 100])
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="fewer simulated calls (a smoke run)")
    ap.add_argument("--replot", action="store_true", help="only redraw the plots of --out/sim.json")
    args = ap.parse_args()
    if args.gpu_steplogs and not args.gpu:
        ap.error("--gpu-steplogs needs --gpu (their host's calibration)")
    log = lambda s: print(s, flush=True)
    if args.spin_from:
        spin_main(args, log)
        return
    if not args.bench:
        ap.error("--bench is required (or --spin-from)")
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
    result["validation"]["steplogs"] = [replay(d, here_fit, cores, "here") for d in args.steplogs]
    steps = None
    skew_from = args.skew_from or ([*args.steplogs, *args.gpu_steplogs] or [None])[-1]
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
        result["meta"]["inputs"]["gpu_meta"] = g["meta"]
        result["calibration"]["gpu"] = gc.dump()
        result["validation"]["gpu"] = validate_bench(g["calib"]["local"], g["runs"], None, args.quick)
        # the GPU host's step logs: its calibration, a core per rank (nothing oversubscribed there)
        result["validation"]["steplogs"] += [replay(d, gc, None, "gpu") for d in args.gpu_steplogs]
        result["gpu_nccl"] = g.get("nccl")
        result["gpu_engine"] = g.get("engine")
        scenarios["h200-bench"] = gc
        log("fitting the late-wake-up probability to the GPU host's 2-rank p99")
        tc, info = tail_fitted(gc, measured(g["summary"]), excursions(g))
        result["calibration"]["gpu_tail_fitted"] = {**tc.dump(), **info}
        scenarios["h200-tail-fitted"] = tc
        eng = {r["impl"]: r for r in result["validation"]["steplogs"] if r["host"] == "gpu"}
        if eng:
            ec, info = engine_fitted(gc, eng)
            result["calibration"]["gpu_engine_fitted"] = {**ec.dump(), **info}
            scenarios["h200-engine-fitted"] = ec
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
    result["ep16_more"] = {name: ep16(cal, steps, args.sweep_us, args.quick)
                           for name, cal in scenarios.items() if name != first and name.startswith("h200")}
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
        print(f"| engine ({r['host']}) {os.path.basename(r['steplog'])} | {r['ranks']} | {r['impl']} | "
              f"{fmt(r['measured'])} | {fmt(r['simulated'])} | {r['err_p50_s']:+.0%} | {r['err_p99_s']:+.0%} |")
        print(f"| ... after the last arrival | {r['ranks']} | {r['impl']} | {fmt(r['measured_after_last'])} | "
              f"{fmt(r['simulated_after_last'])} | {r['err_after_last_p50_s']:+.0%} | "
              f"{r['err_after_last_p99_s']:+.0%} |")
    print("\nD wait added per round by both rendezvous (p50 / p99 ms): logged, replayed, turnstile() draws")
    for r in result["validation"]["steplogs"]:
        w = r["d_wait_added"]
        print(f"| {r['host']} {os.path.basename(r['steplog'])} | {fmt(w['measured'])} | {fmt(w['replayed'])} | "
              f"{fmt(w['turnstile'])} |")
    if "gpu_engine_fitted" in result["calibration"]:
        t = result["calibration"]["gpu_engine_fitted"]
        print(f"\nh200-engine-fitted: {t['source']}; 2 ranks replayed again (p50 / p99 ms):")
        print("| transport | logged | replayed | after last: logged | replayed | D wait: logged | replayed |")
        for kind, c in t["check_2_ranks"].items():
            w = c["d_wait_added"]
            print(f"| {kind} | {fmt(c['measured'])} | {fmt(c['simulated'])} | {fmt(c['measured_after_last'])} | "
                  f"{fmt(c['simulated_after_last'])} | {fmt(w['measured'])} | {fmt(w['replayed'])} |")
    if "gpu_tail_fitted" in result["calibration"]:
        t = result["calibration"]["gpu_tail_fitted"]
        print(f"\nh200-tail-fitted: wake-up p {t['wake_p']:.2g} (ping-pong: {t['ping_pong_wake_p']:.2g}); 2 ranks:")
        for kind, c in t["check_2_ranks"].items():
            print(f"| {kind} | measured {fmt(c['measured'])} | simulated {fmt(c['simulated'])} | "
                  f"{c['err_p50_s']:+.0%} | {c['err_p99_s']:+.0%} |")
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
    for name, rows in {result["ep16"]["scenario"]: result["ep16"]["rows"], **result["ep16_more"]}.items():
        print(f"\nEP16 over two nodes ({name}; p50 / p99 ms by the assumed extra inter-node latency):")
        print("| inter-node us | transport | back-to-back | with skew: transport | D wait added / round |\n"
              "|---|---|---|---|---|")
        for r in rows:
            ts = r.get("turnstile")
            print(f"| {r['inter_us']:.0f} | {r['impl']} | {fmt(r['back_to_back'])} | "
                  f"{fmt(ts['transport']) if ts else '-'} | {fmt(ts['d_wait_added']) if ts else '-'} |")


if __name__ == "__main__":
    main()
