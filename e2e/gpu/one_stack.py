"""Issue 15 on GPUs: one execution stack, the CUDA fast path on every rank.

Stages (python -m e2e.gpu tests one-stack OUT STAGE..., after `source e2e/gpu/env.sh`; COMMIT=<sha>):
  check    2 GPUs: greedy tokens of an fp32 Qwen3-MoE on 2 ranks (ATP2/ADP1 pd; ADP2 normal) equal one
           GPU's (margin rule against transformers), and every decode-only step replayed a CUDA graph on
           one rank and on two (the step logs' `graph`)
  decode2  2 GPUs: a decode step at batch 64 (ctx ~2k, the Qwen3-30B-A3B shape, 48 layers, ATP2/ADP1,
           EP2, random bf16) as a graph replay on two ranks, against the HBM floor of the bytes each
           rank reads; the same on one GPU in the same call
  small    1 vs 2 GPUs: `pdrollout bench --modes normal,mixed,pd --preset small --pressure P1`, the
           30B-A3B shape cut to 12 layers, one GPU vs `--nproc 2 --adp 2 --ep 2`
Writes OUT/<stage>.json; prints a short table last.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [[(i * 37 + k * 11) % 500 + 2 for k in range(5 + 11 * i)] for i in range(4)]
DEVICE = os.environ.get("DEVICE", "cuda")   # cpu: a dry run of the mechanics (no graphs there)


def meta(stage: str, **kw) -> dict:
    import torch
    return {"issue": 15, "stage": stage, "commit": os.environ.get("COMMIT", "unknown"), "machine": platform.node(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "gpus": torch.cuda.device_count(), "command": f"python -m e2e.gpu tests one-stack OUT {stage}", **kw}


def generate(model, reqs: str, out: Path, name: str, *, nproc=1, adp=1, ep=1, mode="pd", engine=None,
             control=None, dtype="float32", timeout=600) -> tuple[list, Path]:
    log = out / f"steplog-{name}"
    args = ["pdrollout", "generate", "--model", str(model), "--requests", "-", "--mode", mode, "--device", DEVICE,
            "--dtype", dtype, "--step-log", str(log), "--engine-config", json.dumps(engine or {}),
            "--control", json.dumps(control or {})]
    if nproc > 1:
        args += ["--nproc", str(nproc), "--adp", str(adp), "--ep", str(ep)]
    t0 = time.monotonic()
    r = subprocess.run(args, input=reqs, capture_output=True, text=True, timeout=timeout)
    (out / f"{name}.stderr").write_text(r.stderr[-20000:])
    if r.returncode:
        raise SystemExit(f"{name}: exit {r.returncode}\n{r.stderr[-4000:]}")
    print(f"{name}: {time.monotonic() - t0:.1f} s", flush=True)
    return [json.loads(line) for line in r.stdout.splitlines()], log


def steplog(log: Path, rank: int = 0) -> list[dict]:
    return [json.loads(x) for x in (log / f"rank{rank}.jsonl").read_text().splitlines()]


def check(out: Path) -> dict:
    from pdrollout.engine.model.checkpoint import write_checkpoint
    from pdrollout.engine.protocol.config import load_preset
    from e2e.harness.hf_reference import MARGIN, hf_greedy
    cfg = load_preset("tiny")
    cfg.update(vocab_size=512, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
               num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
               num_experts=8, num_experts_per_tok=2)
    model = write_checkpoint(cfg, Path("/tmp/pdrollout-onestack/model"), seed=0, dtype="float32")
    reqs = "".join(json.dumps({"rid": f"r{i}", "input_ids": p, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}) + "\n" for i, p in enumerate(PROMPTS))
    engine = {"block_size": 16, "max_running": 16}
    fine = {"prefill_budget_tokens": 24, "ordering": "fine-grained", "activation": "on", "span": 1}
    runs = {"1gpu-pd": dict(), "2gpu-atp2-pd": dict(nproc=2, adp=1, ep=2, control=fine),
            "2gpu-adp2-normal": dict(nproc=2, adp=2, ep=2, mode="normal")}
    res = {"meta": meta("check", nproc=[1, 2], topologies=list(runs), seed=0), "runs": {}}
    ref = {i: hf_greedy(model, p, 8) for i, p in enumerate(PROMPTS)}
    for name, kw in runs.items():
        outs, log = generate(model, reqs, out, name, engine=engine, **kw)
        toks = [o["output_ids"] for o in outs]
        logs = steplog(log)
        d_only = [e for e in logs if e["prefill_tokens"] == 0 and e["decode_rows"] > 0]
        hf = []
        for i, t in enumerate(toks):
            first = next((k for k, (a, b) in enumerate(zip(t, ref[i][0])) if a != b), None)
            hf.append("equal" if first is None else
                      f"differs at {first} (margin {ref[i][1][first]:.1e}{'<' if ref[i][1][first] < MARGIN else '>='}{MARGIN})")
        res["runs"][name] = {"tokens": toks, "vs_transformers": hf, "decode_only_steps": len(d_only),
                             "graph_replays": sum(1 for e in d_only if e.get("graph"))}
    one = res["runs"]["1gpu-pd"]["tokens"]
    res["pass"] = all(r["tokens"] == one or all(h == "equal" or "<" in h for h in r["vs_transformers"])
                      for r in res["runs"].values()) and \
        all(r["graph_replays"] == r["decode_only_steps"] > 0 for r in res["runs"].values())
    print("| run | tokens == 1 GPU | vs transformers | decode-only steps | graph replays |\n|---|---|---|---|---|")
    for name, r in res["runs"].items():
        print(f"| {name} | {r['tokens'] == one} | {', '.join(sorted(set(r['vs_transformers'])))} | "
              f"{r['decode_only_steps']} | {r['graph_replays']} |")
    return res


def copy_bw() -> float:
    if DEVICE != "cuda":
        return 1e11   # a dry run: any figure
    from .hbm import copy_bw as measured
    return measured()


def decode2(out: Path, layers: int = 48, batch: int = 64, ctx: int = 2048, new: int = 24) -> dict:
    import random
    from pdrollout.engine.protocol.config import ModelConfig, load_preset
    bw = copy_bw()
    cfg_d = load_preset("qwen3-30b-a3b")
    cfg_d["num_hidden_layers"] = layers
    mdir = Path("/tmp/pdrollout-onestack/q30")
    mdir.mkdir(parents=True, exist_ok=True)
    (mdir / "config.json").write_text(json.dumps(cfg_d))
    c = ModelConfig.from_dict(cfg_d)
    rng = random.Random(0)
    reqs = "".join(json.dumps({"rid": f"r{i}", "input_ids": [rng.randrange(2, c.vocab_size) for _ in range(ctx)],
                               "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}) + "\n"
                   for i in range(batch))
    engine = {"random_weights": True, "kv_cache_bytes": (24 << 30) if DEVICE == "cuda" else (1 << 30),
              "max_running": batch, "block_size": 16}
    res = {"meta": meta("decode2", nproc=[1, 2], topology="ATP2/ADP1, EP2 (torch expert backend)", layers=layers,
                        batch=batch, ctx=ctx, seed=0), "copy_bw_tbs": bw / 1e12}
    # bytes one rank reads per decode step: its attention shard, the experts its tokens touch (64x8
    # routed rows reach ~all of a rank's experts), embeddings' rows, the full lm_head, its KV share
    h, e, i_moe, L = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.num_hidden_layers
    attn = L * (h * c.head_dim * (c.num_attention_heads * 2 + c.num_key_value_heads * 2)) * 2
    experts = L * e * 3 * h * i_moe * 2
    router_norm = L * (e * h + 2 * h) * 2
    lm_head = c.vocab_size * h * 2
    for name, n in (("1gpu", 1), ("2gpu", 2)):
        outs, log = generate(mdir, reqs, out, f"decode-{name}", nproc=n, adp=1, ep=n, mode="normal", engine=engine,
                             control={"prefill_budget_tokens": 32768}, dtype="bfloat16")
        steps = [s for s in steplog(log) if s["decode_rows"] == batch and s["prefill_tokens"] == 0
                 and (s.get("graph") or DEVICE != "cuda")]
        walls = sorted(s["wall_s"] for s in steps[2:])
        kv = batch * (ctx + new // 2) * L * 2 * c.num_key_value_heads * c.head_dim * 2
        floor_bytes = (attn + experts + kv) / n + router_norm + lm_head
        med = statistics.median(walls)
        res[name] = {"graph_steps": len(steps), "step_ms_median": med * 1e3, "step_ms_min": walls[0] * 1e3,
                     "step_ms_max": walls[-1] * 1e3, "floor_bytes_per_rank": floor_bytes,
                     "floor_ms": floor_bytes / bw * 1e3, "over_floor": med / (floor_bytes / bw)}
    print("| GPUs | graph steps | decode step ms (median, min–max) | HBM floor per rank ms | × floor |")
    print("|---|---|---|---|---|")
    for name in ("1gpu", "2gpu"):
        r = res[name]
        print(f"| {name} | {r['graph_steps']} | {r['step_ms_median']:.2f} ({r['step_ms_min']:.2f}–{r['step_ms_max']:.2f}) | "
              f"{r['floor_ms']:.2f} | {r['over_floor']:.2f} |")
    return res


def step_kinds(log: Path) -> dict:
    """Rank 0's steps by kind (decode-only graph replays, decode-only eager, D while another replica
    prefills, steps carrying P of rank 0's replica): count,
    rows or tokens, and the time inside execute(); what the makespan spends outside it is host work
    between steps (scheduling, plan broadcast, HTTP)."""
    kinds: dict[str, dict] = {}
    for r in steplog(log):
        # "D beside P": this replica decodes only, while another one prefills in the same step
        k = "P" if r["prefill_tokens"] else "D beside P" if r.get("p_any") else ("D graph" if r["graph"] else "D eager")
        e = kinds.setdefault(k, {"steps": 0, "wall_s": 0.0, "decode_rows": 0, "prefill_tokens": 0})
        e["steps"] += 1
        e["wall_s"] += r["wall_s"]
        e["decode_rows"] += r["decode_rows"]
        e["prefill_tokens"] += r["prefill_tokens"]
    for e in kinds.values():
        e["ms_per_step"] = 1e3 * e["wall_s"] / e["steps"]
    return kinds


def small(out: Path) -> dict:
    from pdrollout.engine.protocol.config import load_preset
    cfg = load_preset("qwen3-30b-a3b")
    cfg["num_hidden_layers"] = 12
    mdir = Path("/tmp/pdrollout-onestack/small")
    mdir.mkdir(parents=True, exist_ok=True)
    (mdir / "config.json").write_text(json.dumps(cfg))
    engine = json.dumps({"random_weights": True, "dtype": "bfloat16", "kv_cache_bytes": 20 << 30, "max_running": 64})
    seed = int(os.environ.get("SEED", 0))
    res = {"meta": meta("small", nproc=[1, 2], topology="1 GPU vs ADP2/EP2 on 2 GPUs", preset="small",
                        pressure="P1", seed=seed, layers=12)}
    for name, extra in (("1gpu", []), ("2gpu", ["--serve-arg=--nproc", "--serve-arg=2", "--serve-arg=--adp",
                                                 "--serve-arg=2", "--serve-arg=--ep", "--serve-arg=2"])):
        t0 = time.monotonic()
        r = subprocess.run(["pdrollout", "bench", "--modes", "normal,mixed,pd", "--model", str(mdir), "--preset", "small",
                            "--pressure", "P1", "--seed", str(seed), "--device", "cuda", "--serve-arg=--engine-config",
                            f"--serve-arg={engine}", "--no-progress", "--no-plots", "--out", str(out / f"small-s{seed}-{name}"),
                            "--serve-arg=--step-log", f"--serve-arg={out}/steplog-small-s{seed}-{name}-{{mode}}", *extra],
                           capture_output=True, text=True, timeout=560)
        (out / f"small-s{seed}-{name}.log").write_text(r.stdout[-20000:] + r.stderr[-20000:])
        if r.returncode:
            raise SystemExit(f"bench {name}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        got = json.loads((out / f"small-s{seed}-{name}" / "results.json").read_text())["modes"]
        res[name] = {m: {k: got[m][k] for k in ("makespan_s", "p99_ttft_ms", "mean_decode_wait_ms",
                                                 "total_input_tokens", "total_output_tokens")} for m in got}
        for m in got:
            res[name][m]["steps"] = step_kinds(out / f"steplog-small-s{seed}-{name}-{m}")
        print(f"{name}: {time.monotonic() - t0:.0f} s", flush=True)
    print("| mode | 1 GPU makespan s | 2 GPUs makespan s | 2/1 |\n|---|---|---|---|")
    for m in res["1gpu"]:
        a, b = res["1gpu"][m]["makespan_s"], res["2gpu"][m]["makespan_s"]
        print(f"| {m} | {a:.2f} | {b:.2f} | {b / a:.3f} |")
    print("| run | mode | kind | steps | ms/step | s in steps | rows or tokens |\n|---|---|---|---|---|---|---|")
    for name in ("1gpu", "2gpu"):
        for m, r in res[name].items():
            for k, e in sorted(r["steps"].items()):
                print(f"| {name} | {m} | {k} | {e['steps']} | {e['ms_per_step']:.2f} | {e['wall_s']:.2f} | "
                      f"{e['prefill_tokens'] if k == 'P' else e['decode_rows']} |")
    return res


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for stage in sys.argv[2:]:
        kw = {"layers": int(os.environ["LAYERS"]), "batch": int(os.environ.get("BATCH", 64)),
              "ctx": int(os.environ.get("CTX", 2048))} if stage == "decode2" and "LAYERS" in os.environ else {}
        r = {"check": check, "decode2": decode2, "small": small}[stage](out, **kw)
        name = f"small-s{os.environ.get('SEED', 0)}" if stage == "small" else stage
        (out / f"{name}.json").write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
