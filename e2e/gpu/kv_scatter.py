"""Does where a row's KV blocks lie change a decode step's time?

A server's KV pool hands out blocks in the order requests free and take them, so a session's blocks
end up anywhere in the pool, and two identical servers place them differently (a closed loop's
timing decides the order). A decode graph is replayed here with the same rows, positions and
context, the rows' block tables pointing either at runs of consecutive blocks (a row's context in
one stretch of memory) or at blocks drawn at random from the whole pool (a row's 16-token blocks
spread over every page of each layer's cache). Placements alternate, A B A B, `rounds` times; KV
contents are whatever the blocks hold (timing only).

    python3 e2e/gpu/kv_scatter.py OUT.json [--rows 1,8,26,64] [--ctx 2048] [--reps 50] [--rounds 3]
    DEVICE=cpu python3 e2e/gpu/kv_scatter.py OUT.json     # the CPU: checks the tables it builds, no timing
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from fused_step import build   # this script's directory is on sys.path when it runs


def tables(rows: int, blocks: int, pool: int, placement: str, g: torch.Generator) -> torch.Tensor:
    """int32 [rows, blocks]: each row's block ids, consecutive (row i from i·blocks) or drawn at
    random from the pool without repeats."""
    if rows * blocks > pool:
        raise SystemExit(f"{rows} rows × {blocks} blocks do not fit a pool of {pool} blocks")
    if placement == "consecutive":
        ids = torch.arange(rows * blocks, dtype=torch.int32)
    else:
        ids = torch.randperm(pool, generator=g)[:rows * blocks].to(torch.int32)
    return ids.view(rows, blocks)


def replay_ms(e, rows: int, ctx: int, table: torch.Tensor, reps: int) -> float:
    gr = e.worker.graphs
    b = gr.bucket(rows)
    bs = gr.block_size
    gr.positions[:rows].fill_(ctx - 1)
    gr.seq_lens[:rows].fill_(ctx)
    gr.block_tables[:rows, :table.shape[1]].copy_(table)
    last = table[:, (ctx - 1) // bs].to(torch.int64) * bs + (ctx - 1) % bs
    gr.slot_mapping[:rows].copy_(last)    # the new token's K/V land in its row's last block
    gr.seq_lens[rows:b].zero_()            # the bucket's padding rows, as graph_inputs leaves them
    gr.slot_mapping[rows:b].fill_(gr.null_slot)
    gr.input_ids[rows:b].zero_()
    graph = gr.graphs[b][0]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rows", default="1,8,26,64")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    cpu = os.environ.get("DEVICE") == "cpu"
    rows_list = [int(x) for x in a.rows.split(",")]
    if cpu:
        rows_list, a.ctx = [min(r, 2) for r in rows_list[:2]], 64
    e, _ = build(cpu, max(rows_list), a.ctx, steps=8)
    pool = e.worker.num_blocks
    blocks = -(-a.ctx // e.config.block_size)
    g = torch.Generator().manual_seed(0)
    out = {"meta": {"commit": os.environ.get("COMMIT", ""), "machine": os.environ.get("MACHINE", ""),
                    "gpu": "cpu" if cpu else torch.cuda.get_device_name(), "nproc": 1, "topology": "EP1/ADP1",
                    "ctx": a.ctx, "reps": a.reps, "rounds": a.rounds, "pool_blocks": pool,
                    "block_size": e.config.block_size}, "rows": []}
    for rows in rows_list:
        t = {p: tables(rows, blocks, pool, p, g) for p in ("consecutive", "random")}
        row = {"rows": rows, "distinct_blocks": {p: int(x.unique().numel()) for p, x in t.items()}}
        if e.worker.graphs is not None:
            ms = {p: [] for p in t}
            for _ in range(a.rounds):
                for p in t:
                    ms[p].append(replay_ms(e, rows, a.ctx, t[p].to(e.worker.device), a.reps))
            row.update({f"{p}_ms": statistics.median(v) for p, v in ms.items()}, each_ms=ms,
                       random_over_consecutive=statistics.median(ms["random"]) / statistics.median(ms["consecutive"]))
        out["rows"].append(row)
        print(json.dumps(row))
    e.shutdown()
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
