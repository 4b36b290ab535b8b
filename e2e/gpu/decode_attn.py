"""Decode attention of the Qwen3-30B-A3B shape (32 query heads, 4 KV heads, head dim 128, bf16, 16-token
blocks) from the paged cache, against its floor: the K and V bytes the batch reads, at the copy rate
measured in the same process. The engine's launch (kernels.decode_attention: a program per row and KV
head, 64-token tiles, 4 warps, 2 stages, one walk a row) and a sweep of tiles, warps, stages and context
splits, each a CUDA graph replay. Why: FlashInfer's published GQA decode (32/4 heads, head dim 128,
batch 64, 2k context) reads at ~73 % of an H100's peak; ours, from the profiles, at ~35 % of the
H200's (docs/perf/HISTORY.md, fourteenth session). Decides the decode launch's defaults.

    python -m e2e.gpu kernels decode-attn OUT.json [--shapes 32x2048,64x2048,64x4096] [--sweep [--small]]
    DEVICE=cpu python -m e2e.gpu kernels decode-attn OUT.json --sweep   # dry run: a tiny shape, the interpreter
"""
from __future__ import annotations

import itertools
import os
import sys

if os.environ.get("DEVICE") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from .hbm import copy_bw  # noqa: E402
from .harness import finish, meta, off_reference, parse_on_device, rel, sweep_each, sweep_parser, timed  # noqa: E402
from pdrollout.engine.model import ops  # noqa: E402
from pdrollout.engine.model.kernels import decode_attention  # noqa: E402
from pdrollout.engine.model.qwen3_moe import SeqSlice  # noqa: E402

BLOCK = 16


def configs(cpu: bool, small: bool = False) -> list[dict]:
    if small and not cpu:   # a few rows: up to 64 splits a row (16 was the engine's most)
        return [dict(tile=t, num_warps=4, num_stages=st, kv_splits=s)
                for t, st, s in itertools.product((64, 128), (2, 3), (8, 16, 32, 64))]
    if cpu:
        return [dict(tile=t, num_warps=4, num_stages=2, kv_splits=s) for t, s in itertools.product((16, 32), (1, 2))]
    return [dict(tile=t, num_warps=w, num_stages=st, kv_splits=s)
            for t, w, st, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (1, 2, 4))]


def make(batch: int, ctx: int, h: int, kvh: int, d: int, dev, g):
    """Each row's context in shuffled cache blocks (a long-running cache's), its block table padded
    to the longest row's width, as the engine builds it."""
    per = -(-ctx // BLOCK)
    nblocks = batch * per + 1
    k = torch.randn(nblocks * BLOCK, kvh, d, generator=g, device=dev).to(torch.bfloat16)
    v = torch.randn(nblocks * BLOCK, kvh, d, generator=g, device=dev).to(torch.bfloat16)
    perm = torch.randperm(nblocks, generator=g, device=dev)[:batch * per].view(batch, per)
    tables = perm.to(torch.int32).contiguous()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, h, d, generator=g, device=dev).to(torch.bfloat16)
    pos = torch.arange(ctx, device=dev)
    seqs = [SeqSlice(i, 1, ctx, perm[i][pos // BLOCK] * BLOCK + pos % BLOCK) for i in range(batch)]
    return q, k, v, tables, lens, seqs


def run_shape(batch: int, ctx: int, a, dev, cpu: bool, bw: float | None) -> dict:
    h, kvh, d = (4, 2, 16) if cpu else (32, 4, 128)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, tables, lens, seqs = make(batch, ctx, h, kvh, d, dev, g)
    scale = d ** -0.5
    ref = ops.paged_attention(q.double(), k.double(), v.double(), seqs, scale)
    kv_bytes = 2 * batch * ctx * kvh * d * k.element_size()
    row = {"batch": batch, "ctx": ctx, "kv_bytes": kv_bytes,
           "default_rel_err": rel(decode_attention(q, k, v, tables, lens, BLOCK, scale), ref)}
    if not cpu:
        row["floor_us"] = kv_bytes / bw * 1e6
        row["default_us"] = timed(lambda: decode_attention(q, k, v, tables, lens, BLOCK, scale), 50) * 1e6
        row["default_over_floor"] = row["default_us"] / row["floor_us"]
        row["default_tb_s"] = kv_bytes / row["default_us"] / 1e6
    if a.sweep:
        row["sweep"] = sweep_each(lambda cfg: lambda: decode_attention(q, k, v, tables, lens, BLOCK, scale, **cfg),
                                  ref, configs(cpu, a.small), not cpu, reps=50,
                                  figures=lambda us: {"over_floor": us / row["floor_us"]})
        if not cpu and row["sweep"][0].get("rel_err", 1) < 2e-2:   # the fastest that agrees
            best = row["sweep"][0]
            row["best_us"], row["best_config"], row["best_over_floor"] = best["us"], best["config"], best["over_floor"]
    return row


def main() -> int:
    ap = sweep_parser(__doc__)
    ap.add_argument("--shapes", default="32x2048,64x2048,64x4096", help="BATCHxCONTEXT, comma-separated")
    ap.add_argument("--small", action="store_true", help="with --sweep: the grid for a few rows (splits up to 64)")
    a, cpu, dev = parse_on_device(ap)
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
        assert all(len(s) == 2 and min(s) > 0 for s in shapes)
    except (ValueError, AssertionError):
        ap.error(f"--shapes wants BATCHxCONTEXT pairs, e.g. 64x2048; got {a.shapes!r}")
    if cpu:
        shapes = [(3, 40)]
    bw = None if cpu else copy_bw(dev)
    rows = [run_shape(b, c, a, dev, cpu, bw) for b, c in shapes]
    print("batch   ctx  floor us  default us  x floor  TB/s   best us  x floor  best config")
    for r in rows:
        print(f"{r['batch']:5} {r['ctx']:5} {r.get('floor_us', 0):9.1f} {r.get('default_us', 0):11.1f} "
              f"{r.get('default_over_floor', 0):8.2f} {r.get('default_tb_s', 0):5.2f} {r.get('best_us', 0):9.1f} "
              f"{r.get('best_over_floor', 0):8.2f}  {r.get('best_config')}")
    return finish(a.out, meta(cpu, copy_bw_tbs=bw and bw / 1e12, block_size=BLOCK), rows,
                  off_reference(rows, "default_rel_err", lambda r: (r["batch"], r["ctx"])),
                  "decode attention differs from the reference at")


if __name__ == "__main__":
    sys.exit(main())
