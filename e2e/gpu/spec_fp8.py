"""Issue 23 on one GPU: do the FP8 and speculation paths, written and tested on CPU, hold on CUDA?

  fp8     a random block-FP8 tiny model (one dense layer too) and its dequantized bf16 twin: greedy
          tokens and prompt logits on the GPU (the FP8 engine dequantizes per weight, so they should
          equal the twin's); the dequantize + GEMM path timed at an expert's shape of the 30B-A3B
          model; the FP8 and bf16 GEMM peaks of this
          GPU (8192^3, per-tensor scales) in the same call
  spec    greedy tokens with n-gram speculation (k = 1, 4) equal those without, fp32 and bf16, in
          normal / mixed / pd on the GPU, with the acceptance counts
Usage (repo root): source e2e/gpu/env.sh; python -m e2e.gpu tests spec-fp8 OUT [fp8] [spec]
DEVICE=cpu: a dry run of the mechanics. Writes OUT/spec_fp8.json, prints a short table last.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdrollout.engine.cli import main as cli_main  # noqa: E402
from pdrollout.engine.model import fp8  # noqa: E402
from pdrollout.engine.model.checkpoint import write_checkpoint, write_dequantized  # noqa: E402
from pdrollout.engine.protocol.config import ControlSettings, EngineConfig, load_preset  # noqa: E402
from pdrollout.engine.runtime.engine import Engine  # noqa: E402
from pdrollout.engine.scheduler.request import SamplingParams  # noqa: E402

DEVICE = os.environ.get("DEVICE", "cuda")
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [(i * 7) % 24 for i in range(11)] * 2, [3, 1, 4, 1, 5, 9, 2, 6],
           [7, 7, 7, 7, 7, 7], [(i * 37) % 300 + 2 for i in range(19)]]


def run(model_dir, dtype: str, mode: str = "pd", spec_k: int = 0, new: int = 16):
    control = ControlSettings(prefill_budget_tokens=24, span="auto")
    spec = {"speculative": "ngram", "speculative_k": spec_k} if spec_k else {}
    eng = Engine(EngineConfig(model=str(model_dir), device=DEVICE, dtype=dtype, mode=mode, block_size=4,
                              num_blocks=256, mixed_chunk_tokens=20, control=control, **spec))
    vocab = eng.worker.cfg.vocab_size
    for i, p in enumerate(PROMPTS):
        eng.submit(f"r{i}", [t % vocab for t in p],
                   SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
    recs = [r for r in eng.records if r.spec_verify]
    return out, {"proposed": sum(r.spec_proposed for r in recs), "accepted": sum(r.spec_accepted for r in recs)}


def _time(fn, iters: int = 20) -> float:
    fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def stage_fp8(tmp: Path) -> dict:
    cfg = tmp / "cfg.json"
    cfg.write_text(json.dumps({**load_preset("tiny"), "mlp_only_layers": [1]}))
    assert cli_main(["checkpoint", "--config", str(cfg), "--out", str(tmp / "fp8"), "--dtype", "fp8",
                     "--seed", "3"]) == 0
    write_dequantized(tmp / "fp8", tmp / "twin16", dtype="bfloat16")
    a, _ = run(tmp / "fp8", "bfloat16")
    b, _ = run(tmp / "twin16", "bfloat16")
    res = {"greedy_fp8_equals_bf16_twin": a == b, "requests": len(a),
           "tokens_differing": sum(x != y for k in a for x, y in zip(a[k], b[k]))}
    # The dequantize path at one expert's gate_up shape (2 * 768 x 2048) and 4096 routed rows.
    dev = torch.device(DEVICE)
    g = torch.Generator(device="cpu").manual_seed(1)
    w = (torch.randn(1536, 2048, generator=g) * 2048 ** -0.5).to(dev)
    q, s = fp8.quantize(w, (128, 128))
    x = torch.randn(4096, 2048, generator=g).to(dev, torch.bfloat16)
    flops = 2 * 4096 * 1536 * 2048
    t_deq = _time(lambda: fp8.linear(x, q, s, (128, 128)))
    res["dequantize_path"] = {"ms": t_deq * 1e3, "tflops": flops / t_deq / 1e12}
    if DEVICE == "cuda":   # the peaks of this GPU, same call
        n = 8192
        a8 = torch.randn(n, n, device=dev).to(fp8.FP8)
        b8 = torch.randn(n, n, device=dev).to(fp8.FP8).t()
        one = torch.ones((), device=dev)
        t8 = _time(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        a16, b16 = torch.randn(n, n, device=dev, dtype=torch.bfloat16), torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        t16 = _time(lambda: a16 @ b16)
        res["peak_tflops"] = {"fp8_e4m3": 2 * n ** 3 / t8 / 1e12, "bf16": 2 * n ** 3 / t16 / 1e12}
    return res


def stage_spec(tmp: Path) -> dict:
    model = write_checkpoint({**load_preset("tiny"), "vocab_size": 24}, tmp / "loopy", seed=0)
    res = {}
    for dtype in ("float32", "bfloat16"):
        for mode in ("normal", "mixed", "pd"):
            base, _ = run(model, dtype, mode)
            for k in (1, 4):
                out, acc = run(model, dtype, mode, spec_k=k)
                res[f"{dtype}/{mode}/k{k}"] = {"equal": out == base, **acc}
    return res


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    stages = sys.argv[2:] or ["fp8", "spec"]
    result = {"meta": {"issue": 23, "command": "python -m e2e.gpu tests spec-fp8 OUT " + " ".join(stages),
                       "commit": os.environ.get("COMMIT", "unknown"), "device": DEVICE,
                       "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
                       "torch": torch.__version__}}
    with tempfile.TemporaryDirectory() as d:
        for st in stages:
            t = time.monotonic()
            result[st] = {"fp8": stage_fp8, "spec": stage_spec}[st](Path(d))
            print(f"{st}: {time.monotonic() - t:.1f} s", flush=True)
            (out / "spec_fp8.json").write_text(json.dumps(result, indent=1))
    ok = True
    if "fp8" in result:
        f = result["fp8"]
        ok &= f["greedy_fp8_equals_bf16_twin"]
        print(f"fp8: greedy equal to the bf16 twin: {f['greedy_fp8_equals_bf16_twin']} "
              f"({f['tokens_differing']} tokens differ)")
        m = f["dequantize_path"]
        print(f"dequantize path 4096x2048x1536: {m['ms']:.3f} ms ({m['tflops']:.1f} TFLOP/s)")
        if "peak_tflops" in f:
            print(f"peaks 8192^3: fp8 {f['peak_tflops']['fp8_e4m3']:.0f}, bf16 {f['peak_tflops']['bf16']:.0f} TFLOP/s")
    if "spec" in result:
        print("| dtype/mode/k | equal | proposed | accepted |\n|---|---|---|---|")
        for k, v in result["spec"].items():
            ok &= v["equal"]
            print(f"| {k} | {v['equal']} | {v['proposed']} | {v['accepted']} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
