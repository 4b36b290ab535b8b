#!/usr/bin/env python3
"""Soak: N turnstile rounds on the real multi-rank engine (CPU, gloo), under random rank skew.

Starts `pdrollout serve --nproc 4 --adp 2 --ep 4 --mode pd` (fine-grained, activation on, span
1, one device slot per rank = full residency, `--rank-skew-ms`, `--step-log`), keeps it busy
with concurrent /generate clients whose long prompts are prefilled in small chunks (a P epoch
in most steps while earlier requests decode), and stops once rank 0 has run N rounds. Then it
reads every rank's step log and the server's metrics:

  rounds       turnstile rounds with a rendezvous (metrics) = the sum of the step logs' rounds
  stalls       the watchdog's count (metrics) and the server's exit code (3 = stall)
  violations   steps missing on a rank, ranks disagreeing on a step's rounds or control, a
               rank whose rendezvous count is not 2 per round, a failed or short response
  skew         the delay injected before each rank's D launch (`skew_ms` of the step logs) and
               the observed arrival spread per rendezvous (slowest minus fastest rank's wait)
  rendezvous   each rendezvous' latency on every rank: p50 / p99 / max, pre-D and post-D

Writes a JSON result (meta: command, machine, commit) and prints a short table. Exit status 0
only with >= N rounds, 0 stalls and 0 violations.

  python e2e/soak.py --rounds 10000 --out results/soak-10000.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(xs: list[float], scale: float = 1.0) -> dict:
    return {"count": len(xs), "p50": pct(xs, 0.5) * scale, "p90": pct(xs, 0.9) * scale,
            "p99": pct(xs, 0.99) * scale, "max": (max(xs) if xs else 0.0) * scale,
            "mean": (sum(xs) / len(xs) if xs else 0.0) * scale}


def metrics(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name in ("pdrollout:turnstile_rounds_total", "pdrollout:stalls_total", "pdrollout:engine_steps_total",
                          "pdrollout:turnstile_rendezvous_seconds_count"):
                out[s.name] = s.value
    return out


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    mem = next((int(ln.split()[1]) // 1024 for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), 0)
    from importlib.metadata import version
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "mem_mib": mem,
            "os": platform.platform(), "python": platform.python_version(), "torch": version("torch")}


def commit() -> dict:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


class Server:
    def __init__(self, cmd: list[str], env: dict):
        self.lines: list[str] = []
        self._ready: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if "ready on http://" in line:
                self._ready.put(line.split("ready on ")[1].strip())
        self._ready.put(None)

    def url(self, timeout: float) -> str:
        try:
            url = self._ready.get(timeout=timeout)
        except queue.Empty:
            url = None
        if url is None:
            self.kill()
            raise SystemExit("soak: the server did not become ready:\n" + "".join(self.lines[-40:]))
        return url

    def stop(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)   # its own session: rank 0 and the ranks it spawned
            self.proc.wait()


def drive(url: str, clients: int, stop: threading.Event, seed: int, vocab: int) -> dict:
    """Concurrent clients; each checks its answer (status 200, max_new_tokens tokens)."""
    import httpx
    done = {"requests": 0, "failed": []}
    lock = threading.Lock()

    def client(k: int):
        rng = random.Random(seed * 1000 + k)
        with httpx.Client(base_url=url, timeout=600) as c:
            while not stop.is_set():
                n = rng.randint(8, 24)
                body = {"input_ids": [rng.randrange(2, vocab) for _ in range(rng.randint(24, 64))],
                        "sampling_params": {"max_new_tokens": n, "ignore_eos": True, "temperature": 0}}
                try:
                    r = c.post("/generate", json=body)
                    ok = r.status_code == 200 and len(r.json()["output_ids"]) == n
                    why = None if ok else f"status {r.status_code}: {r.text[:200]}"
                except Exception as e:   # the server went away (a stall ends it): count, stop
                    why = f"{type(e).__name__}: {e}"
                with lock:
                    if why:
                        done["failed"].append(why)
                    else:
                        done["requests"] += 1
                if why:
                    return

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    done["threads"] = threads
    return done


def read_logs(log_dir: Path, world: int) -> tuple[dict, list[str]]:
    per_rank: dict[int, dict[int, dict]] = {}
    violations: list[str] = []
    for r in range(world):
        path = log_dir / f"rank{r}.jsonl"
        if not path.exists():
            violations.append(f"rank {r}: no step log")
            continue
        recs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        # step 0 is the engine's warm-up through every collective before it serves: not in /metrics
        per_rank[r] = {rec["step"]: rec for rec in recs if rec["step"] > 0}
    return per_rank, violations


def analyse(per_rank: dict[int, dict[int, dict]], world: int, violations: list[str]) -> dict:
    steps = sorted(set().union(*(set(v) for v in per_rank.values()))) if per_rank else []
    rounds = 0
    rdv_all, rdv_pre, rdv_post, spread, skew = [], [], [], [], []
    for step in steps:
        recs = [per_rank.get(r, {}).get(step) for r in range(world)]
        if any(rec is None for rec in recs):
            # the last step may be cut by the stop on some ranks only; any other gap is a violation
            if step != steps[-1]:
                violations.append(f"step {step}: missing on ranks {[r for r, x in enumerate(recs) if x is None]}")
            continue
        if len({rec["rounds"] for rec in recs}) != 1:
            violations.append(f"step {step}: ranks disagree on rounds {[rec['rounds'] for rec in recs]}")
        if len({json.dumps(rec["control"], sort_keys=True) for rec in recs}) != 1:
            violations.append(f"step {step}: ranks disagree on the control")
        for rec in recs:
            if len(rec["rendezvous_s"]) != 2 * rec["rounds"]:
                violations.append(f"step {step} rank {rec['rank']}: {len(rec['rendezvous_s'])} rendezvous "
                                  f"for {rec['rounds']} rounds")
            skew.extend(rec.get("skew_ms", []))
        rounds += recs[0]["rounds"]
        n = min(len(rec["rendezvous_s"]) for rec in recs)
        for i in range(n):
            lat = [rec["rendezvous_s"][i] for rec in recs]
            rdv_all.extend(lat)
            (rdv_pre if i % 2 == 0 else rdv_post).extend(lat)
            spread.append(max(lat) - min(lat))
    return {"steps": len(steps), "rounds": rounds,
            "rendezvous_ms": summary(rdv_all, 1e3), "rendezvous_pre_d_ms": summary(rdv_pre, 1e3),
            "rendezvous_post_d_ms": summary(rdv_post, 1e3),
            "arrival_spread_ms": summary(spread, 1e3), "skew_injected_ms": summary(skew),
            "skew_histogram_ms": histogram(skew, 10.0)}


def histogram(xs: list[float], width: float) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in xs:
        lo = int(x // width) * width
        key = f"{lo:.0f}-{lo + width:.0f}"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: float(kv[0].split("-")[0])))


def table(res: dict) -> str:
    r = res["results"]
    rows = [("rounds (metrics / step logs)", f"{r['rounds_metrics']:.0f} / {r['rounds']}"),
            ("steps / requests", f"{r['steps']} / {r['requests']}"),
            ("duration", f"{r['duration_s']:.0f} s ({r['rounds'] / max(r['duration_s'], 1e-9):.0f} rounds/s)"),
            ("stalls", f"{r['stalls']} (exit code {r['exit_code']})"),
            ("violations", str(len(res["violations"]))),
            ("skew injected ms p50 / p99 / max", "{p50:.1f} / {p99:.1f} / {max:.1f}".format(**r["skew_injected_ms"])),
            ("arrival spread ms p50 / p99 / max", "{p50:.1f} / {p99:.1f} / {max:.1f}".format(**r["arrival_spread_ms"])),
            ("rendezvous ms p50 / p99 / max", "{p50:.2f} / {p99:.2f} / {max:.2f}".format(**r["rendezvous_ms"])),
            ("  pre-D  p50 / p99", "{p50:.2f} / {p99:.2f}".format(**r["rendezvous_pre_d_ms"])),
            ("  post-D p50 / p99", "{p50:.2f} / {p99:.2f}".format(**r["rendezvous_post_d_ms"]))]
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, required=True, help="stop once rank 0 ran this many turnstile rounds")
    ap.add_argument("--model", help="model dir (default: a fresh `pdrollout checkpoint --config tiny`)")
    ap.add_argument("--out", help="result JSON (default: print only)")
    ap.add_argument("--skew-ms", type=float, default=50.0)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--adp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--slots", type=int, default=1, help="device slots per rank (1 = full residency)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prefill-budget", type=int, default=16, help="prefill tokens per step: long prompts take several P epochs")
    ap.add_argument("--timeout-s", type=float, default=3600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the work dir (checkpoint, step logs)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    work = Path(tempfile.mkdtemp(prefix="pdrollout-soak-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-c", "import sys; from pdrollout.engine.cli import main; sys.exit(main())"]
    model = a.model
    if model is None:
        model = str(work / "tiny")
        subprocess.run([*cli, "checkpoint", "--config", "tiny", "--out", model], check=True, env=env,
                       capture_output=True)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    control = {"ordering": "fine-grained", "activation": "on", "span": 1, "prefill_budget_tokens": a.prefill_budget}
    log_dir = work / "steps"
    serve = [*cli, "serve", "--model", model, "--host", "127.0.0.1", "--port", "0", "--mode", "pd",
             "--nproc", str(a.nproc), "--adp", str(a.adp), "--ep", str(a.ep), "--slots", str(a.slots),
             "--rank-skew-ms", str(a.skew_ms), "--step-log", str(log_dir), "--log-level", "warning",
             "--engine-config", json.dumps({"control": control, "seed": a.seed})]
    t_start = time.time()
    server = Server(serve, env)
    url = server.url(timeout=300)
    stop = threading.Event()
    load = drive(url, a.clients, stop, a.seed, vocab)
    t0 = time.monotonic()
    last_print, m = 0.0, {}
    try:
        while True:
            time.sleep(1.0)
            if server.proc.poll() is not None:
                break
            m = metrics(url)
            rounds = m.get("pdrollout:turnstile_rounds_total", 0)
            if time.monotonic() - last_print > 30:
                last_print = time.monotonic()
                print(f"soak: {rounds:.0f} / {a.rounds} rounds, {load['requests']} requests, "
                      f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
            if rounds >= a.rounds or load["failed"] or time.monotonic() - t0 > a.timeout_s:
                break
    finally:
        stop.set()
        for t in load["threads"]:
            t.join(600)
        if server.proc.poll() is None:
            m = metrics(url) or m
        duration = time.monotonic() - t0
        code = server.stop()
    per_rank, violations = read_logs(log_dir, a.nproc)
    stats = analyse(per_rank, a.nproc, violations)
    violations += [f"request failed: {f}" for f in load["failed"]]
    stalls = int(m.get("pdrollout:stalls_total", 0)) + (1 if code == 3 else 0)
    if abs(m.get("pdrollout:turnstile_rounds_total", 0) - stats["rounds"]) > 0 and code == 0:
        # metrics count rank 0's rounds as each step finishes; the logs hold the same steps
        violations.append(f"rounds: metrics {m.get('pdrollout:turnstile_rounds_total')} != step logs {stats['rounds']}")
    res = {"meta": {"command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]) if argv is None
                    else "e2e/soak.py " + " ".join(argv),
                    "server_command": " ".join(["pdrollout"] + serve[len(cli):]),
                    "machine": machine(), **commit(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start))},
           "config": {**vars(a), "control": control},
           "results": {**stats, "rounds_metrics": m.get("pdrollout:turnstile_rounds_total", 0),
                       "requests": load["requests"], "duration_s": duration, "stalls": stalls, "exit_code": code},
           "violations": violations[:100], "violations_total": len(violations)}
    print(table(res))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        print(f"soak: wrote {a.out}", file=sys.stderr)
    if code not in (0, None) or stalls:
        print("soak: server log tail:\n" + "".join(server.lines[-40:]), file=sys.stderr)
    if a.keep:
        print(f"soak: step logs in {log_dir}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    ok = stats["rounds"] >= a.rounds and stalls == 0 and not violations and code == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
