"""A decode graph's padding rows routed to no expert, against routed as token 0 (the old way).

A step of r rows replays the graph of the next bucket (1, 2, 4, 8, 16, 32, 48, 64); its padding rows
carry token 0 at position 0 and, routed like real rows, all pick token 0's top-k experts, some of
which the real rows do not need: more expert weights read. `qwen3_moe.SKIP_PADDING_ROUTES` routes
them to none. This builds one engine with 32 rows decoding at `ctx`, keeps the inputs of a real
32-row step, and replays the bucket of r rows with rows r.. made padding, under each setting in
turn (the graphs recaptured between), A B A B; the real rows' logits must be equal under both.

P's piecewise graphs pad a forward's tokens up to their bucket too (16, 32, 48, 64, 96, 128, 192, ...),
the padding rows holding the last forward's tokens: `--p-shapes SEGSxNEWxCTX,...` times P forwards
through the pieces with `qwen3_moe.SKIP_P_PADDING_ROUTES` on and off (`bench_engine.p_batch`: segments
of NEW tokens over CTX cached), and records whether the logits repeat (within a capture, across a
recapture) and match the eager forward's (which has no padding).

    python -m e2e.gpu bench padding-routes OUT.json [--rows 3,5,9,17,26] [--ctx 2048] [--reps 50] [--rounds 2]
        [--p-shapes 1x40x2048,4x40x1792,1x130x2048,1x545x2048]
    DEVICE=cpu python -m e2e.gpu bench padding-routes OUT.json     # the CPU: no graphs, a dry run of the rest
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from .bench_engine import p_batch, p_slots
from .fused_step import build, sync
from .harness import parser
from .hbm import replays_ms
from pdrollout.engine.model import qwen3_moe

BUFFERS = ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")


def replay(e, state: dict, rows: int, reps: int) -> tuple[float, torch.Tensor]:
    """ms a replay of the bucket of `rows` real rows (the saved step's first rows; the rest padding
    as graph_inputs leaves it), and the real rows' logits."""
    gr = e.worker.graphs
    b = gr.bucket(rows)
    for name in BUFFERS:
        getattr(gr, name).copy_(state[name])
    gr.input_ids[rows:b].zero_()
    gr.positions[rows:b].zero_()
    gr.seq_lens[rows:b].zero_()
    gr.slot_mapping[rows:b].fill_(gr.null_slot)
    graph, logits, _ = gr.graphs[b]
    return replays_ms(graph, reps), logits[:rows].clone()   # every replay writes the same K/V and logits


def p_forward_ms(e, batch, reps: int) -> tuple[float, torch.Tensor, bool]:
    """Median wall of a P forward through the pieces (issued and complete), its logits, and whether
    every repeat gave the same logits."""
    walls, outs = [], []
    for _ in range(reps + 2):
        batch.prefill_plan = None
        sync(e)
        t0 = time.perf_counter()
        out = e.worker.p_graphs.forward(batch)
        sync(e)
        walls.append((time.perf_counter() - t0) * 1e3)
        outs.append(out.clone())
    return statistics.median(walls[2:]), outs[-1], all(torch.equal(o, outs[0]) for o in outs)


def differ(x: torch.Tensor, y: torch.Tensor) -> dict:
    """How two forwards' logits differ: the largest |difference| and the sampled rows that differ."""
    d = (x - y).abs()
    return {"max": float(d.max()) if d.numel() else 0.0, "rows": int((d.amax(-1) > 0).sum()) if d.numel() else 0,
            "of": int(x.shape[0])}


def main() -> None:
    ap = parser(ctx=2048, reps=50, rounds=2)
    ap.add_argument("--rows", default="3,5,9,17,26")
    ap.add_argument("--p-shapes", default="", help="SEGSxNEWxCTX,...: P forwards through the pieces")
    a = ap.parse_args()
    cpu = os.environ.get("DEVICE") == "cpu"
    rows_list = [int(x) for x in a.rows.split(",") if x]
    shapes = [tuple(int(v) for v in x.split("x")) for x in a.p_shapes.split(",") if x]
    # the CPU runs P's pieces eagerly, through the same buffers and padding
    e, _ = build(cpu, 4 if cpu else 32, 64 if cpu else a.ctx, steps=16, **({"prefill_graph_tokens": 128} if cpu else {}))
    for _ in range(3):
        e.step()
    res = {"meta": {"commit": os.environ.get("COMMIT", ""), "machine": os.environ.get("MACHINE", ""),
                    "gpu": "cpu" if cpu else torch.cuda.get_device_name(), "nproc": 1, "topology": "EP1/ADP1",
                    "ctx": a.ctx, "reps": a.reps, "rounds": a.rounds, "batch": 32}, "rows": []}
    gr, pg = e.worker.graphs, e.worker.p_graphs
    state = {name: getattr(gr, name).clone() for name in BUFFERS} if gr is not None else {}
    ms = {r: {"skip": [], "route": []} for r in rows_list}
    logits = {r: {} for r in rows_list}
    g = torch.Generator().manual_seed(1)
    # each shape on its own slots: a forward writes its tokens' K/V, which would be another shape's
    # context (the twenty-first session's A/B compared forwards over different contexts that way)
    batches, below = {}, 0
    for sh in shapes:
        batches[sh] = p_batch(e.worker, *sh, g, below=below)
        below += p_slots(*sh)
    p_ms = {s: {"skip": [], "route": []} for s in shapes}
    p_repeat = {s: {} for s in shapes}   # mode -> every repeat of the forward gave equal logits
    p_rounds = {s: {} for s in shapes}   # mode -> each round's logits (a recapture between)
    eager = {}
    with torch.inference_mode():   # the reference: the eager forward has no padding rows
        for sh in shapes:
            batches[sh].prefill_plan = None
            eager[sh] = e.worker.model(batches[sh], e.worker.kv).float().clone()
    defaults = qwen3_moe.SKIP_PADDING_ROUTES, qwen3_moe.SKIP_P_PADDING_ROUTES
    for _ in range(a.rounds):
        for mode in ("skip", "route"):
            qwen3_moe.SKIP_PADDING_ROUTES = qwen3_moe.SKIP_P_PADDING_ROUTES = mode == "skip"
            e.worker.recapture()
            for r in rows_list if gr is not None else ():   # the CPU: no decode graphs to replay
                t, logits[r][mode] = replay(e, state, r, a.reps)
                ms[r][mode].append(t)
            for sh in shapes:
                t, out, same = p_forward_ms(e, batches[sh], max(5, a.reps // 5))
                p_ms[sh][mode].append(t)
                p_repeat[sh][mode] = p_repeat[sh].get(mode, True) and same
                p_rounds[sh].setdefault(mode, []).append(out.float())
    qwen3_moe.SKIP_PADDING_ROUTES, qwen3_moe.SKIP_P_PADDING_ROUTES = defaults
    res["p_forwards"] = []
    for sh in shapes:
        tokens = batches[sh].input_ids.shape[0]
        skip, route = statistics.median(p_ms[sh]["skip"]), statistics.median(p_ms[sh]["route"])
        last = {m: r[-1] for m, r in p_rounds[sh].items()}
        res["p_forwards"].append({
            "shape": "x".join(map(str, sh)), "tokens": tokens, "bucket": pg.bucket(tokens), "skip_ms": skip,
            "route_ms": route, "skip_over_route": skip / route, "each_ms": p_ms[sh],
            "same_logits": bool(torch.equal(last["skip"], last["route"])),
            "repeats_equal": p_repeat[sh],
            # across a recapture; against the eager forward (no padding rows at all)
            "rounds_equal": {m: all(torch.equal(x, r[0]) for x in r) for m, r in p_rounds[sh].items()},
            "eager_equal": {m: bool(torch.equal(x, eager[sh])) for m, x in last.items()},
            "differ": {"skip_route": differ(last["skip"], last["route"]),
                       **{f"{m}_eager": differ(x, eager[sh]) for m, x in last.items()}}})
    for r in rows_list:
        if gr is None:
            res["rows"].append({"rows": r})
            continue
        skip, route = statistics.median(ms[r]["skip"]), statistics.median(ms[r]["route"])
        res["rows"].append({"rows": r, "bucket": gr.bucket(r), "skip_ms": skip, "route_ms": route,
                            "skip_over_route": skip / route, "each_ms": ms[r],
                            # the real rows' logits under both (fp32 accumulation: a row's own math)
                            "same_logits": bool(torch.equal(logits[r]["skip"], logits[r]["route"]))})
    e.shutdown()
    Path(a.out).write_text(json.dumps(res, indent=1))
    for row in res["rows"] + res.get("p_forwards", []):
        print(json.dumps({k: v for k, v in row.items() if k != "each_ms"}))


if __name__ == "__main__":
    main()
