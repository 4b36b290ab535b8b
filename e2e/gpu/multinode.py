"""Issue 14 on two GPUs: the operator's two-node launch, one GPU per "node", torch expert backend.

Two "pods" run exactly the command, args and env the builders produce for a 2-node × 1-GPU
`device: cuda` PDRollout (ATP2/ADP1, EP2, pd mode, fine-grained span 1; e2e/harness/pod_launch.py
resolves only pod-specific values), each seeing only its own GPU (CUDA_VISIBLE_DEVICES, as the
device plugin does). Greedy tokens through node 0's /generate are compared with one GPU's
`pdrollout generate` on the same checkpoint and engine config, and both with transformers (fp32,
the reference tests' margin rule). Then node 1's process tree is killed mid-run: node 0's exit code
and time. Writes OUT/multinode2.json and prints a table last.

Usage (repo root, 2 GPUs, after `source e2e/gpu/env.sh`): python -m e2e.gpu tests multinode OUT
  COMMIT=<sha> (recorded in meta)  DEVICE=cpu (a dry run of the mechanics: CPU ranks, no GPUs)
"""
from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PROMPTS = [[(i * 37 + k * 11) % 500 + 2 for k in range(5 + 11 * i)] for i in range(4)]
NEW_TOKENS = 8


def model_dir(work: Path) -> Path:
    """A small Qwen3-MoE in fp32: 16 q / 4 kv heads (ATP2), 8 experts (EP2), 4 layers."""
    from pdrollout.engine.model.checkpoint import write_checkpoint
    from pdrollout.engine.protocol.config import load_preset
    cfg = load_preset("tiny")
    cfg.update(vocab_size=512, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
               num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
               num_experts=8, num_experts_per_tok=2)
    return write_checkpoint(cfg, work / "model", seed=0, dtype="float32")


def launch_two_nodes(out: Path) -> int:
    from pdrollout.engine.protocol.exits import name as exit_name
    from pdrollout.operator import builders
    from pdrollout.operator.models import PDRolloutSpec
    from e2e.harness.hf_reference import MARGIN, hf_greedy
    from e2e.harness.pod_launch import free_port, get_text, http, launch, metric, wait_health, write_config, write_secret

    device = os.environ.get("DEVICE", "cuda")
    work = Path("/tmp/pdrollout-multinode2")
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    model = model_dir(work)
    spec = PDRolloutSpec.model_validate({
        "image": "engine", "model": {"path": str(model), "dtype": "float32"}, "device": device,
        "expertBackend": "torch", "port": free_port(),
        "topology": {"nodes": 2, "gpusPerNode": 1, "expertParallel": 2, "attentionDataParallel": 1},
        "multiplexing": {"activation": "on", "ordering": "fine-grained", "span": 1, "prefillBudgetTokens": 24},
        # both "pods" on one host: NCCL bootstraps over loopback; no RDMA device exists here
        "network": {"socketIfname": "lo", "ibHCAs": ["mlx5_0"]}, "resources": {"rdmaPerNode": 1}})
    name, ns = "gpu2", "bench"
    container = builders.statefulset(name, ns, spec)["spec"]["template"]["spec"]["containers"][0]
    ips = ["127.0.0.2", "127.0.0.3"]
    config = write_config(builders.configmap(name, ns, spec), work / "config", ips[0], free_port())
    secret = write_secret(builders.admin_secret(name, ns, "t" * 64), work / "admin")   # the pods mount it
    pods = []
    for node in (1, 0):
        if device == "cuda":
            os.environ["CUDA_VISIBLE_DEVICES"] = str(node)   # the pod's own GPU
        pods.append(launch(container, pod_name=f"{name}-{node}", node_rank=node, pod_ip=ips[node],
                           config_dir=config, log=out / f"node{node}.log", secret_dir=secret))
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    node1, node0 = pods
    urls = [f"http://{ip}:{spec.port}" for ip in ips]
    t0 = time.monotonic()
    result: dict = {"meta": {"issue": 14, "commit": os.environ.get("COMMIT", "unknown"),
                             "command": "python -m e2e.gpu tests multinode OUT", "machine": platform.node(),
                             "device": device, "nproc": 2, "nodes": 2, "gpus_per_node": 1,
                             "topology": "ATP2/ADP1, EP2, torch expert backend", "mode": "pd",
                             "control": spec.multiplexing.control().model_dump(), "seed": 0}}
    try:
        wait_health(node0, urls[0], 200, timeout=400)
        wait_health(node1, urls[1], 200, timeout=60)
        result["ready_s"] = time.monotonic() - t0
        outs: dict[int, list[int]] = {}

        def gen(i):
            code, body = http(f"{urls[0]}/generate", {"input_ids": PROMPTS[i], "sampling_params": {
                "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}, timeout=300)
            outs[i] = body["output_ids"] if code == 200 else body
        threads = [threading.Thread(target=gen, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        two = [outs[i] for i in range(len(PROMPTS))]
        text = get_text(f"{urls[1]}/metrics")
        result["node1_rank1_steps"] = metric(text, 'pdrollout:rank_steps_total{node="1",rank="1"}')

        # Mid-run loss of node 1: node 0's exit code and time.
        long = threading.Thread(target=lambda: http(f"{urls[0]}/generate", {"input_ids": PROMPTS[3], "sampling_params": {
            "max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}, timeout=120), daemon=True)
        long.start()
        time.sleep(2.0)
        node1.kill_tree()
        t_kill = time.monotonic()
        code = node0.proc.wait(90)
        result["kill"] = {"node0_exit": code, "meaning": exit_name(code), "seconds": time.monotonic() - t_kill}
    finally:
        for p in pods:
            p.kill_tree()
            p.proc.wait(30)

    reqs = "".join(json.dumps({"rid": f"r{i}", "input_ids": p, "sampling_params": {
        "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}) + "\n" for i, p in enumerate(PROMPTS))
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": "0"} if device == "cuda" else {})}
    r = subprocess.run(["pdrollout", "generate", "--model", str(model), "--requests", "-", "--mode", "pd",
                        "--device", device, "--engine-config", str(config / builders.ENGINE_CONFIG_KEY)],
                       input=reqs, capture_output=True, text=True, timeout=600, env=env)
    if r.returncode:
        print(r.stderr[-3000:])
        return 1
    one = [json.loads(line)["output_ids"] for line in r.stdout.splitlines()]
    rows = []
    for i, p in enumerate(PROMPTS):
        ref, margins = hf_greedy(model, p, NEW_TOKENS)
        first = next((k for k, (a, b) in enumerate(zip(two[i], one[i])) if a != b), None)
        rows.append({"prompt_tokens": len(p), "two_gpus": two[i], "one_gpu": one[i], "transformers": ref,
                     "equal_one_gpu": two[i] == one[i], "first_difference": first,
                     "margin_there": margins[first] if first is not None else None,
                     "two_gpus_vs_transformers": _margin_rule(two[i], ref, margins, MARGIN)})
    result["requests"] = rows
    result["pass"] = all(r["equal_one_gpu"] or (r["margin_there"] is not None and r["margin_there"] < MARGIN)
                         for r in rows) and result["kill"]["node0_exit"] == 4
    (out / "multinode2.json").write_text(json.dumps(result, indent=2))
    print(f"ready after {result['ready_s']:.1f}s; node 1 rank 1 steps {result['node1_rank1_steps']}")
    print("| req | prompt | 2 GPUs == 1 GPU | 2 GPUs vs transformers |")
    print("|---|---|---|---|")
    for i, row in enumerate(rows):
        print(f"| r{i} | {row['prompt_tokens']} | {row['equal_one_gpu']} | {row['two_gpus_vs_transformers']} |")
    k = result["kill"]
    print(f"node 1 killed mid-run: node 0 exit {k['node0_exit']} ({k['meaning']}) after {k['seconds']:.1f}s")
    print("PASS" if result["pass"] else "FAIL")
    return 0 if result["pass"] else 1


def _margin_rule(ours, ref, margins, bound) -> str:
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return f"differs at {i} (margin {margins[i]:.2e}{' < ' if margins[i] < bound else ' >= '}{bound})"
    return "equal"


def main() -> int:
    return launch_two_nodes(Path(sys.argv[1]))


if __name__ == "__main__":
    sys.exit(main())
