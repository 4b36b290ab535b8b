"""What a benchmark's decode steps route to on random weights, and what that does to their time.

The decode floor (`bench_engine.decode_floor_bytes`) counts the experts a layer touches as uniform
top-k routing would: E·(1 − (1 − k/E)^rows). Random weights and greedy decoding need not route that
way: rows that feed the same or similar tokens pick the same experts, and every step then reads
fewer expert weights than the floor assumes. Nor need two runs of one trace generate the same tokens:
greedy decoding on near-flat logits flips with the batch a row happens to share. This measures both
on the engine:

  routing  B rows of `ctx` random prompt tokens decode `new` tokens greedily, their routing reported
           (return_routed_experts; D steps then run eagerly): per decode step and layer, the distinct
           experts over the rows and over the first `subset` rows, beside the uniform expectation and
           beside the same count over the rows' last random prompt tokens; how repetitive the
           generated tokens are
  batch    the same prompts again without routing (graph replays): all B rows, then the first
           `subset` rows alone; each row's greedy tokens against the routed run's
  replay   the B-row and `subset`-row graphs replayed with the decode state's tokens, with random
           tokens and with one token in every row at the same positions: a step's time against
           what its rows route to

    python -m e2e.gpu bench routing OUT.json [--batch 64] [--subset 26] [--ctx 2048] [--new 128]
    DEVICE=cpu python -m e2e.gpu bench routing OUT.json     # the tiny preset on the CPU: a dry run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from .hbm import replays_ms
from pdrollout.engine.protocol.config import EngineConfig, load_preset
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.scheduler.request import SamplingParams

BASELINE = 64   # the prompt's last positions whose routing is reported: random tokens by construction


def uniform_touched(experts: int, top_k: int, rows: int) -> float:
    return experts * (1 - (1 - top_k / experts) ** rows)


def run(e: Engine, prompts: list[list[int]], new: int, tag: str, routes: bool) -> dict[str, dict]:
    """Greedy decode of every prompt; rid -> {tokens, routes (int32 [pos, layers, k]) or None}."""
    out: dict[str, dict] = {}
    for i, p in enumerate(prompts):
        rid = f"{tag}{i}"
        e.submit(rid, p, SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=0.0),
                 routes_from=len(p) - BASELINE if routes else None)
        out[rid] = {"tokens": [], "routes": None}
    while e.has_unfinished():
        for o in e.step():
            out[o.rid]["tokens"] += o.new_token_ids
            if o.finished and o.routed_experts is not None:
                out[o.rid]["routes"] = o.routed_experts
    return out


def distinct(routes: list[np.ndarray], pos: int) -> np.ndarray:
    """Per layer: the distinct experts the rows' position `pos` routes to."""
    picks = np.stack([r[pos] for r in routes])             # [rows, layers, k]
    return np.array([len(set(picks[:, l].ravel().tolist()) - {-1}) for l in range(picks.shape[1])])


def spread(xs) -> dict:
    xs = sorted(float(x) for x in xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1]} if xs else {}


def routing_stats(res: dict[str, dict], cfg: dict, ctx: int, new: int, subset: int) -> dict:
    layers, k, experts = cfg["num_hidden_layers"], cfg["num_experts_per_tok"], cfg["num_experts"]
    routes = [np.frombuffer(v["routes"], dtype=np.int32).reshape(-1, layers, k) for v in res.values()]
    # routes cover positions [ctx - BASELINE, ctx + new - 1): prompt positions, then D steps' inputs
    decode_pos = range(BASELINE, BASELINE + new - 1)
    stats = {}
    for name, rows in (("all", routes), ("subset", routes[:subset])):
        d = [distinct(rows, p).mean() for p in decode_pos]
        b = [distinct(rows, p).mean() for p in range(BASELINE)]
        stats[name] = {"rows": len(rows), "uniform": uniform_touched(experts, k, len(rows)),
                       "decode_distinct": spread(d), "random_prompt_distinct": spread(b),
                       # the first and last quarter of the decode: whether routing narrows as tokens repeat
                       "decode_distinct_first_quarter": spread(d[:max(1, len(d) // 4)]),
                       "decode_distinct_last_quarter": spread(d[-max(1, len(d) // 4):])}
    toks = [v["tokens"] for v in res.values()]
    repeat = [sum(a == b for a, b in zip(t, t[1:])) / max(1, len(t) - 1) for t in toks]
    per_step = [len({t[j] for t in toks}) for j in range(new)]
    common = Counter(x for t in toks for x in t).most_common(3)
    total = sum(len(t) for t in toks)
    stats["tokens"] = {"repeat_of_previous": spread(repeat), "distinct_in_row": spread(len(set(t)) for t in toks),
                       "distinct_across_rows_per_step": spread(per_step),
                       "most_common": [[tok, n / total] for tok, n in common]}
    return stats


def agreement(a: dict[str, dict], b: dict[str, dict]) -> dict:
    """Row by row (in order): equal token lists, and where the first difference falls."""
    first = []
    for x, y in zip(a.values(), b.values()):
        x, y = x["tokens"], y["tokens"]
        first.append(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)))
    n = len(a[next(iter(a))]["tokens"])
    return {"rows": len(first), "equal": sum(f == n for f in first), "first_difference": spread(first)}


def replay_ms(e: Engine, rows: int, ids: torch.Tensor | None, reps: int) -> float:
    """A replay of the graph for `rows`, its input tokens replaced by `ids` (None: as the last step left
    them), positions and slots as the last step left them."""
    g = e.worker.graphs
    bucket = g.bucket(rows)
    if ids is not None:
        g.input_ids[:bucket].copy_(ids[:bucket])
    return replays_ms(g.graphs[bucket][0], reps)


def replays(e: Engine, rows: int, cfg: dict, g: torch.Generator, reps: int) -> dict | None:
    """Right after a run whose last step replayed `rows` rows: that graph with the step's own tokens,
    random tokens, one token in every row, and its own tokens again (None on the CPU: no graphs)."""
    if e.worker.graphs is None:
        return None
    n = e.worker.graphs.bucket(rows)
    dev = e.worker.device
    state = e.worker.graphs.input_ids[:n].clone()
    rand = torch.randint(2, cfg["vocab_size"], (n,), generator=g).to(dev)
    same = torch.full((n,), int(rand[0]), device=dev)
    return {"bucket": n, "uniform_touched": uniform_touched(cfg["num_experts"], cfg["num_experts_per_tok"], n),
            "state_ms": replay_ms(e, rows, state, reps), "random_ms": replay_ms(e, rows, rand, reps),
            "one_token_ms": replay_ms(e, rows, same, reps), "state_again_ms": replay_ms(e, rows, state, reps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--subset", type=int, default=26,
                    help="rows of a typical P1 step (docs/perf/HISTORY.md, twenty-first session)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    cpu = os.environ.get("DEVICE") == "cpu"
    if cpu:
        a.batch, a.subset, a.ctx, a.new, a.reps = min(a.batch, 6), min(a.subset, 3), min(a.ctx, 96), min(a.new, 8), 1
    cfg = load_preset("tiny" if cpu else "qwen3-30b-a3b")
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(cfg))
    device = dict(device="cpu", dtype="float32", num_blocks=4096) if cpu else \
        dict(device="cuda", dtype="bfloat16", kv_cache_bytes=40 << 30)
    e = Engine(EngineConfig(model=str(tmp), random_weights=True, mode="mixed", max_running=a.batch,
                            block_size=16, **device))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, cfg["vocab_size"], (a.ctx,), generator=g).tolist() for _ in range(a.batch)]
    routed = run(e, prompts, a.new, "routed", routes=True)
    replay = {}
    graphed = run(e, prompts, a.new, "graphed", routes=False)
    replay[str(a.batch)] = replays(e, a.batch, cfg, g, a.reps)
    alone = run(e, prompts[:a.subset], a.new, "alone", routes=False)
    replay[str(a.subset)] = replays(e, a.subset, cfg, g, a.reps)
    res = {"meta": {"commit": os.environ.get("COMMIT") or subprocess.run(
                        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
                    "machine": os.environ.get("MACHINE", ""), "gpu": "cpu" if cpu else torch.cuda.get_device_name(),
                    "nproc": 1, "topology": "EP1/ADP1", "model": "tiny" if cpu else "qwen3-30b-a3b (random bf16 weights)",
                    "batch": a.batch, "subset": a.subset, "ctx": a.ctx, "new": a.new, "greedy": True},
           "routing": routing_stats(routed, cfg, a.ctx, a.new, a.subset),
           "batch": {"graphed_vs_routed": agreement(graphed, routed),
                     "subset_alone_vs_graphed": agreement(alone, dict(list(graphed.items())[:a.subset]))},
           "replay": replay if e.worker.graphs is not None else None}
    e.shutdown()
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
