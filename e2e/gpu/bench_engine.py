"""Decode-step and prefill-chunk speed of the engine on one GPU, against their floors.

Builds the Qwen3-30B-A3B shape with random bf16 weights on the device (no checkpoint on disk),
prefills a batch through the engine in `normal` mode (8k-token chunks), then times decode steps
(CUDA-graph replay alone, and whole engine steps with planning and sampling).
Usage: python -m e2e.gpu bench engine [--layers 48] [--batch 64] [--ctx 2048] [--mode normal|pd] --out results.json
  --fp8                  block-FP8 weights (the config's quantization_config, as FP8 releases declare)
  --speculative-k K      speculation, K drafts per decode row: the decode steps are then verify
                         steps, and tokens per row per step are reported beside their time
  --prefill-graph-tokens N  P's piecewise graphs up to N tokens (0: eager); P forwards of an epoch's
                         shapes are timed both ways (p_forwards)
  --speculative ngram|mtp  the proposer (default ngram); mtp adds one MTP layer to the config
                         (num_nextn_predict_layers: 1; random weights build the head)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from .hbm import copy_bw, replays_ms  # noqa: E402  (the copy rate all floors here are taken against)

from pdrollout.engine.protocol.config import ControlSettings, EngineConfig, ModelConfig, load_preset
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.scheduler.request import SamplingParams


def decode_floor_bytes(model, rows: int, experts: int, top_k: int, tied: bool = False) -> tuple[float, float]:
    """Bytes of weights one decode step of `rows` rows must read, and the experts a layer's routing
    touches: E·(1 − (1 − k/E)^rows), the expectation under uniform top-k routing (~126 of 128 at 64
    rows × top-8, 8 at one row). Counting every weight, as the floor did until the twentieth session,
    put one row's floor at 14.5 ms against a 3.6-ms replay, and the embedding's table (0.6 GB: a row
    per token is read) in every floor."""
    touched = experts * (1 - (1 - top_k / experts) ** rows)
    total = 0.0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight") and not tied:
            size = size * min(rows, p.shape[0]) / p.shape[0]
        elif ".experts." in name:
            size = size * touched / experts
        total += size
    return total, touched


def measure_ceilings():
    bw = copy_bw()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    flops = 2 * 8192 ** 3 * 10 / (time.perf_counter() - t)
    return bw, flops


# P forwards as a P epoch carries them (continuation turns over cached context), (segments, new
# tokens each, context before): P1's epochs carried 160-320 new tokens (HISTORY.md, fourth session); and the 8k
# chunk of four fresh prompts alone (the forward inside `prefill_chunk_ms`' engine step)
P_SHAPES = ((8, 32, 1792), (16, 16, 1024), (4, 256, 1536), (4, 2048, 0))


def p_batch(w, segs: int, new: int, ctx: int, g: torch.Generator, below: int = 0):
    """A P forward of `segs` segments of `new` tokens over `ctx` cached ones, on free slots at the
    top of the cache (no request holds them), `below` slots under the top: batches that must not
    read each other's K/V as their context take apart regions (p_slots gives a batch's). Random
    tokens: one token repeated routes a whole segment to the same 8 experts, which makes the expert
    GEMMs few and large (the 8k forward ran 8 % faster on it than on a real batch)."""
    from pdrollout.engine.model.qwen3_moe import ForwardBatch, SeqSlice
    dev, top = w.device, w.kv.null_slot - below
    ids, pos, slots, seqs, t = [], [], [], [], 0
    base = top - p_slots(segs, new, ctx)
    for i in range(segs):
        first = base + i * (ctx + new)
        ids += torch.randint(2, w.cfg.vocab_size, (new,), generator=g).tolist()
        pos += range(ctx, ctx + new)
        slots += range(first + ctx, first + ctx + new)
        seqs.append(SeqSlice(t, new, ctx + new, torch.arange(first, first + ctx + new, device=dev)))
        t += new
    long = lambda xs: torch.tensor(list(xs), dtype=torch.long, device=dev)
    return ForwardBatch(long(ids), long(pos), long(slots), seqs, long(range(new - 1, t, new)))


def p_slots(segs: int, new: int, ctx: int) -> int:
    """The KV slots p_batch's forward of this shape reads and writes."""
    return segs * (ctx + new)


def p_runs(w, batch) -> dict:
    """The ways a P epoch runs `batch`: eager, and through P's piecewise graphs where they hold it."""
    runs = {"eager": lambda: w.model(batch, w.kv)}
    if w.p_graphs is not None and w.p_graphs.fits(batch):
        runs["graphed"] = lambda: w.p_graphs.forward(batch)
    return runs


def time_p_forwards(e, reps: int = 10) -> dict:
    """Each P_SHAPES forward eager and through P's piecewise graphs: wall (issued and complete)
    and issuing time (the host's share), medians of `reps`."""
    w = e.worker
    out = {}
    g = torch.Generator().manual_seed(1)
    for segs, new, ctx in P_SHAPES:
        batch = p_batch(w, segs, new, ctx, g)
        row = {"tokens": batch.input_ids.shape[0], "segments": segs}
        for name, run in p_runs(w, batch).items():
            walls, issues = [], []
            for _ in range(reps + 2):
                batch.prefill_plan = None
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                run()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
                issues.append(t1 - t0)
            walls, issues = sorted(walls[2:]), sorted(issues[2:])
            row[f"{name}_ms"], row[f"{name}_issue_ms"] = walls[reps // 2] * 1e3, issues[reps // 2] * 1e3
        out[f"{segs}x{new}"] = row
    return out


def host_profile(e, steps: int, path: str) -> None:
    """Where a decode step's host time goes: the functions with the most own time over `steps`
    engine steps (the GPU's share shows as the synchronize the step waits in)."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        e.step()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    Path(path).write_text(f"{steps} decode steps under cProfile\n" + text.getvalue())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--experts-kernel", choices=["auto", "grouped", "fused"], default="auto")
    ap.add_argument("--qk-prologue", choices=["auto", "torch", "fused"], default="auto")
    ap.add_argument("--add-norm", choices=["auto", "torch", "fused"], default="auto")
    ap.add_argument("--kv-splits", default="auto", help="decode attention's context splits: N or auto (the engine's)")
    ap.add_argument("--router", choices=["auto", "torch", "fused"], default="auto")
    ap.add_argument("--prefill-attention", choices=["auto", "sdpa", "triton", "hybrid"], default="auto")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 weights (quantization_config)")
    ap.add_argument("--speculative-k", type=int, default=0, help="speculation with K drafts (0: off)")
    ap.add_argument("--speculative", choices=["ngram", "mtp"], default="ngram", help="the proposer under -k")
    # pd: the decode steps on D's own stream, as a pd server runs them (the 8k chunks' figure then
    # includes the end of the prefill riding beside D: compare it under normal)
    ap.add_argument("--mode", choices=["normal", "pd"], default="normal")
    ap.add_argument("--temperature", type=float, default=0.0, help="1.0: every row samples (an RL rollout)")
    ap.add_argument("--priority-stream", choices=["d", "none"], default=None)
    ap.add_argument("--align", choices=["auto", "torch"], default="auto",
                    help="torch: the MoE align as torch ops at every size (the one-launch kernel's A/B)")
    ap.add_argument("--qkv", choices=["fused", "separate"], default="fused",
                    help="separate: three q/k/v GEMMs a layer (Attention.fuse_qkv's A/B)")
    ap.add_argument("--prefill-graph-tokens", type=int, default=None,
                    help="P's piecewise graphs up to this many tokens (0: P eager; default: the engine's)")
    ap.add_argument("--host-profile", default=None, metavar="PATH",
                    help="cProfile of --steps more decode steps, top functions by own time into PATH")
    ap.add_argument("--out", default="bench_engine.json")
    a = ap.parse_args()
    if a.align == "torch":
        from pdrollout.engine.model import fused_moe
        fused_moe.ALIGN_KERNEL_MAX_PAIRS = 0
    if a.qkv == "separate":
        from pdrollout.engine.model.qwen3_moe import Qwen3MoeModel
        Qwen3MoeModel.fuse_projections = lambda self: 0
    bw, peak = measure_ceilings()
    cfg_d = load_preset("qwen3-30b-a3b")
    cfg_d["num_hidden_layers"] = a.layers
    if a.fp8:
        from pdrollout.engine.model.checkpoint import FP8_CONFIG
        cfg_d["quantization_config"] = dict(FP8_CONFIG)
    if a.speculative_k and a.speculative == "mtp":
        cfg_d["num_nextn_predict_layers"] = 1
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(cfg_d))
    cfg = ModelConfig.from_dict(cfg_d)
    t0 = time.perf_counter()
    e = Engine(EngineConfig(model=str(tmp), device="cuda", dtype="bfloat16", random_weights=True, mode=a.mode,
                            max_running=a.batch, kv_cache_bytes=40 << 30, block_size=16,
                            experts_kernel=a.experts_kernel, qk_prologue=a.qk_prologue, add_norm=a.add_norm,
                            decode_kv_splits=a.kv_splits if a.kv_splits == "auto" else int(a.kv_splits),
                            router=a.router, prefill_attention=a.prefill_attention, priority_stream=a.priority_stream,
                            prefill_graph_tokens=a.prefill_graph_tokens,
                            **({"speculative": a.speculative, "speculative_k": a.speculative_k}
                               if a.speculative_k else {}),
                            control=ControlSettings(prefill_budget_tokens=a.chunk)))
    build_s = time.perf_counter() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in e.worker.model.parameters())
    # parameters, not bytes (FP8 weights are one byte; their scales are counted in the bytes only)
    # and not the MTP head's (the prefill-FLOP estimate below is the target's own layers)
    weight_params = sum(p.numel() for n, p in e.worker.model.named_parameters()
                        if not n.endswith("scale_inv") and not n.startswith("mtp."))
    g = torch.Generator().manual_seed(0)
    for i in range(a.batch):
        ids = torch.randint(2, cfg.vocab_size, (a.ctx,), generator=g).tolist()
        e.submit(f"r{i}", ids, SamplingParams(max_new_tokens=a.steps * (2 if a.host_profile else 1) + 8, temperature=a.temperature,
                                              ignore_eos=True))
    prefill_times, prefill_tokens = [], []
    while any(r.status.value != "decode" for r in e.schedulers[0].reqs.values()):
        torch.cuda.synchronize()
        t = time.perf_counter()
        launched = e.launch()
        torch.cuda.synchronize()
        prefill_times.append(time.perf_counter() - t)
        prefill_tokens.append(launched[0].prefill_tokens)
        e.finish(launched)
    # Decode: whole engine steps, then graph replay alone. Under pd the last P epoch may still be in
    # flight when every row reads `decode`: step until each row has its first token, or the timed
    # steps below would count D steps of fewer rows.
    while any(not r.output for r in e.schedulers[0].reqs.values()):
        e.step()
    for _ in range(3):
        e.step()
    torch.cuda.synchronize()
    n_records = len(e.records)
    tokens = 0
    t = time.perf_counter()
    for _ in range(a.steps):
        tokens += sum(len(o.new_token_ids) for o in e.step())
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t) / a.steps
    recs = e.records[n_records:]
    spec = {"speculative": a.speculative if a.speculative_k else None,
            "speculative_k": a.speculative_k, "tokens_per_row_step": tokens / a.steps / a.batch,
            "spec_verify_steps": sum(1 for r in recs if r.spec_verify),
            "spec_proposed": sum(r.spec_proposed for r in recs), "spec_accepted": sum(r.spec_accepted for r in recs),
            "graphed_steps": sum(1 for r in recs if r.graph)}   # of a.steps: D replayed its graph
    def replay(tokens: int) -> float:
        """Seconds a replay of the graph that a step of `tokens` graph rows takes (nan: none)."""
        graphs = getattr(e.worker.graphs, "graphs", {})
        if not graphs or not e.worker.graphs.fits(tokens):
            return float("nan")
        # one untimed replay first, as every replay timed here (MS1's figures before the
        # twenty-third session timed the first replay too)
        return replays_ms(graphs[e.worker.graphs.bucket(tokens)][0], a.steps) / 1e3
    replay_s = replay(a.batch)
    # under speculation a D step is a verify step: each row's k + 1 positions are graph rows
    spec["verify_replay_ms"] = replay(a.batch * (1 + a.speculative_k)) * 1e3 if a.speculative_k else None
    if a.host_profile:   # after the timed steps and replays: the profiler's overhead stays out of them
        host_profile(e, a.steps, a.host_profile)
    # Floors. Decode: the KV read and the weights a step reads (`decode_floor_bytes`)
    ctx_now = a.ctx + 3 + a.steps
    kv_bytes = a.batch * ctx_now * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    read_bytes, touched = decode_floor_bytes(e.worker.model, a.batch * (1 + a.speculative_k),
                                             cfg.num_experts, cfg.num_experts_per_tok, cfg.tie_word_embeddings)
    decode_floor = (read_bytes + kv_bytes) / bw
    active = (weight_params - cfg.vocab_size * cfg.hidden_size * 2 -
              cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size) + \
        cfg.num_hidden_layers * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size + \
        cfg.vocab_size * cfg.hidden_size / a.chunk * 4          # lm_head only on the last rows
    full = [i for i, n in enumerate(prefill_tokens) if n == a.chunk]
    chunk_s = sorted(prefill_times[i] for i in full)[len(full) // 2] if full else float("nan")
    attn_flops = 4 * a.chunk * a.ctx / 2 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    chunk_flops = 2 * active * a.chunk + attn_flops
    res = {"meta": {"commit": os.environ.get("COMMIT", ""), "machine": os.environ.get("MACHINE", ""),
                    "nproc": 1, "topology": "EP1/ADP1", "batch": a.batch, "ctx": a.ctx, "chunk": a.chunk},
           "gpu": torch.cuda.get_device_name(), "layers": a.layers, "batch": a.batch, "ctx": a.ctx,
           "fp8": a.fp8, **spec,
           "experts": e.worker.backends.name, "qk_prologue": a.qk_prologue, "add_norm": a.add_norm,
           "kv_splits": a.kv_splits, "router": a.router, "align": a.align, "qkv": a.qkv, "prefill_attention": a.prefill_attention,
           "prefill_kernel": e.worker.backends.attention.prefill,   # what auto resolved to
           "mode": a.mode, "priority_stream": a.priority_stream, "temperature": a.temperature,
           "copy_bw_tbs": bw / 1e12, "bf16_tflops": peak / 1e12, "weights_gb": weight_bytes / 1e9,
           "engine_build_s": build_s, "decode_step_ms": step_s * 1e3, "decode_replay_ms": replay_s * 1e3,
           "decode_floor_ms": decode_floor * 1e3, "decode_floor_experts_touched": touched,
           "decode_floor_all_weights_ms": (weight_bytes + kv_bytes) / bw * 1e3, "decode_replay_over_floor": replay_s / decode_floor,
           "decode_step_over_floor": step_s / decode_floor,
           "decode_ms_per_token": step_s / max(spec["tokens_per_row_step"], 1e-9) * 1e3, "prefill_chunk_tokens": a.chunk,
           "prefill_chunk_ms": chunk_s * 1e3, "prefill_chunk_ms_each": [round(prefill_times[i] * 1e3, 2) for i in full],
           "prefill_tflops": chunk_flops / chunk_s / 1e12,
           "prefill_fraction_of_peak": chunk_flops / chunk_s / peak}
    res["p_forwards"] = time_p_forwards(e)
    if a.chunk == 8192 and a.ctx == 2048:   # the chunk's forward alone: the same FLOPs as the step's
        fwd = res["p_forwards"]["4x2048"]
        for name in ("eager", "graphed"):
            if f"{name}_ms" in fwd:
                res[f"prefill_forward_{name}_fraction_of_peak"] = chunk_flops / (fwd[f"{name}_ms"] / 1e3) / peak
    res["prefill_graph_tokens"] = e.worker.p_graphs.buckets[-1] if e.worker.p_graphs is not None else 0
    Path(a.out).write_text(json.dumps(res, indent=1))
    w = max(len(k) for k in res)
    for k, v in res.items():
        print(f"{k:<{w}}  {v:.4g}" if isinstance(v, float) else f"{k:<{w}}  {v}")


if __name__ == "__main__":
    main()
