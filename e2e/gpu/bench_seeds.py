"""`pdrollout bench` over several trace seeds and engine variants, spread over the GPUs of one host,
then one table: each figure the median over the seeds with the min–max beside it (issue 19).

A job is (variant, pressure, seed, mode): one `pdrollout bench` of one mode (a fresh server) pinned to
one GPU by CUDA_VISIBLE_DEVICES; each GPU takes the next job when its last one ends. Ratios are taken per seed against
the `normal` and `mixed` of the baseline variant (the first one, which must run both) in the same
call, then summarized.

    python -m e2e.gpu bench seeds OUT --seeds 0,1,2,3,4 --pressures P1,trace \
        --variant base:normal,mixed,pd:{} --variant overlap:pd:'{"solo_overlap": true}' [--gpus 0,1]
    python -m e2e.gpu bench seeds OUT --summarize      # the table again from OUT
    ... --step-logs                                      # each server's step log under OUT/.../steps
    ... --reuse-server                                   # one server per (variant, mode) for all its runs
    ... --skip-existing                                  # only jobs without results in OUT (resume)
    --variant fp8:pd:'{"weights": "fp8"}'               # block-FP8 weights (a config with
                                                         # quantization_config); "weights" is not an
                                                         # engine field: FP8 is read from the model
    --variant mtp:pd:'{"speculative": "mtp", "speculative_k": 2}'
                                                         # the model declares an MTP head (random
                                                         # weights build it); "mtp_layers": N sets
                                                         # its depth (default 1 under mtp, else 0)
    --variant cp:pd:'{"priority": "critical-path", "control": {"p_gather_ms": 100}}'
                                                         # the client sends each turn its trajectory's
                                                         # work left as /generate's priority
    --variant pin:mixed:'{"cpus": "0-7"}'                # (--reuse-server) the server's process tree
                                                         # pinned to CPUs 0-7; its log line reads the
                                                         # affinity back from the running server

--reuse-server: a (variant, mode) keeps one server for every (pressure, seed), its prefix cache
flushed between runs, as a rollout server serves one rollout after another; it saves a server start
(~19 s of a ~45 s P1 run on the H200) per run. Without it each run gets a fresh server.
--blocks N (with --reuse-server): the seeds are cut into N blocks, each with servers of its own, and
the (variant, mode) order is reversed in every other block (normal, mixed, pd, then pd, mixed,
normal): whatever drifts over a call (clocks, heat) falls on every mode alike, not on the last one.
--topology NPROC/ADP/EP: each engine on NPROC GPUs (`pdrollout serve --nproc --adp --ep`), e.g. 2/2/2 for
EP2/ADP2 on two GPUs; --gpus is then cut into groups of NPROC, one engine per group at a time.
    DEVICE=cpu ... --preset tiny                         # dry run on CPU
    ... --reuse-server --py-spy 15 --variant spy:pd:{}   # each run's server sampled by py-spy (native
                                                         # frames) into its pyspy.txt; the figures of a
                                                         # sampled run are perturbed (no baseline needed);
                                                         # python -m e2e.gpu profile spy .../pyspy.txt
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdrollout.engine.workload.servers import parse_cpus
from pdrollout.engine.workload.trace import PRIORITY_HINTS

# no kv_cache_bytes: one GPU's engine sizes its cache from the memory it finds free (kv_mem_fraction,
# runtime/kv_sizing.py); several ranks do not measure, so their engines get MULTI_RANK_KV_BYTES
BASE_CONFIG = {"random_weights": True, "dtype": "bfloat16", "max_running": 64}
MULTI_RANK_KV_BYTES = 40 << 30
MEASURES = ("makespan_s", "median_ttft_ms", "p99_ttft_ms", "mean_decode_wait_ms", "mean_decode_step_ms",
            "mean_decode_step_beside_p_ms", "jit_compiles")


def parse_variant(text: str) -> dict:
    """NAME[@PRESSURE,...]:MODES:ENGINE_CONFIG_JSON (@: only at those pressures); the JSON's
    "weights" ("bf16" or "fp8") picks the model's weights and "priority" the hint the client sends
    (`pdrollout bench --priority`), "cpus" ("0-7,16") the CPUs the server's process tree is pinned
    to (--reuse-server), the rest are EngineConfig fields."""
    name, modes, extra = text.split(":", 2)
    name, _, only = name.partition("@")
    extra = json.loads(extra or "{}")
    weights = extra.pop("weights", "bf16")
    if weights not in ("bf16", "fp8"):
        raise ValueError(f"variant {name}: weights must be 'bf16' or 'fp8', got {weights!r}")
    priority = extra.pop("priority", "none")
    if priority not in PRIORITY_HINTS:
        raise ValueError(f"variant {name}: priority must be one of {', '.join(PRIORITY_HINTS)}, got {priority!r}")
    cpus = extra.pop("cpus", None)
    if cpus is not None:   # refused before anything runs
        try:
            parse_cpus(str(cpus))
        except ValueError as e:
            raise ValueError(f"variant {name}: {e}") from None
    mtp = extra.pop("mtp_layers", 1 if extra.get("speculative") == "mtp" else 0)
    if not isinstance(mtp, int) or mtp < 0:
        raise ValueError(f"variant {name}: mtp_layers must be an integer >= 0, got {mtp!r}")
    return {"name": name, "modes": modes, "extra": extra, "weights": weights, "mtp_layers": mtp,
            "priority": priority, "cpus": cpus, "pressures": only.split(",") if only else None}


def model_dir(args, variant: dict) -> str:
    """One model directory per (weights, MTP depth): the baseline's is `--model` itself."""
    weights, mtp = variant.get("weights", "bf16"), variant.get("mtp_layers", 0)
    return args.model + ("" if weights == "bf16" else f"-{weights}") + (f"-mtp{mtp}" if mtp else "")


def write_model(path: Path, layers: int, preset: str, weights: str = "bf16", mtp_layers: int = 0) -> None:
    from pdrollout.engine.protocol.config import load_preset
    cfg = load_preset(preset)
    if layers:
        cfg["num_hidden_layers"] = layers
    if weights == "fp8":   # random e4m3 weights with block scales, as FP8 releases declare them
        from pdrollout.engine.model.checkpoint import FP8_CONFIG
        cfg["quantization_config"] = dict(FP8_CONFIG)
    if mtp_layers:         # Qwen3-Next/DeepSeek's key: the checkpoint has mtp.* layers
        cfg["num_nextn_predict_layers"] = mtp_layers
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))


def engine_config(variant: dict, kv_cache_bytes: int | None = None, nproc: int = 1) -> dict:
    """`kv_cache_bytes`: --kv-cache-bytes (None: one GPU sizes its own; several get MULTI_RANK_KV_BYTES)."""
    if kv_cache_bytes is None and nproc > 1 and os.environ.get("DEVICE") != "cpu":
        kv_cache_bytes = MULTI_RANK_KV_BYTES
    config = {**BASE_CONFIG, **({"kv_cache_bytes": kv_cache_bytes} if kv_cache_bytes else {}), **variant["extra"]}
    if os.environ.get("DEVICE") == "cpu":
        config["dtype"] = "float32"
    return config


def device() -> str:
    return "cpu" if os.environ.get("DEVICE") == "cpu" else "cuda"


def parse_topology(text: str) -> tuple[int, int, int]:
    """NPROC/ADP/EP as `pdrollout serve` takes them (it checks how they fit together)."""
    try:
        nproc, adp, ep = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--topology takes NPROC/ADP/EP, e.g. 2/2/2; got {text!r}") from None
    if min(nproc, adp, ep) < 1:
        raise ValueError(f"--topology: NPROC, ADP and EP are >= 1; got {text!r}")
    return nproc, adp, ep


def topology_args(topology: tuple[int, int, int]) -> list[str]:
    nproc, adp, ep = topology
    return [] if nproc == 1 else ["--nproc", str(nproc), "--adp", str(adp), "--ep", str(ep)]


def gpu_groups(gpus: str, nproc: int) -> list[str | None]:
    """One CUDA_VISIBLE_DEVICES value per engine that may run at once: --gpus cut into groups of
    NPROC (none given: the engine sees every GPU, one at a time)."""
    if not gpus:
        return [None]
    ids = gpus.split(",")
    if len(ids) % nproc:
        raise ValueError(f"--gpus {gpus} does not cut into engines of {nproc} GPUs")
    return [",".join(ids[i:i + nproc]) for i in range(0, len(ids), nproc)]


def gpu_env(gpu: str | None) -> dict:
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def job_dir(args, job: dict) -> Path:
    return Path(args.out) / job["variant"]["name"] / f"{job['pressure']}-s{job['seed']}" / job["mode"]


def spy_command(pid: int, path: Path, seconds: int) -> list[str]:
    """py-spy's --duration is whole seconds: "15.0" makes it panic before it samples anything."""
    if not isinstance(seconds, int) or seconds < 1:
        raise ValueError(f"py-spy samples whole seconds >= 1, got {seconds!r}")
    return ["py-spy", "record", "-p", str(pid), "--native", "--threads", "-r", "100",
            "-d", str(seconds), "-f", "raw", "-o", str(path)]


def profile_server(pid: int, out: Path, args) -> threading.Thread:
    """--py-spy: the server's threads sampled with native frames (CUDA driver calls, the GIL) for
    args.py_spy seconds from args.py_spy_delay on, as folded stacks in OUT/.../pyspy.txt
    (`profile spy` reads them). Sampling pauses the process: that run's figures are not
    comparable, so a profiled variant gets its own name."""
    def record():
        time.sleep(args.py_spy_delay)
        cmd = spy_command(pid, out / "pyspy.txt", args.py_spy)
        with open(out / "pyspy.log", "w") as f:
            try:
                subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.py_spy + 60)
            except (OSError, subprocess.TimeoutExpired) as e:
                f.write(f"py-spy failed: {e}\n")
    th = threading.Thread(target=record, daemon=True)
    th.start()
    return th


def run_job(job: dict, gpu: str | None, args, log, url: str | None = None, pid: int | None = None) -> None:
    """One `pdrollout bench` of one mode: on a fresh server, or on the one at `url` (--reuse-server,
    whose process is `pid`)."""
    out = job_dir(args, job)
    cmd = ["pdrollout", "bench", "--modes", job["mode"], "--preset", args.preset, "--seed", str(job["seed"]),
           "--pressure", job["pressure"], "--no-progress", "--no-plots", "--out", str(out),
           "--priority", job["variant"].get("priority", "none")]
    if url:
        cmd += ["--url", url]
    else:
        cmd += ["--model", model_dir(args, job["variant"]), "--device", device(), "--serve-arg=--engine-config",
                f"--serve-arg={json.dumps(engine_config(job['variant'], args.kv_cache_bytes, args.topology[0]))}"]
        cmd += [f"--serve-arg={a}" for a in topology_args(args.topology)]
        if args.step_logs:   # the server's per-step log (plan sizes, epochs, wall time) beside the results
            cmd += ["--serve-arg=--step-log", f"--serve-arg={out / 'steps'}"]
    env = gpu_env(gpu)
    t = time.time()
    out.mkdir(parents=True, exist_ok=True)
    spy = profile_server(pid, out, args) if args.py_spy and pid else None
    with open(out / "bench.log", "w") as f:
        try:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.job_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if spy:
        spy.join()
    log(f"gpu {gpu} {job['variant']['name']} {job['pressure']} seed {job['seed']} {job['mode']}: rc {rc} "
        f"in {time.time() - t:.0f} s")


def reset(url: str, timeout_s: float = 30.0) -> None:
    """Between two runs on one server: whatever a failed run left is aborted, and no prefix of the
    last run may be a hit in the next (the prefix cache is flushed once nothing holds KV)."""
    import urllib.error
    import urllib.request

    def post(path: str, body: dict) -> int:
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
    post("/abort_request", {"abort_all": True})
    deadline = time.monotonic() + timeout_s
    while post("/flush_cache", {}) != 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: cache not flushed after {timeout_s:.0f} s (requests still running)")
        time.sleep(0.2)


def run_server_job(jobs: list[dict], gpu: str | None, args, log) -> None:
    """--reuse-server: one server for the jobs of one (variant, mode), run in turn; a server that
    died is started again for the jobs left."""
    from pdrollout.engine.workload.servers import serve
    variant, mode = jobs[0]["variant"], jobs[0]["mode"]
    # Named by the seeds the server runs, in order: a later call on other seeds (--skip-existing)
    # writes logs of its own beside these instead of over them (step_costs.py reads the seeds back)
    tag = f"{mode}-s" + "-".join(str(j["seed"]) for j in jobs)
    extra = ("--engine-config", json.dumps(engine_config(variant, args.kv_cache_bytes, args.topology[0])),
             *topology_args(args.topology))
    if args.step_logs:
        extra += ("--step-log", str(Path(args.out) / variant["name"] / f"steps-{tag}"))
    log_path = Path(args.out) / variant["name"] / f"server-{tag}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    left = list(jobs)
    while left:
        t = time.time()
        cpus = parse_cpus(str(variant["cpus"])) if variant["cpus"] is not None else None
        with serve(model_dir(args, variant), mode, str(log_path), device=device(), extra_args=extra, env=gpu_env(gpu),
                   cpus=cpus) as live:
            # the affinity the running server has, read back (not the one asked for)
            on = ",".join(map(str, sorted(os.sched_getaffinity(live.proc.pid)))) if cpus else "any"
            log(f"gpu {gpu} {variant['name']} {mode}: server up in {time.time() - t:.0f} s on cpus {on}")
            first = True
            while left and live.died() is None:
                if not first:
                    reset(live.url)
                run_job(left.pop(0), gpu, args, log, url=live.url, pid=live.proc.pid)
                first = False


def seed_blocks(seeds: list[int], n: int) -> list[list[int]]:
    """The seeds in n contiguous blocks as even as they go (the first ones one longer)."""
    n = max(1, min(n, len(seeds)))
    size, extra = divmod(len(seeds), n)
    out, at = [], 0
    for b in range(n):
        out.append(seeds[at:at + size + (b < extra)])
        at += len(out[-1])
    return out


def server_groups(jobs: list[dict], seeds: list[int], blocks: int) -> list[list[dict]]:
    """--reuse-server's units in run order: per block of seeds, one group per (variant, mode), the
    largest first; every other block in reverse. Each job says its block."""
    order = []
    for b, block in enumerate(seed_blocks(seeds, blocks)):
        groups: dict = {}
        for j in jobs:
            if j["seed"] in block:
                groups.setdefault((j["variant"]["name"], j["mode"]), []).append({**j, "block": b})
        ranked = sorted(groups.values(), key=len, reverse=True)
        order += ranked[::-1] if b % 2 else ranked
    return order


def run_all(args, variants: list[dict]) -> None:
    jobs = [{"variant": v, "pressure": p, "seed": s, "mode": m}
            for s in args.seeds for p in args.pressures for v in variants for m in v["modes"].split(",")
            if v["pressures"] is None or p in v["pressures"]]
    if args.skip_existing:   # resume: a job whose results are in OUT already is not run again
        done = [j for j in jobs if (job_dir(args, j) / "results.json").exists()]
        jobs = [j for j in jobs if j not in done]
        print(f"{len(done)} jobs have results in {args.out} already: skipped", flush=True)
    jobs.sort(key=lambda j: j["pressure"] != "trace")   # the long ones first: the GPUs end together
    q: queue.Queue = queue.Queue()
    if args.reuse_server:   # a unit of work is a (variant, mode) and its runs in one block of seeds
        for g in server_groups(jobs, args.seeds, args.blocks):
            q.put(g)
    else:
        for j in jobs:
            q.put(j)
    lock = threading.Lock()

    def log(msg):
        with lock:
            print(msg, flush=True)

    def worker(gpu):
        while True:
            try:
                job = q.get_nowait()
            except queue.Empty:
                return
            try:
                run_server_job(job, gpu, args, log) if args.reuse_server else run_job(job, gpu, args, log)
            except Exception as e:   # a server that never came up: said, and the other GPUs go on
                log(f"gpu {gpu}: {type(e).__name__}: {str(e)[:2000]}")

    gpus = gpu_groups(args.gpus, args.topology[0])
    threads = [threading.Thread(target=worker, args=(g,)) for g in gpus]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def spread(xs: list[float]) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def add_invocation(path: Path, meta: dict) -> dict:
    """OUT's meta: the first invocation's, each later one (a resume, more variants) appended under
    "invocations" with its own command, commit and variants."""
    if not path.exists():
        return {**meta, "invocations": []}
    first = json.loads(path.read_text())
    first.setdefault("invocations", []).append(meta)
    return first


def summarize(out: Path) -> dict:
    """{pressure: {variant/mode: {measure: spread, 'vs_normal': spread, 'vs_mixed': spread, seeds}}}."""
    runs = {}   # (variant, pressure, seed) -> modes
    for res in sorted(out.glob("*/*-s*/*/results.json")):
        variant, tail = res.parent.parent.parent.name, res.parent.parent.name
        pressure, seed = tail.rsplit("-s", 1)
        runs.setdefault((variant, pressure, int(seed)), {}).update(json.loads(res.read_text())["modes"])
    meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {}
    base = meta.get("variants", [{}])[0].get("name", "base")
    table: dict = {}
    for (variant, pressure, seed), modes in sorted(runs.items()):
        ref = runs.get((base, pressure, seed), {})
        for mode, r in modes.items():
            row = table.setdefault(pressure, {}).setdefault(f"{variant}/{mode}", {"per_seed": {}})
            per = {m: r.get(m) for m in MEASURES}
            for against in ("normal", "mixed"):
                if against in ref:
                    per[f"makespan_vs_{against}"] = r["makespan_s"] / ref[against]["makespan_s"]
                    per[f"p99_ttft_vs_{against}"] = r["p99_ttft_ms"] / ref[against]["p99_ttft_ms"]
                    if r.get("mean_decode_step_ms") and ref[against].get("mean_decode_step_ms"):
                        per[f"decode_step_vs_{against}"] = r["mean_decode_step_ms"] / ref[against]["mean_decode_step_ms"]
            row["per_seed"][seed] = per
    for rows in table.values():
        for row in rows.values():
            keys = sorted({k for per in row["per_seed"].values() for k in per})
            for k in keys:
                row[k] = spread([per.get(k) for per in row["per_seed"].values()])
    return {"meta": meta, "table": table}


def compiles(row: dict) -> str:
    """Triton compiles in served steps over the seeds (each a stall; runs from before the engine
    counted them: –)."""
    n = [per.get("jit_compiles") for per in row["per_seed"].values()]
    return "–" if all(c is None for c in n) else str(sum(c or 0 for c in n))


def markdown(summary: dict) -> str:
    def cell(s, fmt):
        return "–" if s is None else f"{fmt(s['median'])} ({fmt(s['min'])}–{fmt(s['max'])})"
    lines = []
    for pressure, rows in summary["table"].items():
        lines += [f"**{pressure}** (median over seeds, min–max)", "",
                  "| variant/mode | seeds | makespan s | vs normal | vs mixed | p50 TTFT ms | p99 TTFT ms "
                  "| p99 TTFT vs normal | D wait ms | D-only step ms | of it beside P ms | kernel compiles |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, row in rows.items():
            r2 = lambda x: f"{x:.3f}"
            lines.append(f"| {name} | {len(row['per_seed'])} | {cell(row.get('makespan_s'), lambda x: f'{x:.2f}')} | "
                         f"{cell(row.get('makespan_vs_normal'), r2)} | {cell(row.get('makespan_vs_mixed'), r2)} | "
                         f"{cell(row.get('median_ttft_ms'), lambda x: f'{x:.0f}')} | "
                         f"{cell(row.get('p99_ttft_ms'), lambda x: f'{x:.0f}')} | {cell(row.get('p99_ttft_vs_normal'), r2)} | "
                         f"{cell(row.get('mean_decode_wait_ms'), lambda x: f'{x:.2f}')} | "
                         f"{cell(row.get('mean_decode_step_ms'), lambda x: f'{x:.2f}')} | "
                         f"{cell(row.get('mean_decode_step_beside_p_ms'), lambda x: f'{x:.2f}')} | "
                         f"{compiles(row)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--pressures", default="P1")
    ap.add_argument("--variant", action="append", default=[], help="NAME[@PRESSURES]:MODES:ENGINE_CONFIG_JSON")
    ap.add_argument("--gpus", default="", help="comma list; one job per GPU (per NPROC GPUs) at a time")
    ap.add_argument("--topology", default="1/1/1", help="NPROC/ADP/EP of each engine (2/2/2: EP2/ADP2 on two GPUs)")
    ap.add_argument("--preset", default="gpu")
    ap.add_argument("--model-preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the preset's)")
    ap.add_argument("--model", default="/tmp/pdrollout-bench-model")
    ap.add_argument("--kv-cache-bytes", type=int, default=None,
                    help="every engine's KV cache (default: one GPU sizes it from its free memory, "
                         f"several ranks {MULTI_RANK_KV_BYTES >> 30} GiB)")
    ap.add_argument("--job-timeout", type=float, default=600)
    ap.add_argument("--step-logs", action="store_true", help="each server writes its step log under OUT")
    ap.add_argument("--reuse-server", action="store_true",
                    help="one server per (variant, mode) for all its runs, prefix cache flushed between")
    ap.add_argument("--blocks", type=int, default=1,
                    help="with --reuse-server: cut the seeds into N blocks, servers of their own, mode order "
                         "reversed in every other block (drift over the call falls on every mode)")
    ap.add_argument("--skip-existing", action="store_true",
                    help="run only the jobs without results in OUT (resume a run cut short)")
    ap.add_argument("--summarize", action="store_true", help="only rebuild the table from OUT")
    ap.add_argument("--py-spy", type=int, default=0, metavar="SECONDS",
                    help="with --reuse-server: sample each run's server with py-spy (native frames) for "
                         "SECONDS into its pyspy.txt (perturbs that run: give the variant its own name)")
    ap.add_argument("--py-spy-delay", type=float, default=5.0, help="seconds into each run before sampling")
    args = ap.parse_args()
    out = Path(args.out)
    if not args.summarize:
        try:
            variants = [parse_variant(v) for v in args.variant] or [parse_variant("base:normal,mixed,pd:{}")]
        except ValueError as e:
            ap.error(str(e))
        if args.py_spy and not args.reuse_server:
            ap.error("--py-spy needs --reuse-server (the server's process is then this script's child)")
        if any(v["cpus"] is not None for v in variants) and not args.reuse_server:
            ap.error('a variant\'s "cpus" pins its server: needs --reuse-server (else `pdrollout bench` starts it)')
        if args.blocks > 1 and not args.reuse_server:
            ap.error("--blocks orders the servers of --reuse-server (without it every run has its own)")
        if not args.py_spy and not {"normal", "mixed"} <= set(variants[0]["modes"].split(",")):
            ap.error("the first variant is the baseline: it must run normal and mixed")
        try:
            args.topology = parse_topology(args.topology)
            gpu_groups(args.gpus, args.topology[0])
        except ValueError as e:
            ap.error(str(e))
        args.seeds = [int(s) for s in args.seeds.split(",")]
        args.pressures = args.pressures.split(",")
        for weights, mtp in sorted({(v["weights"], v["mtp_layers"]) for v in variants}):
            write_model(Path(model_dir(args, {"weights": weights, "mtp_layers": mtp})), args.layers,
                        args.model_preset, weights, mtp)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"command": " ".join(sys.argv), "commit": os.environ.get("COMMIT", "unknown"),
                "machine": os.environ.get("MACHINE", "unknown"), "seeds": args.seeds,
                "pressures": args.pressures, "preset": args.preset, "model_preset": args.model_preset,
                "nproc": args.topology[0],
                "topology": (f"{args.topology[0]} GPU(s) per engine (EP{args.topology[2]}/ADP{args.topology[1]}); "
                             "engines spread over GPUs " + (args.gpus or "-")),
                "engine_config": engine_config({"extra": {}}, args.kv_cache_bytes, args.topology[0]), "variants": variants,
                "servers": "one per (variant, mode), cache flushed between runs" if args.reuse_server
                           else "a fresh one per run",
                "blocks": [{"seeds": blk, "order": "reversed" if b % 2 else "forward"}
                           for b, blk in enumerate(seed_blocks(args.seeds, args.blocks))] if args.reuse_server else None}
        (out / "meta.json").write_text(json.dumps(add_invocation(out / "meta.json", meta), indent=1))
        run_all(args, variants)
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(markdown(summary))
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
