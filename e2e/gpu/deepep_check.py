"""Phase-owned DeepEP expert communication on two GPUs (issue 7), against the torch backend.

Two ranks (spawned here), one GPU each, NCCL. Assumes `deep_ep` imports (it is built in the run's
own command from source carried in an ignored folder; neither is committed).
  (a) P (normal, split notify -> permit -> move) dispatch+combine: DeepEP == torch backend (NCCL)
      == single-GPU reference; dispatched rows compared exactly per local expert.
  (b) D (low-latency) the same, decode-sized batches.
  (c) rounds: D low-latency rounds issued between P's notify (layout) and its move (data), and
      while P's data movement is in flight, each phase on its own stream; every round checked.
  (d) run-time audit: buffers (Buffer runtimes' local buffer tensors), counters, workspaces,
      streams, communicators and QP ranges of the two phases disjoint.
  (e) micro-benchmark: LL dispatch+combine latency for decode batches, alone and with a normal-
      mode prefill dispatch in flight on the P stream (CUDA events, medians).
  (f) the LL dispatch/combine captured in a CUDA graph and replayed.
Usage: python -m e2e.gpu tests deepep --out DIR            (two GPUs)
       python -m e2e.gpu tests deepep --backend gloo ...   (CPU: the torch-backend half only)
Writes DIR/rank{0,1}.json as it goes and DIR/deepep_check.json at the end; prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="out/deepep")
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl",
                   help="nccl: one GPU per rank; gloo: CPU (torch backend only, unless --deepep)")
    p.add_argument("--deepep", action="store_true",
                   help="with gloo: run the DeepEP half on CPU too (a stand-in deep_ep and CUDA shims on the path)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--p-tokens", type=int, default=2048, help="P tokens per rank in (a)")
    p.add_argument("--round-p-tokens", type=int, default=1024, help="P tokens per rank in (c)")
    p.add_argument("--ll-max", type=int, default=128, help="D num_max_dispatch_tokens_per_rank")
    p.add_argument("--d-sizes", default="1,8,64,128", help="D tokens per rank in (b)")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--bench-decode", default="1,8,32,64,128")
    p.add_argument("--bench-prefill", default="4096,16384")
    p.add_argument("--bench-iters", type=int, default=40)
    p.add_argument("--tol", type=float, default=2e-2, help="relative (norm) tolerance vs the reference")
    p.add_argument("--timeout", type=float, default=240.0, help="parent kills the ranks after this")
    p.add_argument("--skip", default="", help="comma list of parts to skip: a,b,c,d,e,f")
    return p.parse_args(argv)


def ints(s):
    return [int(v) for v in s.split(",") if v]


# ---------------------------------------------------------------------------------------------
def rank_main(rank: int, args, port: int) -> None:
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)
    R: dict = {"rank": rank, "stages": [], "errors": []}
    path = os.path.join(args.out, f"rank{rank}.json")

    def save():
        with open(path + ".tmp", "w") as f:
            json.dump(R, f, indent=1, default=str)
        os.replace(path + ".tmp", path)

    t0 = time.time()

    def stage(name):
        R["stages"].append([name, round(time.time() - t0, 2)])
        print(f"[r{rank} {time.time() - t0:7.2f}s] {name}", flush=True)
        save()

    try:
        _rank_body(rank, args, port, R, stage)
        stage("done")
    except BaseException as e:  # noqa: BLE001  (recorded, then the process ends hard)
        R["errors"].append(f"{type(e).__name__}: {e}")
        R["traceback"] = traceback.format_exc()
        print(f"[r{rank}] FAILED: {R['traceback']}", flush=True)
        save()
        sys.stdout.flush()
        os._exit(1)
    save()
    sys.stdout.flush()
    os._exit(0)   # never run DeepEP/NVSHMEM destructors at exit (they can hang)


def _rank_body(rank, args, port, R, stage):
    import torch
    import torch.distributed as dist
    from pdrollout.engine.runtime.expert_comm import Phase, TorchExpertComm, disjoint

    gpu = args.backend == "nccl"
    use_deepep = gpu or args.deepep
    W, E, K, H = args.world, args.experts, args.topk, args.hidden
    skip = set(args.skip.split(","))
    if gpu:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        dev = torch.device("cpu")
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W)
    cpu_group = dist.new_group(backend="gloo")
    torch.set_default_device(dev)   # the torch backend allocates with the default device
    bf16, f32 = torch.bfloat16, torch.float32
    dt = bf16 if gpu else f32       # gloo moves f32 (bf16 values, so rows still compare exactly)
    e_local = E // W
    lo = rank * e_local
    scale = 1.0 + torch.arange(E, dtype=f32) / E    # expert e multiplies its rows by scale[e]
    R["config"] = {"world": W, "hidden": H, "experts": E, "topk": K, "backend": args.backend,
                   "torch": torch.__version__,
                   "device": torch.cuda.get_device_name(rank) if gpu else "cpu",
                   "env": {k: os.environ.get(k) for k in sorted(os.environ) if k.startswith(("NVSHMEM", "NCCL"))}}
    stage("init")

    def expert(e_loc, rows):
        return (rows.float() * scale[lo + e_loc]).to(rows.dtype)

    def batch(seed, T):
        g = torch.Generator(device=dev).manual_seed(seed * 7919 + rank)
        x = torch.randn(T, H, generator=g, device=dev).to(bf16)
        gid = rank * T + torch.arange(T, device=dev)          # token id, exact in bf16 as two bytes
        x[:, 0], x[:, 1] = (gid // 256).to(bf16), (gid % 256).to(bf16)
        ids = torch.rand(T, E, generator=g, device=dev).topk(K, dim=1).indices
        w = torch.rand(T, K, generator=g, device=dev)
        ref = x.float() * (w * scale[ids]).sum(1, keepdim=True)
        return x, ids, w, ref

    def rel(a, ref):
        return float((a.float() - ref).norm() / ref.norm().clamp_min(1e-30))

    def canon(rows):   # rows of one expert, ordered by the token id in columns 0, 1
        rows = rows.float()
        return rows[(rows[:, 0] * 256 + rows[:, 1]).argsort()]

    def rows_torch(recv, meta, e):
        return recv[meta.expert_ids == e]

    def rows_normal(recv, meta, e):
        return recv[(meta.expert_ids == e).any(dim=1)]

    def rows_ll(recv, meta, e):
        return recv[e, :int(meta.counts[e])]

    def same_rows(ra, rb):
        return all(ra[e].shape == rb[e].shape and torch.equal(canon(ra[e]), canon(rb[e])) for e in range(e_local))

    def run_torch(tc, phase, x, ids, w):
        recv, meta, h = tc.dispatch(phase, x.to(dt), ids, w.to(dt))
        rows = [rows_torch(recv, meta, e) for e in range(e_local)]
        return rows, tc.combine(phase, tc.apply_experts(recv, meta, expert), h)

    ep_ranks = [list(range(W))]
    tc = TorchExpertComm(ep_ranks, rank, E, H, max_tokens=args.p_tokens, topk=K, dtype=dt, d_max_tokens=args.ll_max)
    R["torch_disjoint"] = disjoint(tc.state(Phase.PREFILL), tc.state(Phase.DECODE))
    stage("torch backend up")

    de = None
    if use_deepep:
        from pdrollout.engine.runtime.deepep_comm import DeepEPExpertComm
        t = time.time()
        de = DeepEPExpertComm(ep_ranks, rank, E, H, max_tokens=max(args.p_tokens, args.round_p_tokens), topk=K,
                              dtype=bf16, d_max_tokens=args.ll_max, device=dev)
        R["deepep_init_s"] = round(time.time() - t, 2)
        stage("deepep buffers up (P normal + D low-latency)")
        if "d" not in skip:  # (d) before anything moves, so it is on record whatever follows
            R["audit"] = de.audit()
            stage(f"(d) audit: {len(R['audit']['problems'])} problems")

    P, D = Phase.PREFILL, Phase.DECODE

    def guarded(name, fn):
        """Run one part; a Python-level failure is recorded and the next part still runs."""
        if name in skip:
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            R["errors"].append(f"({name}) {type(e).__name__}: {e}")
            R[f"{name}_traceback"] = traceback.format_exc()
            stage(f"({name}) FAILED: {type(e).__name__}: {e}")
            if de is not None:   # a part that died mid-dispatch leaves its P buffer pending
                torch.cuda.synchronize()
                de.state(P).status[:] = ["free"] * len(de.state(P).status)

    # ---- (a) P normal path -------------------------------------------------------------
    def part_a():
        res = []
        for seed in range(3):
            x, ids, w, ref = batch(100 + seed, args.p_tokens)
            rows_t, out_t = run_torch(tc, P, x, ids, w)
            r = {"seed": seed, "torch_vs_ref": rel(out_t, ref)}
            if de is not None:
                with torch.cuda.stream(de.p_stream):
                    de.p_stream.wait_stream(torch.cuda.default_stream(dev))
                    pend = de.notify(P, x, ids, w)
                    r["send_counts"] = de.wait_counts(pend)
                    de.wait_permit(pend, lambda: None)
                    recv, meta, h = de.move(pend)
                    rows_d = [rows_normal(recv, meta, e) for e in range(e_local)]
                    out_d = de.combine(P, de.apply_experts(recv, meta, expert), h)
                torch.cuda.default_stream(dev).wait_stream(de.p_stream)
                r.update(dispatch_equal=same_rows(rows_t, rows_d), deepep_vs_ref=rel(out_d, ref),
                         deepep_vs_torch=rel(out_d, out_t.float()), recv_rows=int(recv.shape[0]),
                         recv_per_expert=meta.counts)
            res.append(r)
        R["a"] = res
        stage(f"(a) P: {res}")
    guarded("a", part_a)

    # ---- (b) D low-latency path --------------------------------------------------------
    def part_b():
        res = []
        for T in ints(args.d_sizes):
            x, ids, w, ref = batch(200 + T, T)
            rows_t, out_t = run_torch(tc, D, x, ids, w)
            r = {"tokens": T, "torch_vs_ref": rel(out_t, ref)}
            if de is not None:
                with torch.cuda.stream(de.d_stream):
                    de.d_stream.wait_stream(torch.cuda.default_stream(dev))
                    recv, meta, h = de.dispatch(D, x, ids, w)
                    rows_d = [rows_ll(recv, meta, e) for e in range(e_local)]
                    out_d = de.combine(D, de.apply_experts(recv, meta, expert), h)
                    r.update(dispatch_equal=same_rows(rows_t, rows_d), deepep_vs_ref=rel(out_d, ref),
                             deepep_vs_torch=rel(out_d, out_t.float()), recv_per_expert=meta.counts.tolist())
            res.append(r)
        R["b"] = res
        stage(f"(b) D: {res}")
    guarded("b", part_b)

    if de is None:
        return

    # ---- (c) interleaved rounds ----------------------------------------------------------
    def part_c():
        errs_p, errs_d, t = [], [], time.time()
        d_sizes = [min(n, args.ll_max) for n in (1, 3, 8, 17, 32, 64, 100, args.ll_max)]

        def d_round(seed):
            with torch.cuda.stream(de.d_stream):
                x, ids, w, ref = batch(seed, d_sizes[seed % len(d_sizes)])
                recv, meta, h = de.dispatch(D, x, ids, w)
                out = de.combine(D, de.apply_experts(recv, meta, expert), h)
                errs_d.append(((out.float() - ref).norm() / ref.norm()).reshape(1))

        for i in range(args.rounds):
            with torch.cuda.stream(de.p_stream):
                xp, idp, wp, refp = batch(10_000 + i, args.round_p_tokens)
                pend = de.notify(P, xp, idp, wp)        # layout on P's stream
            d_round(20_000 + 3 * i)                     # D between P's notify and its data movement
            d_round(20_000 + 3 * i + 1)
            de.wait_permit(pend, lambda: None)
            with torch.cuda.stream(de.p_stream):
                recv, meta, h = de.move(pend)           # P data kernel enqueued on P's comm stream
            d_round(20_000 + 3 * i + 2)                 # D while P's data movement is in flight
            with torch.cuda.stream(de.p_stream):
                out = de.combine(P, de.apply_experts(recv, meta, expert), h)
                errs_p.append(((out.float() - refp).norm() / refp.norm()).reshape(1))
        torch.cuda.synchronize()
        ep_, ed_ = torch.cat(errs_p), torch.cat(errs_d)
        R["c"] = {"rounds": args.rounds, "d_rounds": int(ed_.numel()), "p_max_rel": float(ep_.max()),
                  "d_max_rel": float(ed_.max()), "p_bad": int((ep_ > args.tol).sum()),
                  "d_bad": int((ed_ > args.tol).sum()), "seconds": round(time.time() - t, 2)}
        stage(f"(c) interleaved: {R['c']}")
        R["audit_after"] = de.audit()["problems"]
    guarded("c", part_c)

    # ---- (e) micro-benchmark -------------------------------------------------------------
    def part_e():
        R["e"] = bench(torch, dist, de, batch, args, dev, cpu_group, P, D)
        stage("(e) bench")
    guarded("e", part_e)

    # ---- (f) LL inside a CUDA graph --------------------------------------------------------
    def part_f():
        try:
            T = 64
            sc_local = scale[lo:lo + e_local].to(bf16)[:, None, None]
            with torch.cuda.stream(de.d_stream):
                x, ids, w, ref = batch(30_000, T)
                recv, meta, h = de.dispatch(D, x, ids, w)   # eager warm-up
                de.combine(D, recv * sc_local, h)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=de.d_stream):
                recv, meta, h = de.dispatch(D, x, ids, w)
                out = de.combine(D, recv * sc_local, h)
            errs = []
            for _ in range(3):
                out.zero_()
                dist.barrier(group=cpu_group)
                g.replay()
                torch.cuda.synchronize()
                errs.append(rel(out, ref))
            R["f"] = {"tokens": T, "replay_rel": errs}
        except Exception as e:  # noqa: BLE001
            R["f"] = {"error": f"{type(e).__name__}: {e}"}
        stage(f"(f) graph: {R['f']}")
    guarded("f", part_f)

    dist.barrier(group=cpu_group)


def bench(torch, dist, de, batch, args, dev, cpu_group, P, D):
    def med(xs):
        return round(statistics.median(xs), 2) if xs else None

    n_it, warm = args.bench_iters, 5
    out = {"decode": ints(args.bench_decode), "prefill": ints(args.bench_prefill), "iters": n_it, "rows": []}
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    prefill = {}
    for tp in out["prefill"]:
        with torch.cuda.stream(de.p_stream):
            xp, idp, wp, _ = batch(40_000 + tp, tp)
        prefill[tp] = (xp, idp, wp)
    torch.cuda.synchronize()
    # P alone: normal dispatch and combine times per prefill size
    out["p_alone_us"] = {}
    for tp, (xp, idp, wp) in prefill.items():
        ds, cs = [], []
        for it in range(warm + n_it // 2):
            a, b, c = ev(), ev(), ev()
            with torch.cuda.stream(de.p_stream):
                pend = de.notify(P, xp, idp, wp)
                pend.permitted = True
                a.record()
                recv, meta, h = de.move(pend)
                b.record()
                de.combine(P, recv, h)
                c.record()
            if it >= warm:
                ds.append((a, b)), cs.append((b, c))
        torch.cuda.synchronize()
        out["p_alone_us"][tp] = {"dispatch": med([1e3 * x.elapsed_time(y) for x, y in ds]),
                                 "combine": med([1e3 * x.elapsed_time(y) for x, y in cs])}
    for n in out["decode"]:
        with torch.cuda.stream(de.d_stream):
            x, ids, w, _ = batch(50_000 + n, n)
        torch.cuda.synchronize()

        def ll_round():
            s, e = ev(), ev()
            with torch.cuda.stream(de.d_stream):
                s.record()
                recv, meta, h = de.dispatch(D, x, ids, w)
                de.combine(D, recv, h)
                e.record()
            return s, e

        dist.barrier(group=cpu_group)
        pairs = [ll_round() for _ in range(warm + n_it)][warm:]
        torch.cuda.synchronize()
        row = {"decode_tokens": n, "alone_us": med([1e3 * s.elapsed_time(e) for s, e in pairs])}
        for tp, (xp, idp, wp) in prefill.items():
            lat, overlap, pdur = [], 0, []
            dist.barrier(group=cpu_group)
            for it in range(warm + n_it):
                a, b = ev(), ev()
                with torch.cuda.stream(de.p_stream):
                    pend = de.notify(P, xp, idp, wp)
                    pend.permitted = True
                    a.record()
                    recv, meta, h = de.move(pend)   # returns once counts arrived; data kernel in flight
                    b.record()
                s, e = ll_round()
                with torch.cuda.stream(de.p_stream):
                    de.combine(P, recv, h)
                if it >= warm:
                    lat.append((s, e)), pdur.append((a, b))
            torch.cuda.synchronize()
            lat_us = [1e3 * s.elapsed_time(e) for s, e in lat]
            # the LL round started before P's dispatch finished (b after s) = it overlapped P's data movement
            overlap = sum(1 for (s, e), (a, b) in zip(lat, pdur) if s.elapsed_time(b) > 0)
            row[f"with_p{tp}_us"] = med(lat_us)
            row[f"with_p{tp}_p90_us"] = round(sorted(lat_us)[int(0.9 * (len(lat_us) - 1))], 2)
            row[f"p{tp}_dispatch_us"] = med([1e3 * a.elapsed_time(b) for a, b in pdur])
            row[f"p{tp}_overlapped"] = f"{overlap}/{len(lat)}"
        out["rows"].append(row)
        print(f"[bench r{dist.get_rank()}] {row}", flush=True)
    return out


# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table(r0: dict) -> str:
    e = r0.get("e")
    if not e:
        return "(no benchmark)"
    cols = ["decode_tokens", "alone_us"] + [c for tp in e["prefill"]
                                            for c in (f"with_p{tp}_us", f"p{tp}_dispatch_us", f"p{tp}_overlapped")]
    lines = ["LL dispatch+combine latency, rank 0, medians of %d (us)" % e["iters"], " | ".join(cols)]
    for row in e["rows"]:
        lines.append(" | ".join(str(row.get(c)) for c in cols))
    lines.append("P alone (us): " + json.dumps(e.get("p_alone_us")))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)
    os.makedirs(args.out, exist_ok=True)
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, args, port)) for r in range(args.world)]
    for p in procs:
        p.start()
    deadline = time.time() + args.timeout
    for p in procs:
        p.join(max(0.0, deadline - time.time()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
    ranks = []
    for r in range(args.world):
        try:
            with open(os.path.join(args.out, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        except (OSError, ValueError):
            ranks.append({"rank": r, "errors": ["no result file"]})
    verdict = judge(ranks, args, hung, [p.exitcode for p in procs])
    summary = {"args": vars(args), "hung": hung, "exitcodes": [p.exitcode for p in procs], "verdict": verdict,
               "ranks": ranks}
    with open(os.path.join(args.out, "deepep_check.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(json.dumps(verdict, indent=1))
    print(table(ranks[0]))
    return 0 if verdict["ok"] else 1


def judge(ranks, args, hung, codes) -> dict:
    v: dict = {"hung": hung, "exitcodes": codes}
    fails = []
    for R in ranks:
        r = R.get("rank")
        fails += [f"r{r}: {e}" for e in R.get("errors", [])]
        for part in ("a", "b"):
            for x in R.get(part, []):
                for k in ("torch_vs_ref", "deepep_vs_ref", "deepep_vs_torch"):
                    if k in x and not x[k] <= args.tol:
                        fails.append(f"r{r} ({part}) {k}={x[k]:.3g} > {args.tol}")
                if x.get("dispatch_equal") is False:
                    fails.append(f"r{r} ({part}) dispatched rows differ from the torch backend's")
        c = R.get("c")
        if c and (c["p_bad"] or c["d_bad"]):
            fails.append(f"r{r} (c) bad rounds P {c['p_bad']} D {c['d_bad']}")
        a = R.get("audit")
        if a and a["problems"]:
            fails.append(f"r{r} (d) {a['problems']}")
        if R.get("audit_after"):
            fails.append(f"r{r} (d, after) {R['audit_after']}")
        if R.get("torch_disjoint"):
            fails.append(f"r{r} torch backend not disjoint: {R['torch_disjoint']}")
        f = R.get("f")
        if f and ("error" in f or max(f["replay_rel"]) > args.tol):
            fails.append(f"r{r} (f) {f}")
        v[f"r{r}_last_stage"] = (R.get("stages") or [["none"]])[-1][0]
    if hung:
        fails.append(f"ranks {hung} hung past {args.timeout}s")
    v["failures"], v["ok"] = fails, not fails and all(c == 0 for c in codes)
    return v


if __name__ == "__main__":
    sys.exit(main())
