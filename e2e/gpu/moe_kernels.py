"""One MoE layer of the Qwen3-30B-A3B shape (128 experts, top-8, H 2048, I 768, bf16): grouped GEMMs
(kernels.experts_grouped) against the fused Triton path (fused_moe.experts_fused), each as a CUDA
graph replay, per batch of routed tokens, beside the HBM floor of the expert weights the batch
touches. Decides `experts_kernel`'s default (issue 19).

    python -m e2e.gpu kernels moe OUT.json [--tokens 1,8,32,64,128,256,2048,8192] [--sweep] [--sweep-large]
        [--sweep-small] [--fp8]
    (--sweep: also the fused kernels' tile shapes, warps and stages per batch: what they could reach;
     --sweep-large: the 128-row tiles by row-block group (group_m), stages and down's own tiles;
     --sweep-small: 16-row tiles for 1-4 tokens, each pair its own block (`direct`) or laid out;
     --fp8: the same experts as e4m3 with 128×128 block scales — the fused kernel dequantizing tiles in
     registers against today's CUDA FP8 path (the layer dequantized, then grouped GEMMs), its FP8
     floor, and the bf16 and FP8 GEMM peaks measured in the same call (issue 23))
    DEVICE=cpu python -m e2e.gpu kernels moe OUT.json   # dry run: a tiny shape, Triton's interpreter
"""
from __future__ import annotations

import json
import os
import sys

if os.environ.get("DEVICE") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from .harness import finish, meta, parse_on_device, sweep_configs, sweep_parser, timed  # noqa: E402
from .hbm import copy_bw  # noqa: E402  (the copy rate every floor here is taken against)

from pdrollout.engine.model import ops  # noqa: E402
from pdrollout.engine.model.fused_moe import experts_fused  # noqa: E402


def sweep(run, ref, flops: float) -> list[dict]:
    """Every tile/warp/stage combination that compiles and agrees with the reference, fastest first."""
    import itertools
    grid = [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
            for bm, (bn, bk), warps, stages in itertools.product((16, 32, 64, 128), ((64, 64), (128, 64), (64, 128)),
                                                                 (4, 8), (3, 4))]
    return sweep_configs(run, ref, flops, grid)


def small_configs() -> list[dict]:
    """--sweep-small: 16-row tiles for a few decode rows (1-4 tokens: 8-32 pairs at top-8), with each
    pair its own block (`direct`) or laid out; narrower column tiles give the weights more programs."""
    import itertools
    return [dict(block_n=bn, block_k=bk, num_warps=4, num_stages=st, direct=d)
            for d, bn, bk, st in itertools.product((True, False), (16, 32, 64), (64, 128, 256), (3, 4))]


def large_configs() -> list[dict]:
    """--sweep-large: 128-row tiles (AutoExperts' long-prefill path) by row-block group, stages and
    down's own tiles."""
    base = dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    out = [dict(base, group_m=g) for g in (1, 4, 8, 16, 32)]
    out += [dict(base, num_stages=4, group_m=g) for g in (8, 16)]
    out += [dict(base, block_m=64, num_warps=4, num_stages=4, group_m=g) for g in (1, 8)]
    for down in (dict(block_n=256, block_k=64), dict(block_n=256, block_k=64, num_stages=4), dict(block_n=128, block_k=128),
                 dict(block_n=64, block_k=128, num_warps=4), dict(block_n=128, block_k=64, num_stages=4, group_m=32)):
        out.append(dict(base, group_m=8, down_tiles=down))
    return out


def peaks(dev) -> dict:
    """TFLOP/s of one 8k×8k×8k GEMM in bf16 and in FP8 (torch._scaled_mm, per-tensor scales)."""
    n = 8192
    a = torch.randn(n, n, device=dev).to(torch.bfloat16)
    b = torch.randn(n, n, device=dev).to(torch.bfloat16)
    bf16 = 2 * n ** 3 / timed(lambda: a @ b, 10) / 1e12
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()   # column-major second operand
    one = torch.ones((), device=dev)
    f8 = 2 * n ** 3 / timed(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), 10) / 1e12
    return {"bf16_tflops": bf16, "fp8_tflops": f8}


def fp8_experts(gate_up, down, block=(128, 128)):
    """e4m3 copies in fp8.py's layout: gate's and up's block rows quantized apart."""
    from pdrollout.engine.model import fp8
    inter = gate_up.shape[1] // 2
    parts = [[fp8.quantize(w[r], block) for r in range(w.shape[0])]
             for w in (gate_up[:, :inter], gate_up[:, inter:], down)]
    gu = torch.stack([torch.cat([g[0], u[0]]) for g, u in zip(parts[0], parts[1])])
    gu_s = torch.stack([torch.cat([g[1], u[1]]) for g, u in zip(parts[0], parts[1])])
    dn, dn_s = torch.stack([d[0] for d in parts[2]]), torch.stack([d[1] for d in parts[2]])
    return gu, dn, (gu_s, dn_s, block)


def fp8_row(x, ids, w, q, bw, top_k, cpu: bool) -> dict:
    """The FP8 experts: fused with in-register dequantization, against the reference on the same
    weights and (GPU) against dequantize + grouped GEMMs; floor = the touched experts' FP8 bytes."""
    from types import SimpleNamespace
    from pdrollout.engine.model import fp8
    gu, dn, scales = q
    ex = SimpleNamespace(gate_up_proj=gu, gate_up_proj_scale_inv=scales[0], down_proj=dn,
                         down_proj_scale_inv=scales[1], inter=dn.shape[2], block=scales[2])
    out = experts_fused(x, ids, w, gu, dn, fp8=scales)
    g64, d64 = fp8.expert_weights(ex, slice(None), torch.float64)
    ref = ops.experts_reference(x.double(), ids, w.double(), g64, d64)
    row = {"fp8_fused_rel_err": ((out.double() - ref).norm() / ref.norm()).item()}
    if cpu:
        return row
    from pdrollout.engine.model.kernels import experts_grouped

    def dequant_grouped():
        g16, d16 = fp8.expert_weights(ex, slice(None), torch.bfloat16)
        return experts_grouped(x, ids, w, g16, d16)
    hidden, inter = dn.shape[1], dn.shape[2]
    touched = int(ids.unique().numel())
    scale_bytes = scales[0][0].numel() * 4 + scales[1][0].numel() * 4
    from pdrollout.engine.model.backends import AutoExperts
    row.update(fp8_fused_us=timed(lambda: experts_fused(x, ids, w, gu, dn, fp8=scales), 50) * 1e6,
               # the engine's pick: the tiles by pairs (fp8_fused_us above: the 16-row defaults at every size)
               fp8_auto_us=timed(lambda: AutoExperts()(x, ids, w, gu, dn, fp8=scales), 50) * 1e6,
               fp8_dequant_grouped_us=timed(dequant_grouped, 20) * 1e6,
               fp8_floor_us=touched * (3 * hidden * inter + scale_bytes) / bw * 1e6)
    flops = 2 * x.shape[0] * top_k * 3 * hidden * inter
    row["fp8_fused_over_floor"] = row["fp8_fused_us"] / row["fp8_floor_us"]
    row["fp8_fused_tflops"] = flops / row["fp8_fused_us"] / 1e6
    row["fp8_auto_tflops"] = flops / row["fp8_auto_us"] / 1e6
    return row


def main() -> int:
    ap = sweep_parser(None)
    ap.add_argument("--tokens", default="1,8,32,64,128,256,2048,8192")
    ap.add_argument("--sweep-large", action="store_true", help="the 128-row tiles by group, stages and down tiles")
    ap.add_argument("--sweep-small", action="store_true", help="16-row tiles for 1-4 tokens, direct or laid out")
    ap.add_argument("--fp8", action="store_true")
    a, cpu, dev = parse_on_device(ap)
    hidden, inter, experts, top_k = (64, 32, 8, 2) if cpu else (2048, 768, 128, 8)
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g, device=dev) * hidden ** -0.5).to(torch.bfloat16)
    down = (torch.randn(experts, hidden, inter, generator=g, device=dev) * inter ** -0.5).to(torch.bfloat16)
    bw = None if cpu else copy_bw(dev)
    q = fp8_experts(gate_up.float(), down.float()) if a.fp8 else None
    rows = []
    for t in [int(x) for x in a.tokens.split(",")][:2 if cpu else None]:
        x = torch.randn(t, hidden, generator=g, device=dev).to(torch.bfloat16)
        w, ids = ops.route(torch.randn(t, experts, generator=g, device=dev), top_k, True, torch.bfloat16)
        ref = ops.experts_reference(x.double(), ids, w.double(), gate_up.double(), down.double())
        fused = experts_fused(x, ids, w, gate_up, down)
        err = ((fused.double() - ref).norm() / ref.norm()).item()
        row = {"tokens": t, "experts_touched": int(ids.unique().numel()), "fused_rel_err": err}
        if not cpu:
            from pdrollout.engine.model.kernels import experts_grouped
            floor = row["experts_touched"] * 3 * hidden * inter * 2 / bw
            from pdrollout.engine.model.backends import AutoExperts
            row.update(grouped_us=timed(lambda: experts_grouped(x, ids, w, gate_up, down), 50) * 1e6,
                       fused_us=timed(lambda: experts_fused(x, ids, w, gate_up, down), 50) * 1e6,
                       auto_us=timed(lambda: AutoExperts()(x, ids, w, gate_up, down), 50) * 1e6,   # the engine's pick
                       floor_us=floor * 1e6)
            # the pairs' layout alone: torch's reference ops against the engine's launches
            from pdrollout.engine.model import fused_moe as fm
            from pdrollout.engine.model.backends import fused_tiles
            n, bm = ids.numel(), fused_tiles(ids.numel()).get("block_m", fm.BLOCK_M)
            engine_align = fm.align_fused if n <= fm.ALIGN_KERNEL_MAX_PAIRS else fm.align_spread
            other = fm.align_spread if engine_align is fm.align_fused else fm.align_fused
            row.update(align_torch_us=timed(lambda: fm.align(ids, experts, 0, bm), 50) * 1e6,
                       align_us=timed(lambda: engine_align(ids, experts, 0, bm), 50) * 1e6,
                       align_kernel=engine_align.__name__,
                       align_other_us=timed(lambda: other(ids, experts, 0, bm), 50) * 1e6)   # where to switch
            row["fused_over_grouped"] = row["fused_us"] / row["grouped_us"]
            row["fused_over_floor"] = row["fused_us"] / row["floor_us"]
            flops = 2 * t * top_k * 3 * hidden * inter
            row["grouped_tflops"] = flops / row["grouped_us"] / 1e6
            row["auto_tflops"] = flops / row["auto_us"] / 1e6
            if a.sweep_large:
                row["sweep_large"] = sweep_configs(lambda **kw: experts_fused(x, ids, w, gate_up, down, **kw), ref, flops,
                                                   large_configs())
                best = row["sweep_large"][0]
                row["best_large_us"], row["best_large_config"] = best.get("us"), best["config"]
            if a.sweep_small:
                row["sweep_small"] = sweep_configs(lambda **kw: experts_fused(x, ids, w, gate_up, down, **kw), ref, flops,
                                                   small_configs())
                best = row["sweep_small"][0]
                row["best_small_us"], row["best_small_config"] = best.get("us"), best["config"]
            if a.sweep:
                row["sweep"] = sweep(lambda **kw: experts_fused(x, ids, w, gate_up, down, **kw), ref, flops)
                best = row["sweep"][0]
                row["best_fused_us"], row["best_config"] = best["us"], best["config"]
        if q is not None:
            row.update(fp8_row(x, ids, w, q, bw, top_k, cpu))
        rows.append(row)
        print(json.dumps(row), flush=True)
    about = meta(cpu, copy_bw_tbs=bw and bw / 1e12,
                 shape={"hidden": hidden, "inter": inter, "experts": experts, "top_k": top_k},
                 **({"peaks": peaks(dev)} if a.fp8 and not cpu else {}))
    # FP8: against the exact function of the e4m3 weights, one bf16 rounding of the weights more
    bad = [r["tokens"] for r in rows if r["fused_rel_err"] > 2e-2 or r.get("fp8_fused_rel_err", 0) > 3e-2]
    return finish(a.out, about, rows, bad, "fused experts differ from the reference at tokens")


if __name__ == "__main__":
    sys.exit(main())
