"""Issue 8: the NCCL crossed-group stall and its fix on four GPUs (ATP2/ADP2, EP4, NCCL).

The multi-rank engine's real P path (model-wide AllReduce over all four ranks) and D path
(DP-attention AllGather/ReduceScatter on {0,2} and {1,3}) on one GPU per rank. The device
condition of docs/DISTRIBUTED.md ("the device cannot run both collectives at once") is made explicit:
each rank's P and D streams share one green-context partition of S SMs, and the registered
pair's NCCL kernels are pinned to C CTAs (--sm-partition S --nccl-ctas C). Whether C CTAs of one
kernel leave room for the other is the residency question of the paper (24 vs 23 CTAs/SM).

Runs (each a `pdrollout generate` over the same requests; a stall ends with exit 3, the
watchdog's report of every rank's frontier, each rank's Python stacks, and, where py-spy is
installed (carried in .whl/), each rank's native stacks in OUT/native/<run>/rankN.txt):
  iso-cross-C*   isolation-only, replica 0 enqueues D first, replica 1 P first (the crossed order);
                 C = S/2, S/2+1, S-1, S, 2S: the residency scan (every crossing NCCL kernel pinned)
  iso-skew*      isolation-only, natural order, with a random per-rank D delay (rank skew)
  fine-*         fine-grained: three replays (seeds), one with skew; per-rank GPU timelines
Plus `sanity`: do two green contexts of S SMs share SMs (timed), before anything else.

Usage (repo root, 4 GPUs): python -m e2e.gpu tests stall OUT [RUN ...]   (default: all runs)
  SMS=8 (partition)  BOUND=15 (watchdog seconds)  TIMEOUT=240 (per run)  REQUESTS=48  DEVICE=cpu (dry run)
  TOPO=NPROC,ADP,EP (default 4,2,4). On two GPUs: 2,1,2 (ATP2, one replica: the sides of the crossed
  order are the two local ranks, P's model-wide and D's ATP AllReduce span the same two ranks on
  separate communicators) or 2,2,2 (ATP1/ADP2: no model-wide AllReduce, the paper's reduced axis).
Writes OUT/stall4.json (OUT/stall4-n2a1.json etc. for other topologies; + OUT/<run>.err tails,
OUT/timelines/<run>/rankN.json) and prints a table. Each completed run records a CRC of every
request's output tokens, so runs can be compared token for token.
"""
from __future__ import annotations

import json
import os
import sys
import time
import zlib

from .harness import run_group

OUT = sys.argv[1]
SMS = int(os.environ.get("SMS", "8"))
BOUND = os.environ.get("BOUND", "15")
TIMEOUT = int(os.environ.get("TIMEOUT", "240"))
WORK = "/tmp/pdrollout-stall4"
# CUDA_MODULE_LOADING for the runs (LAZY is CUDA's default). EAGER was tried as a suspect of the
# whole-GPU stall (a first launch loading its module behind a spinning kernel): it stalled too.
LOADING = os.environ.get("LOADING", "LAZY")
DEVICE = os.environ.get("DEVICE", "cuda")   # cpu: a dry run of the mechanics (no knobs, no timelines)
NPROC, ADP, EP = (int(x) for x in os.environ.get("TOPO", "4,2,4").split(","))
SUFFIX = "" if (NPROC, ADP, EP) == (4, 2, 4) else f"-n{NPROC}a{ADP}"


def runs() -> dict[str, dict]:
    s = SMS
    r = {
        # the crossed order, by residency: C = S fills the partition, C = S-1 leaves one SM
        f"iso-cross-C{s}": dict(order="isolation-only", cross=True, sms=s, ctas=s),
        f"iso-cross-C{s - 1}": dict(order="isolation-only", cross=True, sms=s, ctas=s - 1),
        f"iso-cross-C{2 * s}": dict(order="isolation-only", cross=True, sms=s, ctas=2 * s),
        # half the partition or less: both kernels of the crossed pair fit at one CTA per SM
        f"iso-cross-C{s // 2}": dict(order="isolation-only", cross=True, sms=s, ctas=s // 2),
        f"iso-cross-C{s // 2 + 1}": dict(order="isolation-only", cross=True, sms=s, ctas=s // 2 + 1),
        "iso-cross-wholegpu": dict(order="isolation-only", cross=True, sms=0, ctas=0),
        "iso-cross-wholegpu-lazy": dict(order="isolation-only", cross=True, sms=0, ctas=0, loading="LAZY"),
        "iso-skew0-wholegpu": dict(order="isolation-only", sms=0, ctas=0),
        # natural order: does rank skew produce the crossing?
        f"iso-skew0-C{s}": dict(order="isolation-only", sms=s, ctas=s),
        f"iso-skew20-C{s}": dict(order="isolation-only", sms=s, ctas=s, skew=20),
        # the fix: three full replays and one with 20 ms skew, with timelines
        f"fine-seed0-C{s}": dict(order="fine-grained", sms=s, ctas=s, seed=0, timeline=True),
        f"fine-seed1-C{s}": dict(order="fine-grained", sms=s, ctas=s, seed=1, timeline=True),
        f"fine-seed2-C{s}": dict(order="fine-grained", sms=s, ctas=s, seed=2, timeline=True),
        f"fine-skew20-C{s}": dict(order="fine-grained", sms=s, ctas=s, skew=20, timeline=True),
        f"iso-tl-C{s - 1}": dict(order="isolation-only", sms=s, ctas=s - 1, timeline=True),
        # D enqueued without waiting for it: P's next work may overlap D's tail on the GPU
        f"fine-async-C{s}": dict(order="fine-grained", sms=s, ctas=s, timeline=True, d_async=True),
        "fine-async-wholegpu": dict(order="fine-grained", sms=0, ctas=0, timeline=True, d_async=True),
    }
    return r


def sanity() -> dict:
    """Two green contexts of SMS SMs: concurrent matmul loops take ~2x one loop if they share the
    SMs, ~1x if disjoint. The whole GPU with two plain streams is the reference."""
    import torch
    from torch.cuda.green_contexts import GreenContext
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    a = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)

    def wrap(g):
        s = g.Stream()
        return torch.cuda.Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)

    def loop(stream, n=40):
        with torch.cuda.stream(stream):
            for _ in range(n):
                a @ a

    def timed(streams):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for s in streams:
            loop(s)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    g1, g2 = GreenContext.create(SMS, 0), GreenContext.create(SMS, 0)
    s1, s2 = wrap(g1), wrap(g2)
    timed([s1])   # warm
    one = min(timed([s1]) for _ in range(3))
    both = min(timed([s1, s2]) for _ in range(3))
    p1, p2 = torch.cuda.Stream(), torch.cuda.Stream()
    whole_one = min(timed([p1]) for _ in range(3))
    return {"sms": SMS, "one_loop_s": round(one, 4), "two_loops_concurrent_s": round(both, 4),
            "ratio": round(both / one, 2), "whole_gpu_one_loop_s": round(whole_one, 4),
            "partition_slowdown_vs_whole_gpu": round(one / whole_one, 2),
            "shared": both / one > 1.6}


def prepare() -> None:
    os.makedirs(WORK, exist_ok=True)
    if os.path.exists(f"{WORK}/model/config.json"):
        return
    import random
    from pdrollout.engine.model.checkpoint import write_checkpoint
    from pdrollout.engine.protocol.config import load_preset
    cfg = load_preset("tiny")
    cfg.update(vocab_size=1024, hidden_size=1024, intermediate_size=1024, moe_intermediate_size=256,
               num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
               num_experts=16, num_experts_per_tok=4)
    write_checkpoint(cfg, f"{WORK}/model", seed=0, dtype="bfloat16")
    rng = random.Random(0)
    n = int(os.environ.get("REQUESTS", "48"))
    with open(f"{WORK}/reqs.jsonl", "w") as f:
        for i in range(n):
            plen = rng.choice([16, 32, 64, 128, 256, 384])
            f.write(json.dumps({"rid": f"r{i}", "input_ids": [rng.randrange(2, 1000) for _ in range(plen)],
                                "sampling_params": {"max_new_tokens": rng.choice([16, 32, 48]),
                                                    "temperature": 0, "ignore_eos": True}}) + "\n")


def run(name: str, spec: dict) -> dict:
    engine = {"block_size": 16, "num_blocks": 2048, "max_running": 32, "mixed_chunk_tokens": 256,
              "cuda_graphs": False, "seed": spec.get("seed", 0)}
    control = {"ordering": spec["order"], "span": 1, "activation": "on", "prefill_budget_tokens": 256}
    args = [sys.executable, "-m", "pdrollout.engine.cli", "generate", "--model", f"{WORK}/model",
            "--requests", f"{WORK}/reqs.jsonl", "--mode", "pd", "--device", DEVICE,
            "--dtype", "bfloat16" if DEVICE == "cuda" else "float32",
            "--nproc", str(NPROC), "--adp", str(ADP), "--ep", str(EP), "--engine-config", json.dumps(engine),
            "--control", json.dumps(control), "--watchdog-bound", BOUND]
    if DEVICE == "cuda":
        args += ["--sm-partition", str(spec["sms"]), "--nccl-ctas", str(spec["ctas"])]
    if spec.get("cross"):
        args.append("--cross-isolation")
    if DEVICE == "cuda":   # explicit both ways: the delayed ACK is on by default under fine-grained
        args.append("--d-async" if spec.get("d_async") else "--no-d-async")
    if spec.get("skew"):
        args += ["--rank-skew-ms", str(spec["skew"])]
    tl = f"{OUT}/timelines/{name}{SUFFIX}"
    if spec.get("timeline") and DEVICE == "cuda":
        args += ["--gpu-timeline", tl]
    t0 = time.monotonic()
    env = dict(os.environ, CUDA_MODULE_LOADING=spec.get("loading", LOADING),
               PDROLLOUT_STALL_NATIVE=f"{OUT}/native/{name}{SUFFIX}")   # native stacks at a stall (py-spy)
    rc, stdout, stderr = run_group(args, TIMEOUT, env)
    wall = time.monotonic() - t0
    outputs = {}
    for line in stdout.splitlines():
        if line.startswith("{") and '"output_ids"' in line:
            o = json.loads(line)
            outputs[o["meta_info"]["id"]] = zlib.crc32(json.dumps(o["output_ids"]).encode())
    done = len(outputs)
    with open(f"{OUT}/{name}{SUFFIX}.err", "w") as f:
        f.write(stderr[-20000:])
    stall = next((line for line in stderr.splitlines() if "stall: no rank made progress" in line), None)
    res = {"run": name, **spec, "rc": rc, "wall_s": round(wall, 1), "completed": done, "stalled": rc == 3,
           "stall_report": stall, "output_crc": outputs}
    if stall:   # the frontier lines that follow the report (rank 0's copy)
        lines = stderr.splitlines()
        i = lines.index(stall)
        res["frontiers"] = lines[i + 1:i + 5]
    if spec.get("timeline") and rc == 0:
        from pdrollout.engine.runtime.gpu_timeline import summarize
        tls = {}
        for r in range(NPROC):
            path = f"{tl}/rank{r}.json"
            if os.path.exists(path):
                tls[r] = json.load(open(path))
        if tls:
            s = summarize(tls)
            res["gpu"] = s
            rdv = [x for t in tls.values() for x in t.get("rendezvous_s", [])]
            if rdv:
                rdv.sort()
                res["rendezvous"] = {"count": len(rdv), "mean_ms": round(1e3 * sum(rdv) / len(rdv), 3),
                                     "p50_ms": round(1e3 * rdv[len(rdv) // 2], 3),
                                     "p99_ms": round(1e3 * rdv[min(len(rdv) - 1, int(0.99 * len(rdv)))], 3)}
    return res


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    want = sys.argv[2:]
    path = f"{OUT}/stall4{SUFFIX}.json"
    result = json.load(open(path)) if os.path.exists(path) else {"runs": {}}
    result["topology"] = {"nproc": NPROC, "adp": ADP, "atp": NPROC // ADP, "ep": EP}
    if DEVICE == "cuda" and (not want or "sanity" in want):
        result["sanity"] = sanity()
        print("sanity:", json.dumps(result["sanity"]), flush=True)
    prepare()
    n_req = sum(1 for _ in open(f"{WORK}/reqs.jsonl"))
    result["requests"] = n_req
    table = runs()
    for name in (w for w in want if w != "sanity") if want else table:
        if name not in table:
            print(f"unknown run {name}; known: {', '.join(table)}", file=sys.stderr)
            return 2
        res = run(name, table[name])
        res.setdefault("loading", table[name].get("loading", LOADING))
        result["runs"][name] = res
        json.dump(result, open(path, "w"), indent=1)
        print(f"{name}: rc={res['rc']} {res['completed']}/{n_req} done in {res['wall_s']}s"
              + (f"  STALL {res['stall_report'][:90]}" if res["stall_report"] else ""), flush=True)
    # tokens equal to the first completed run of this file (greedy; bf16 near-ties may split)
    ref = next((r["output_crc"] for r in result["runs"].values() if r.get("output_crc")), {})
    print(f"\n{NPROC} ranks, ADP{ADP}, EP{EP}\n{'run':22} {'order':15} {'S':>3} {'C':>3} {'skew':>4} {'rc':>7} "
          f"{'done':>7} {'eq':>3} {'wall_s':>7} {'pair_ovl_ms':>11} {'P_on_D_ms':>9} {'order_ok':>8} {'rdv_ms':>7}")
    for name, r in result["runs"].items():
        t = r.get("gpu") or {}
        ranks = t.get("ranks", {})
        # the conflicting pair: P's registered AllReduce vs D's DP collectives (ADP>1) or D's ATP ones
        key = "registered_pair_overlap_ms" if ADP > 1 else "registered_p_overlapping_d_collectives_ms"
        ovl = max((v.get(key) for v in ranks.values()), default=None)
        eq = sum(1 for k, v in (r.get("output_crc") or {}).items() if ref.get(k) == v)
        pod = min((v["p_compute_overlapping_d_forward_ms"] for v in ranks.values()), default=None)
        ok = (not t["order_violations"]) if t else None
        rdv = (r.get("rendezvous") or {}).get("mean_ms")
        print(f"{name:22} {r['order']:15} {r['sms']:>3} {r['ctas']:>3} {r.get('skew', 0):>4} {str(r['rc']):>7} "
              f"{r['completed']:>3}/{n_req:<3} {eq:>3} {r['wall_s']:>7} {str(ovl):>11} {str(pod):>9} {str(ok):>8} "
              f"{str(rdv):>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
