"""Benchmark (not a test): the turnstile rendezvous transports side by side, in real rank
processes over gloo on this host, plus the calibration the simulator needs (e2e/rdvsim.py).

    python e2e/bench_rendezvous.py [--worlds 2 4 8] [--impls gather dissemination] [--rounds 500]
                                   [--reps 3] [--calib] [--out DIR]

Each round is one pre-D and one post-D rendezvous with no device work (the transport alone).
Both transports run in the same processes, alternating blocks of rounds, so they see the same
machine; each repetition is a fresh set of processes. Latency = what each rank records per call,
pooled over ranks. `--calib` adds, at two ranks: a point-to-point ping-pong (receives posted
ahead, as the dissemination transport does), the cost of posting, the CPU per message, and each
transport's local Python cost per call for n = 2..256 (timed in-process). Prints a Markdown table
last; with --out writes DIR/bench.json (meta: command, machine, commit, nproc).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

# the test harness's rank launcher (tests/ranks.py): real processes over gloo, stragglers killed
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

QS = [0, 1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9, 100]
LOCAL_NS = [2, 4, 8, 16, 32, 64, 128, 256]


def _bench(ctx, impls, rounds, warmup, block, pp_iters):
    """Blocks of each transport in turn, and before each cycle a ping-pong block between ranks
    0 and 1 (the others wait): the simulator's calibration from the same processes and minutes."""
    import torch.distributed as dist
    from pdrollout.engine.runtime.rendezvous import make_rendezvous
    rdvs = {k: make_rendezvous(k, dist.new_group(list(range(ctx.world))), ctx.world) for k in impls}
    pair = dist.new_group([0, 1])
    for k, rdv in rdvs.items():
        for i in range(warmup):
            a = rdv.pre_d(0, i, True)
            rdv.post_d(0, i, a.d_any, expect=a.d_any)
        rdv.latencies.clear()
    done, pp = 0, {"rtt": [], "post_recv": [], "post_send": [], "cpu_s": 0.0, "iters": 0}
    while done < rounds:
        if pp_iters and ctx.rank < 2:
            r = _pingpong(pair, ctx.rank, pp_iters, 20)
            for x in ("rtt", "post_recv", "post_send"):
                pp[x] += r[x]
            pp["cpu_s"] += r["cpu_s"]
            pp["iters"] += pp_iters
        dist.barrier()
        n = min(block, rounds - done)
        order = list(rdvs) if (done // block) % 2 == 0 else list(reversed(list(rdvs)))
        for k in order:
            rdv = rdvs[k]
            for i in range(done, done + n):
                a = rdv.pre_d(1, i, (ctx.rank + i) % 3 == 0)
                rdv.post_d(1, i, a.d_any, expect=a.d_any)
        done += n
    return {"lat": {k: r.latencies for k, r in rdvs.items()}, "pingpong": pp if ctx.rank == 0 else None,
            "pp_cpu_s": pp["cpu_s"]}


def _pingpong(pg, rank, iters, warmup):
    """Ranks 0 and 1 of `pg`; the receive is posted before the matching send, so the
    receiver-ready notice precedes the data on the same socket (one crossing per message)."""
    import torch
    peer = 1 - rank
    bufs = [torch.zeros(10, dtype=torch.int64) for _ in range(4)]
    rtt, post_r, post_s, keep = [], [], [], None
    t_cpu = None
    if rank == 0:
        for i in range(warmup + iters):
            if i == warmup:
                t_cpu = os.times()
            t0 = time.perf_counter()
            r = pg.recv([bufs[i % 2]], peer, 9)
            t1 = time.perf_counter()
            s = pg.send([bufs[2]], peer, 9)
            t2 = time.perf_counter()
            r.wait()
            t3 = time.perf_counter()
            s.wait()
            keep = (r, s)       # freed next iteration (see DisseminationRendezvous)
            if i >= warmup:
                post_r.append(t1 - t0)
                post_s.append(t2 - t1)
                rtt.append(t3 - t1)
    else:
        r = pg.recv([bufs[0]], peer, 9)
        for i in range(warmup + iters):
            if i == warmup:
                t_cpu = os.times()
            r.wait()
            last = i + 1 == warmup + iters
            r2 = None if last else pg.recv([bufs[(i + 1) % 2]], peer, 9)   # next receive first: its notice leads
            s = pg.send([bufs[3]], peer, 9)
            s.wait()
            keep = (r, s)
            r = r2
    t1 = os.times()
    del keep
    return {"rtt": rtt, "post_recv": post_r, "post_send": post_s,
            "cpu_s": (t1.user + t1.system) - (t_cpu.user + t_cpu.system)}


def _calib(ctx, iters, warmup):
    from torch.distributed.distributed_c10d import _get_default_group
    r = _pingpong(_get_default_group(), ctx.rank, iters, warmup)
    r["cpu_per_iter_s"] = r.pop("cpu_s") / iters
    return r


def pingpong_calib(rtt, post_recv, post_send, cpu_per_iter_s) -> dict:
    """post = median post; per round trip a rank posts 2 and takes in 3 messages (the notice,
    the send-ready, the data), so rx = (CPU per round trip - 2 post) / 3."""
    import numpy as np
    post = float(np.median(list(post_recv) + list(post_send)))
    return {"rtt_s": [float(x) for x in rtt], "post_s": post, "rx_s": max((cpu_per_iter_s - 2 * post) / 3, 0.0),
            "cpu_per_iter_s": cpu_per_iter_s}


def local_costs(ns=LOCAL_NS, reps=300) -> dict:
    """Each transport's Python work per call at world n, without the network: what the
    simulator charges as `a + b n` (the message model covers the rest)."""
    import numpy as np
    import torch
    from pdrollout.engine.runtime.rendezvous import (Agreement, GatherRendezvous, decode, distances,
                                                         encode, merge)
    out = {"gather": {}, "dissemination": {}}
    row = [5, 1, 2, 3, 1, 1]
    for n in ns:
        g = GatherRendezvous(None, world=n)
        rows_t = [torch.tensor(row, dtype=torch.int64) for _ in range(n)]
        xs = []
        for _ in range(reps):   # GatherRendezvous: the tensors around all_gather, the summary
            t0 = time.perf_counter()
            mine = torch.tensor(row, dtype=torch.int64)
            _ = [torch.empty_like(mine) for _ in range(n)]
            rows = [o.tolist() for o in rows_t]
            s = g._summary(rows)
            Agreement(0, 2, 3, any(s.ready), s.ready, s.work, 0.0)
            xs.append(time.perf_counter() - t0)
        out["gather"][n] = float(np.median(xs))
        st, got, k = encode(row, 0, n), encode(row, 1, n), len(distances(n))
        xs = []
        for _ in range(reps):   # DisseminationRendezvous: encode, k merges and copies, decode
            t0 = time.perf_counter()
            encode(row, 0, n, out=st)
            for _ in range(k):
                got[:] = st
                merge(st, got)
            s = decode(st, n)
            Agreement(0, 2, 3, any(s.ready), s.ready, s.work, 0.0)
            xs.append(time.perf_counter() - t0)
        out["dissemination"][n] = float(np.median(xs))
    fit = {}
    for kind, by_n in out.items():
        b, a = np.polyfit(list(by_n), list(by_n.values()), 1)
        fit[kind] = [max(float(a), 0.0), max(float(b), 0.0)]
    return {"by_n_s": {k: {str(n): v for n, v in d.items()} for k, d in out.items()}, "fit_a_b_s": fit}


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch
    return {"host": platform.node(), "machine": platform.machine(), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__}


def commit() -> str:
    if os.environ.get("PDROLLOUT_COMMIT"):   # a copy of the tree (the device machine) may sit in another checkout
        return os.environ["PDROLLOUT_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if head:
            return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def _spin(seconds: float, q) -> None:
    t0, c0 = time.monotonic(), time.process_time()
    while time.monotonic() - t0 < seconds:
        pass
    q.put(time.process_time() - c0)


def capacity(procs: int = 4, seconds: float = 1.0) -> float:
    """Cores our processes (at this nice level) get right now: `procs` spinners' CPU time over
    the wall time. On a shared machine this is the simulator's core pool, not os.cpu_count()."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    ps = [ctx.Process(target=_spin, args=(seconds, q)) for _ in range(procs)]
    t0 = time.monotonic()
    for p in ps:
        p.start()
    cpu = sum(q.get(timeout=60) for _ in ps)
    for p in ps:
        p.join(10)
    return cpu / max(time.monotonic() - t0, seconds)


def _busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs, for the load during a run."""
    with open("/proc/stat") as f:
        v = [float(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0.0)
    return sum(v) - idle, sum(v)


def stats(xs) -> dict:
    import numpy as np
    a = np.asarray(xs, dtype=float)
    return {"p50_s": float(np.percentile(a, 50)), "p99_s": float(np.percentile(a, 99)), "mean_s": float(a.mean()),
            "n": int(a.size), "quantiles_s": {str(q): float(np.percentile(a, q)) for q in QS}}


def run_bench(worlds, impls, rounds, warmup, block, reps, pp_iters=200, timeout_s=900, log=print) -> list[dict]:
    from ranks import run_ranks
    runs = []
    for rep in range(reps):
        for w in worlds:
            cap = capacity()
            load0, b0 = os.getloadavg()[0], _busy()
            t0 = time.monotonic()
            outs = run_ranks(_bench, w, (impls, rounds, warmup, block, pp_iters), timeout_s=timeout_s)
            wall = time.monotonic() - t0
            b1 = _busy()
            res = [o.result for o in outs]
            if any(not isinstance(r, dict) or "lat" not in r for r in res):
                raise SystemExit(f"world {w} failed: {[(o.exitcode, str(o.result)[-2000:]) for o in outs]}")
            busy_cores = (b1[0] - b0[0]) / max(b1[1] - b0[1], 1.0) * (os.cpu_count() or 1)
            pp = res[0]["pingpong"]
            calib = None
            if pp and pp["iters"]:
                cpu = (pp["cpu_s"] + res[1]["pp_cpu_s"]) / 2 / pp["iters"]
                calib = pingpong_calib(pp["rtt"], pp["post_recv"], pp["post_send"], cpu)
            for k in impls:
                lat = [x for r in res for x in r["lat"][k]]
                runs.append({"world": w, "rep": rep, "impl": k, **stats(lat),
                             "load_avg": [load0, os.getloadavg()[0]], "wall_s": wall,
                             "busy_cores": busy_cores, "capacity_cores": cap,
                             "calib": calib if k == impls[0] else "same as " + impls[0]})
                log(f"rep {rep} world {w} {k}: p50 {runs[-1]['p50_s'] * 1e3:.3f} ms, "
                    f"p99 {runs[-1]['p99_s'] * 1e3:.3f} ms (load {load0:.1f}, capacity {cap:.2f} cores)")
    return runs


def run_calib(iters=3000, warmup=300, timeout_s=300) -> dict:
    import numpy as np
    from ranks import run_ranks
    outs = run_ranks(_calib, 2, (iters, warmup), timeout_s=timeout_s)
    res = [o.result for o in outs]
    if any(not isinstance(r, dict) or "rtt" not in r for r in res):
        raise SystemExit(f"calibration failed: {[(o.exitcode, str(o.result)[-2000:]) for o in outs]}")
    r0 = res[0]
    cap = capacity()
    c = pingpong_calib(r0["rtt"], r0["post_recv"], r0["post_send"], float(np.mean([r["cpu_per_iter_s"] for r in res])))
    return {**c, "capacity_cores": cap,
            "post_recv_p50_s": float(np.median(r0["post_recv"])), "post_send_p50_s": float(np.median(r0["post_send"])),
            "local": local_costs()}


def summarize(runs: list[dict]) -> list[dict]:
    import numpy as np
    out = []
    for w in sorted({r["world"] for r in runs}):
        for k in dict.fromkeys(r["impl"] for r in runs):
            rs = [r for r in runs if r["world"] == w and r["impl"] == k]
            if not rs:
                continue
            row = {"world": w, "impl": k, "reps": len(rs)}
            for m in ("p50_s", "p99_s", "mean_s"):
                v = [r[m] for r in rs]
                row[m] = {"median": float(np.median(v)), "min": float(min(v)), "max": float(max(v))}
            out.append(row)
    return out


def table(summary: list[dict]) -> str:
    f = lambda d: f"{d['median'] * 1e3:.3f} ({d['min'] * 1e3:.3f}–{d['max'] * 1e3:.3f})"
    lines = ["| ranks | transport | reps | p50 ms (min–max) | p99 ms (min–max) | mean ms |", "|---|---|---|---|---|---|"]
    for r in summary:
        lines.append(f"| {r['world']} | {r['impl']} | {r['reps']} | {f(r['p50_s'])} | {f(r['p99_s'])} | "
                     f"{r['mean_s']['median'] * 1e3:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--impls", nargs="+", default=["gather", "dissemination"])
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--block", type=int, default=50, help="rounds per transport before switching")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--calib", action="store_true", help="also measure the simulator's inputs (2 ranks)")
    ap.add_argument("--out", help="directory for bench.json")
    args = ap.parse_args()
    meta = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "machine": machine(),
            "commit": commit(), "nproc": args.worlds, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "rounds": args.rounds, "block": args.block, "reps": args.reps}
    print(f"machine: {meta['machine']}, load avg {os.getloadavg()[0]:.1f}", flush=True)
    calib = run_calib() if args.calib else None
    runs = run_bench(args.worlds, args.impls, args.rounds, args.warmup, args.block, args.reps)
    summary = summarize(runs)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump({"meta": meta, "summary": summary, "runs": runs, "calib": calib}, f, indent=1)
    if calib:
        import numpy as np
        print(f"calibration: ping-pong round trip p50 {np.median(calib['rtt_s']) * 1e6:.1f} us, p99 "
              f"{np.percentile(calib['rtt_s'], 99) * 1e6:.1f} us; post {calib['post_s'] * 1e6:.1f} us; "
              f"rx {calib['rx_s'] * 1e6:.1f} us")
    print(table(summary), flush=True)


if __name__ == "__main__":
    main()
