"""Decode-only: pd with activation `auto` against the `normal` policy in one server process (issue 19:
"a decode-only workload with activation `auto` within 1 % of `normal`").

Separate servers cannot settle a 1 % question on one GPU: the same decode graph replays 22.8–25.2 ms
from one process to the next. So one `pd` server serves every run, and the live control switches its
policy between runs: activation `off` is the `normal` policy itself (PDPolicy.plan hands the step to
NormalPolicy), `auto` is pd's. The runs alternate off/auto, auto/off, ... so a drift over the call
falls on both alike; each pair gives one ratio, and the table is their median with the min–max.

    python -m e2e.gpu bench decode-ab OUT [--pairs 3] [--rows 64] [--prompt 32] [--output 512]
    DEVICE=cpu python -m e2e.gpu bench decode-ab OUT --model-preset tiny --rows 4 --output 8   # dry run
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .bench_seeds import BASE_CONFIG, device, engine_config, reset, spread, write_model  # noqa: E402

MEASURES = ("makespan_s", "mean_decode_step_ms", "median_ttft_ms")


def put_control(url: str, changes: dict) -> dict:
    req = urllib.request.Request(url + "/control", data=json.dumps(changes).encode(), method="PUT",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def write_trace(path: Path, rows: int, prompt: int, output: int) -> None:
    """`rows` single-turn requests released at once: one prefill burst, then decode alone."""
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"session_id": f"s{i}", "turn": 0, "timestamp": 0, "input_length": prompt,
                                "output_length": output, "delay_ms": 0}) + "\n")


def order(pairs: int) -> list[tuple[int, str]]:
    """off, auto | auto, off | ...: each activation goes first in half the pairs."""
    return [(i, a) for i in range(pairs) for a in (("off", "auto") if i % 2 == 0 else ("auto", "off"))]


def run_one(url: str, trace: Path, out: Path, activation: str, timeout_s: float) -> dict:
    applied = put_control(url, {"activation": activation})
    if applied["activation"] != activation:
        raise RuntimeError(f"PUT /control asked activation {activation!r}, the server reports {applied['activation']!r}")
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["pdrollout", "bench", "--url", url, "--modes", activation, "--trace", str(trace), "--pressure", "P1",
           "--no-progress", "--no-plots", "--out", str(out)]
    with open(out / "bench.log", "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    if rc != 0:
        raise RuntimeError(f"bench with activation {activation} exited {rc}; log {out / 'bench.log'}")
    return json.loads((out / "results.json").read_text())["modes"][activation]


def summarize(runs: dict) -> dict:
    """runs: {pair: {activation: results}} -> per-measure spread of auto/off over the pairs."""
    table = {}
    for m in MEASURES:
        ratios = [r["auto"][m] / r["off"][m] for r in runs.values() if r["auto"].get(m) and r["off"].get(m)]
        table[m] = {"off": spread([r["off"].get(m) for r in runs.values()]),
                    "auto": spread([r["auto"].get(m) for r in runs.values()]), "auto_vs_off": spread(ratios)}
    return table


def markdown(table: dict, pairs: int) -> str:
    def cell(s, fmt="{:.3f}"):
        return "–" if s is None else f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"
    lines = [f"decode-only, one pd server, {pairs} pairs (median, min–max)", "",
             "| measure | activation off (= normal's policy) | activation auto | auto / off |", "|---|---|---|---|"]
    for m, s in table.items():
        lines.append(f"| {m} | {cell(s['off'], '{:.2f}')} | {cell(s['auto'], '{:.2f}')} | {cell(s['auto_vs_off'])} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--output", type=int, default=512)
    ap.add_argument("--model-preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--model", default="/tmp/pdrollout-bench-model")
    ap.add_argument("--engine-config", default="{}", help="JSON merged over bench_seeds' BASE_CONFIG")
    ap.add_argument("--run-timeout", type=float, default=300)
    ap.add_argument("--step-log", action="store_true", help="the server's per-step log in OUT/steps")
    args = ap.parse_args()
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_model(Path(args.model), args.layers, args.model_preset)
    trace = out / "decode-only.jsonl"
    write_trace(trace, args.rows, args.prompt, args.output)
    config = engine_config({"extra": json.loads(args.engine_config)})
    meta = {"command": " ".join(sys.argv), "commit": os.environ.get("COMMIT", "unknown"),
            "machine": os.environ.get("MACHINE", "unknown"), "seed": None, "nproc": 1,
            "topology": "one GPU, EP1/ADP1; one pd server for every run", "model_preset": args.model_preset,
            "layers": args.layers or "preset", "workload": {"rows": args.rows, "prompt": args.prompt,
                                                            "output": args.output},
            "engine_config": config, "base_config": BASE_CONFIG, "order": order(args.pairs)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))

    from pdrollout.engine.workload.servers import serve
    runs: dict = {}
    t = time.time()
    extra = ("--engine-config", json.dumps(config)) + (("--step-log", str(out / "steps")) if args.step_log else ())
    with serve(args.model, "pd", str(out / "server.log"), device=device(), extra_args=extra) as live:
        print(f"server up in {time.time() - t:.0f} s", flush=True)
        for n, (pair, activation) in enumerate(order(args.pairs)):
            if n:
                reset(live.url)
            res = run_one(live.url, trace, out / f"pair{pair}" / activation, activation, args.run_timeout)
            runs.setdefault(pair, {})[activation] = res
            print(f"pair {pair} {activation}: makespan {res['makespan_s']:.2f} s, decode step "
                  f"{res.get('mean_decode_step_ms') or 0:.2f} ms", flush=True)
    table = summarize(runs)
    (out / "summary.json").write_text(json.dumps({"meta": meta, "runs": runs, "table": table}, indent=1))
    text = markdown(table, args.pairs)
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
