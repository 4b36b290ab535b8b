"""Issue 9: EP8/ADP2 makespan and the ordering ladder on eight GPUs (the paper's Figure 7/8, Table 5).

Every run is `pdrollout bench` against a fresh multi-rank `pdrollout serve` (ATP = NPROC/ADP, ETP1,
the DeepEP expert backend), over the same paper-shaped trace, so every figure is a side-by-side
ratio from one invocation of this script:
  modes     normal vs mixed vs pd (fine-grained, span auto, activation auto)
  ladder    pd with global-complete, global-enqueue, fine-grained (span 1)
  span      pd with span 1, 2, 3, 4 and auto
  decode    a decode-only workload (64 requests, 32-token prompts, 256 tokens out, released at once):
            normal vs pd activation auto vs pd activation on
Rendezvous latency (the turnstile's, at NPROC ranks) comes from the pd runs' server metrics.

Usage (repo root, GPU machine with deep_ep importable): python -m e2e.gpu tests ladder OUT [GROUP ...]
  NPROC=8 ADP=2 EP=8 BACKEND=deep_ep  PRESET=gpu PRESSURE=P1  LAYERS=48 (Qwen3-30B-A3B shape, random
  bf16 weights made on the devices)  DEVICE=cuda (cpu: a dry run of the mechanics on the tiny model)
Writes OUT/<group>/<run>/results.json (bench's), OUT/ladder8.json (the summary with the goals
checked) and prints a table last.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

OUT = sys.argv[1]
E = os.environ.get
NPROC, ADP, EP = int(E("NPROC", "8")), int(E("ADP", "2")), int(E("EP", "8"))
BACKEND, DEVICE = E("BACKEND", "deep_ep"), E("DEVICE", "cuda")
PRESET, PRESSURE, LAYERS = E("PRESET", "gpu"), E("PRESSURE", "P1"), int(E("LAYERS", "48"))
MODEL = "/tmp/pdrollout-ladder8-model"
DECODE_ONLY = "/tmp/pdrollout-ladder8-decode-only.jsonl"

GROUPS = {
    "modes": [("normal", "normal", {}), ("mixed", "mixed", {}),
              ("pd", "pd", {"ordering": "fine-grained", "span": "auto", "activation": "auto"})],
    "ladder": [(o, "pd", {"ordering": o, "span": 1, "activation": "on"})
               for o in ("global-complete", "global-enqueue", "fine-grained")],
    "span": [(f"span-{k}", "pd", {"ordering": "fine-grained", "span": k, "activation": "on"})
             for k in (1, 2, 3, 4, "auto")],
    "decode": [("normal", "normal", {}),
               ("pd-auto", "pd", {"ordering": "fine-grained", "span": "auto", "activation": "auto"}),
               ("pd-on", "pd", {"ordering": "fine-grained", "span": "auto", "activation": "on"})],
}


def prepare() -> None:
    os.makedirs(MODEL, exist_ok=True)
    if DEVICE == "cuda":
        from pdrollout.engine.protocol.config import load_preset
        cfg = load_preset("qwen3-30b-a3b")
        cfg["num_hidden_layers"] = LAYERS
        json.dump(cfg, open(f"{MODEL}/config.json", "w"))
    elif not os.path.exists(f"{MODEL}/config.json"):
        from pdrollout.engine.model.checkpoint import write_checkpoint
        from pdrollout.engine.protocol.config import load_preset
        write_checkpoint(load_preset("tiny"), MODEL, seed=0)
    n, plen, olen = (64, 32, 256) if DEVICE == "cuda" else (8, 8, 16)
    with open(DECODE_ONLY, "w") as f:
        for i in range(n):
            f.write(json.dumps({"session_id": f"s{i}", "turn": 0, "timestamp": 0, "input_length": plen,
                                "output_length": olen, "delay_ms": 0}) + "\n")


def bench(group: str, name: str, mode: str, control: dict) -> dict:
    out = f"{OUT}/{group}/{name}"
    engine = {"max_running": 64, "control": control}
    if DEVICE == "cuda":
        engine.update(random_weights=True, dtype="bfloat16", kv_cache_bytes=int(E("KV_BYTES", str(40 << 30))))
    serve = ["--nproc", str(NPROC), "--adp", str(ADP), "--ep", str(EP), "--engine-config", json.dumps(engine)]
    if BACKEND != "torch":
        serve += ["--expert-backend", BACKEND]
    src = ["--trace", DECODE_ONLY] if group == "decode" else ["--preset", PRESET]
    args = [sys.executable, "-m", "pdrollout.engine.cli", "bench", "--modes", mode, "--model", MODEL, *src,
            "--pressure", PRESSURE, "--device", DEVICE, "--no-progress", "--no-plots", "--out", out]
    args += [f"--serve-arg={a}" for a in serve]
    p = subprocess.run(args, capture_output=True, text=True)
    os.makedirs(out, exist_ok=True)
    open(f"{out}/bench.err", "w").write(p.stderr[-20000:])
    try:
        r = json.load(open(f"{out}/results.json"))["modes"][mode]
    except (OSError, KeyError, ValueError):
        return {"error": f"bench rc={p.returncode}: " + p.stderr[-600:]}
    keep = ("makespan_s", "completed", "p99_ttft_ms", "median_ttft_ms", "mean_decode_wait_ms", "rendezvous_count",
            "mean_rendezvous_ms", "turnstile_rounds", "stalls", "total_input_tokens", "total_output_tokens")
    return {k: r.get(k) for k in keep}


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def verdicts(res: dict) -> dict:
    v = {}
    m = res.get("modes", {})
    if "normal" in m and "pd" in m and "error" not in m["normal"] and "error" not in m["pd"]:
        v["pd_over_normal_makespan"] = ratio(m["pd"]["makespan_s"], m["normal"]["makespan_s"])
        v["pd_over_mixed_makespan"] = ratio(m["pd"]["makespan_s"], m.get("mixed", {}).get("makespan_s"))
        v["pd_over_normal_p99_ttft"] = ratio(m["pd"]["p99_ttft_ms"], m["normal"]["p99_ttft_ms"])
        v["goal_makespan_le_0.75"] = v["pd_over_normal_makespan"] <= 0.75
        v["goal_p99_ttft_le_1.05"] = v["pd_over_normal_p99_ttft"] <= 1.05
        v["same_work"] = len({(x["total_input_tokens"], x["total_output_tokens"]) for x in m.values()}) == 1
    lad = res.get("ladder", {})
    if all(k in lad and "error" not in lad[k] for k in ("global-enqueue", "fine-grained")):
        v["fine_over_enqueue_makespan"] = ratio(lad["fine-grained"]["makespan_s"], lad["global-enqueue"]["makespan_s"])
        v["d_wait_ms"] = {k: x.get("mean_decode_wait_ms") for k, x in lad.items()}
    d = res.get("decode", {})
    if all(k in d and "error" not in d[k] for k in ("normal", "pd-auto", "pd-on")):
        v["decode_only_auto_over_normal"] = ratio(d["pd-auto"]["makespan_s"], d["normal"]["makespan_s"])
        v["decode_only_on_over_normal"] = ratio(d["pd-on"]["makespan_s"], d["normal"]["makespan_s"])
    rdv = [x["mean_rendezvous_ms"] for g in res.values() if isinstance(g, dict) for x in g.values()
           if isinstance(x, dict) and x.get("mean_rendezvous_ms")]
    if rdv:
        v["rendezvous_mean_ms"] = round(sum(rdv) / len(rdv), 3)
        v["goal_rendezvous_le_0.3ms"] = v["rendezvous_mean_ms"] <= 0.3
    return v


def main() -> int:
    groups = sys.argv[2:] or list(GROUPS)
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        print(f"unknown group(s) {unknown}; known: {', '.join(GROUPS)}", file=sys.stderr)
        return 2
    os.makedirs(OUT, exist_ok=True)
    prepare()
    path = f"{OUT}/ladder8.json"
    res = json.load(open(path)) if os.path.exists(path) else {}
    res["setup"] = {"nproc": NPROC, "adp": ADP, "ep": EP, "backend": BACKEND, "preset": PRESET,
                    "pressure": PRESSURE, "layers": LAYERS, "device": DEVICE}
    for g in groups:
        for name, mode, control in GROUPS[g]:
            r = bench(g, name, mode, control)
            res.setdefault(g, {})[name] = r
            res["verdicts"] = verdicts(res)
            json.dump(res, open(path, "w"), indent=1)
            print(f"{g}/{name}: {json.dumps(r)[:200]}", flush=True)
    print(f"\n{'group':7} {'run':16} {'makespan_s':>10} {'done':>5} {'p99_ttft_ms':>11} {'d_wait_ms':>9} "
          f"{'rdv_ms':>7} {'stalls':>6}")
    for g in GROUPS:
        for name, r in res.get(g, {}).items():
            if "error" in r:
                print(f"{g:7} {name:16} ERROR {r['error'][:80]}")
                continue
            f = lambda k, n=1: "-" if r.get(k) is None else round(r[k], n)
            print(f"{g:7} {name:16} {f('makespan_s', 2):>10} {r['completed']:>5} {f('p99_ttft_ms'):>11} "
                  f"{f('mean_decode_wait_ms', 2):>9} {f('mean_rendezvous_ms', 3):>7} {r.get('stalls', '-'):>6}")
    print(json.dumps(res["verdicts"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
