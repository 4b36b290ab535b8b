"""The dense projections of a few rows at the Qwen3-30B-A3B shape (q/k/v 5,120 × 2,048, o_proj
2,048 × 4,096, router 128 × 2,048; bf16): cuBLAS (F.linear) against model/skinny.py's launch and a
sweep of its tiles, each a CUDA graph replay, beside the HBM floor of the weight. Decides
`dense_kernel`'s default and skinny.TILES (issue 19: at one row the three GEMMs took 21.5 µs a layer
against ~9 µs of floor, docs/PERF.md, nineteenth session).

    python -m e2e.gpu kernels dense OUT.json [--rows 1,2,4,8,16] [--sweep]
    DEVICE=cpu python -m e2e.gpu kernels dense OUT.json --sweep   # dry run: tiny shapes, the interpreter
"""
from __future__ import annotations

import itertools
import os
import sys

if os.environ.get("DEVICE") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from .hbm import copy_bw  # noqa: E402
from .harness import finish, meta, off_reference, parse_on_device, sweep_configs, sweep_parser, timed  # noqa: E402
from pdrollout.engine.model.skinny import linear_rows  # noqa: E402

SHAPES = {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048)}


def configs(cpu: bool) -> list[dict]:
    if cpu:
        return [dict(block_n=bn, block_k=bk) for bn, bk in itertools.product((16, 32), (32, 64))]
    return [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st)
            for bn, bk, w, st in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4, 5))]


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(name: str, n: int, k: int, rows: int, a, dev, cpu: bool, bw: float | None) -> dict:
    g = torch.Generator(device=dev).manual_seed(rows)
    x = torch.randn(rows, k, generator=g, device=dev).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device=dev) * k ** -0.5).to(torch.bfloat16)
    ref = F.linear(x.double(), w.double())
    row = {"shape": name, "n": n, "k": k, "rows": rows, "skinny_rel_err": rel(linear_rows(x, w), ref),
           "cublas_rel_err": rel(F.linear(x, w), ref)}
    if not cpu:
        row["floor_us"] = w.numel() * w.element_size() / bw * 1e6
        row["cublas_us"] = timed(lambda: F.linear(x, w), 50) * 1e6
        row["skinny_us"] = timed(lambda: linear_rows(x, w), 50) * 1e6
    if a.sweep:
        row["sweep"] = sweep_configs(lambda **kw: linear_rows(x, w, **kw), ref, 2 * rows * n * k, configs(cpu),
                                     time=not cpu)
        if not cpu and "us" in row["sweep"][0]:
            row["best_us"], row["best_config"] = row["sweep"][0]["us"], row["sweep"][0]["config"]
    return row


def main() -> int:
    ap = sweep_parser(__doc__, rows="1,2,4,8,16")
    a, cpu, dev = parse_on_device(ap)
    try:
        rows = [int(r) for r in a.rows.split(",")]
        assert all(0 < r <= 16 for r in rows)
    except (ValueError, AssertionError):
        ap.error(f"--rows wants comma-separated counts of 1-16, got {a.rows!r}")
    shapes = {"tiny": (40, 72)} if cpu else SHAPES
    bw = None if cpu else copy_bw(dev)
    out = [run(name, n, k, r, a, dev, cpu, bw) for name, (n, k) in shapes.items() for r in (rows[:2] if cpu else rows)]
    print("shape   rows  floor us  cuBLAS us  skinny us  best us  best config")
    for r in out:
        print(f"{r['shape']:7} {r['rows']:4} {r.get('floor_us', 0):9.1f} {r.get('cublas_us', 0):10.1f} "
              f"{r.get('skinny_us', 0):10.1f} {r.get('best_us', 0):8.1f}  {r.get('best_config')}")
    return finish(a.out, meta(cpu, copy_bw_tbs=bw and bw / 1e12), out,
                  off_reference(out, "skinny_rel_err", lambda r: (r["shape"], r["rows"])),
                  "the skinny launch differs from the reference at")


if __name__ == "__main__":
    sys.exit(main())
