"""Does where a row's KV blocks lie change a decode step's time?

A server's KV pool hands out blocks in the order requests free and take them, so a session's blocks
end up anywhere in the pool, and two identical servers place them differently (a closed loop's
timing decides the order). A decode graph is replayed here with the same rows, positions and
context, the rows' block tables pointing either at runs of consecutive blocks (a row's context in
one stretch of memory) or at blocks drawn at random from the whole pool (a row's 16-token blocks
spread over every page of each layer's cache). Both placements hold the same K/V (random values
written to the consecutive blocks, then copied to the scattered ones), so the rows attend to the
same data and route to the same experts: their logits must be equal, which is checked. A first
version left the scattered blocks as the pool holds them (zeros) and ran 25–33 % faster there: the
rows attended to nothing and routed elsewhere (a decode step's time is mostly its experts').
Placements alternate, A B A B, `rounds` times.

    python -m e2e.gpu kernels kv-scatter OUT.json [--rows 1,8,26,64] [--ctx 2048] [--reps 50] [--rounds 3]
    DEVICE=cpu python -m e2e.gpu kernels kv-scatter OUT.json     # the CPU: checks the tables it builds, no timing
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import torch

from .fused_step import build
from .harness import parser
from .hbm import replays_ms


def tables(rows: int, blocks: int, pool: int, placement: str, g: torch.Generator) -> torch.Tensor:
    """int32 [rows, blocks]: each row's block ids, consecutive (row i from i·blocks) or drawn at
    random without repeats from the rest of the pool (the two placements share no block)."""
    n = rows * blocks
    if 2 * n > pool:
        raise SystemExit(f"two placements of {rows} rows × {blocks} blocks do not fit a pool of {pool} blocks")
    if placement == "consecutive":
        ids = torch.arange(n, dtype=torch.int32)
    else:
        ids = (torch.randperm(pool - n, generator=g)[:n] + n).to(torch.int32)
    return ids.view(rows, blocks)


def slots_of(table: torch.Tensor, ctx: int, bs: int) -> torch.Tensor:
    """The rows' first `ctx` slots, [rows, ctx] (int64)."""
    t = table.to(torch.int64)
    return (t[:, :, None] * bs + torch.arange(bs, device=t.device)).reshape(t.shape[0], -1)[:, :ctx]


def fill(e, rows: int, ctx: int, src: torch.Tensor, dst: torch.Tensor, g: torch.Generator) -> None:
    """Random K/V (unit normal) into every layer's `src` slots, the same values into `dst`'s."""
    bs = e.worker.graphs.block_size
    a, b = slots_of(src, ctx, bs).reshape(-1), slots_of(dst, ctx, bs).reshape(-1)
    for cache in (*e.worker.kv.k, *e.worker.kv.v):
        cache[a] = torch.randn((a.numel(), *cache.shape[1:]), generator=g, device=cache.device).to(cache.dtype)
        cache[b] = cache[a]


def replay_ms(e, rows: int, ctx: int, table: torch.Tensor, reps: int) -> tuple[float, torch.Tensor]:
    """ms a replay of the rows' bucket with `table` as their block tables, and its logits."""
    gr = e.worker.graphs
    b = gr.bucket(rows)
    bs = gr.block_size
    gr.positions[:rows].fill_(ctx - 1)
    gr.seq_lens[:rows].fill_(ctx)
    gr.block_tables[:rows, :table.shape[1]].copy_(table)
    gr.slot_mapping[:rows].copy_(slots_of(table, ctx, bs)[:, -1])   # the new token's K/V: its row's last slot
    gr.seq_lens[rows:b].zero_()            # the bucket's padding rows, as graph_inputs leaves them
    gr.slot_mapping[rows:b].fill_(gr.null_slot)
    gr.input_ids[rows:b].zero_()
    graph, logits, _ = gr.graphs[b]
    return replays_ms(graph, reps), logits[:rows].clone()


def main() -> None:
    ap = parser(ctx=2048, reps=50, rounds=3)
    ap.add_argument("--rows", default="1,8,26,64")
    a = ap.parse_args()
    cpu = os.environ.get("DEVICE") == "cpu"
    rows_list = [int(x) for x in a.rows.split(",")]
    if cpu:
        rows_list, a.ctx = [min(r, 2) for r in rows_list[:2]], 64
    e, _ = build(cpu, max(rows_list), a.ctx, steps=8)
    pool = e.worker.num_blocks
    blocks = -(-a.ctx // e.config.block_size)
    g = torch.Generator().manual_seed(0)
    g_dev = torch.Generator(device=e.worker.device).manual_seed(0) if e.worker.graphs is not None else None
    out = {"meta": {"commit": os.environ.get("COMMIT", ""), "machine": os.environ.get("MACHINE", ""),
                    "gpu": "cpu" if cpu else torch.cuda.get_device_name(), "nproc": 1, "topology": "EP1/ADP1",
                    "ctx": a.ctx, "reps": a.reps, "rounds": a.rounds, "pool_blocks": pool,
                    "block_size": e.config.block_size}, "rows": []}
    for rows in rows_list:
        t = {p: tables(rows, blocks, pool, p, g) for p in ("consecutive", "random")}
        row = {"rows": rows, "distinct_blocks": {p: int(x.unique().numel()) for p, x in t.items()}}
        if e.worker.graphs is not None:
            dev = e.worker.device
            t = {p: x.to(dev) for p, x in t.items()}
            fill(e, rows, a.ctx, t["consecutive"], t["random"], g_dev)
            ms, logits = {p: [] for p in t}, {}
            for _ in range(a.rounds):
                for p in t:
                    m, logits[p] = replay_ms(e, rows, a.ctx, t[p], a.reps)
                    ms[p].append(m)
            row.update({f"{p}_ms": statistics.median(v) for p, v in ms.items()}, each_ms=ms,
                       same_logits=bool(torch.equal(logits["consecutive"], logits["random"])),
                       random_over_consecutive=statistics.median(ms["random"]) / statistics.median(ms["consecutive"]))
        out["rows"].append(row)
        print(json.dumps(row))
    e.shutdown()
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
