"""Prefill attention of the Qwen3-30B-A3B shape (32 query heads, 4 KV heads, head dim 128, bf16) from
the paged cache: the Triton launch (model/paged_prefill.py) at its default tiles and over a sweep of
tile shapes, warps and stages, beside SDPA per segment (kernels.prefill_attention), each as a CUDA
graph replay, in causal TFLOP/s. Decides paged_prefill.TILES (issue 19: the 8k chunk spent 35 ms of
its 165 ms here, ~190 TFLOP/s).

    python -m e2e.gpu kernels attn OUT.json [--shapes 8k,p1] [--sweep]
      8k: one chunk of 4 fresh 2,048-token prompts (bench_engine's prefill step)
      p1: 32 continuation segments of 256 new tokens over 1,792 cached (a P epoch at P1)
    DEVICE=cpu python -m e2e.gpu kernels attn OUT.json --sweep   # dry run: a tiny shape, the interpreter
"""
from __future__ import annotations

import itertools
import os
import sys

if os.environ.get("DEVICE") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from .harness import finish, meta, off_reference, parse_on_device, rel, sweep_each, sweep_parser, timed  # noqa: E402
from pdrollout.engine.model import ops  # noqa: E402
from pdrollout.engine.model.paged_prefill import TILES, paged_prefill_attention, plan_tiles  # noqa: E402
from pdrollout.engine.model.qwen3_moe import SeqSlice  # noqa: E402

# (new tokens, context) per segment
# "cont": one continuation as a fused step carries it at P1 (its walk split along the context)
SHAPES = {"8k": [(2048, 2048)] * 4, "p1": [(256, 2048)] * 32, "cont": [(128, 2048)], "cont4k": [(128, 4096)],
          "tiny": [(40, 40), (9, 70), (1, 33)]}


def make(shape, h: int, kvh: int, d: int, block: int, dev, g):
    """q packed; each segment's context in shuffled cache blocks, as a long-running cache has them."""
    nblocks = sum(-(-c // block) for _, c in shape) + 1
    k = torch.randn(nblocks * block, kvh, d, generator=g, device=dev).to(torch.bfloat16)
    v = torch.randn(nblocks * block, kvh, d, generator=g, device=dev).to(torch.bfloat16)
    perm = torch.randperm(nblocks, generator=g, device=dev)
    seqs, start, at = [], 0, 0
    for n, c in shape:
        blocks = perm[at:at + -(-c // block)]
        at += blocks.numel()
        pos = torch.arange(c, device=dev)
        seqs.append(SeqSlice(start, n, c, blocks[pos // block] * block + pos % block))
        start += n
    q = torch.randn(start, h, d, generator=g, device=dev).to(torch.bfloat16)
    return q, k, v, seqs


def causal_flops(seqs, h: int, d: int) -> float:
    """QKᵀ and PV over the keys each query sees (bottom-right causal)."""
    keys = sum(s.q_len * (s.ctx_len - s.q_len) + s.q_len * (s.q_len + 1) // 2 for s in seqs)
    return 4.0 * keys * h * d


def configs(cpu: bool):
    if cpu:
        return [dict(block_m=16, block_n=16, num_warps=4, num_stages=2), dict(block_m=32, block_n=16, num_warps=4, num_stages=2)]
    return [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
            for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]


def run_shape(name: str, a, dev, cpu: bool) -> dict:
    h, kvh, d = (4, 2, 16) if cpu else (32, 4, 128)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, seqs = make(SHAPES["tiny" if cpu else name], h, kvh, d, 16, dev, g)
    scale = d ** -0.5
    flops = causal_flops(seqs, h, d)
    from pdrollout.engine.model.kernels import prefill_attention
    if cpu:
        ref = ops.paged_attention(q.double(), k.double(), v.double(), seqs, scale)
    else:
        ref = prefill_attention(q, k, v, seqs, scale)
    row = {"shape": name, "segments": len(seqs), "tokens": int(q.shape[0]), "tflop": flops / 1e12,
           "default": dict(TILES), "default_rel_err": rel(paged_prefill_attention(q, k, v, seqs, scale), ref)}
    if not cpu:
        row["sdpa_us"] = timed(lambda: prefill_attention(q, k, v, seqs, scale), 20) * 1e6
        plan = plan_tiles(seqs, dev, heads=q.shape[1])   # built once per step in the engine: not timed
        row["splits"] = plan.splits
        if plan.splits > 1:   # the same launch walking each context whole
            whole = plan_tiles(seqs, dev, splits=1)
            row["whole_us"] = timed(lambda: paged_prefill_attention(q, k, v, seqs, scale, plan=whole), 20) * 1e6
        row["default_us"] = timed(lambda: paged_prefill_attention(q, k, v, seqs, scale, plan=plan), 20) * 1e6
        row["sdpa_tflops"], row["default_tflops"] = flops / row["sdpa_us"] / 1e6, flops / row["default_us"] / 1e6
        if all(s.q_len == s.ctx_len for s in seqs):
            row["fresh"] = fresh_backends(q, k, v, seqs, scale, ref, flops)
    if a.sweep:
        def launch(cfg):   # the plan is built once per step in the engine: outside the timed launch
            plan = plan_tiles(seqs, dev, cfg["block_m"], heads=q.shape[1])
            return lambda: paged_prefill_attention(q, k, v, seqs, scale, plan=plan, tiles=cfg)
        row["sweep"] = sweep_each(launch, ref, configs(cpu), not cpu, figures=lambda us: {"tflops": flops / us / 1e6})
        if not cpu and row["sweep"][0].get("rel_err", 1) < 2e-2:   # the fastest that agrees
            row["best_us"], row["best_config"] = row["sweep"][0]["us"], row["sweep"][0]["config"]
            row["best_tflops"] = row["sweep"][0]["tflops"]
    return row


def fresh_backends(q, k, v, seqs, scale: float, ref, flops: float) -> dict:
    """Fresh prompts only: SDPA per segment on the segment's own K/V (as the projection leaves them,
    no gather from the cache) under each backend torch has, GQA by `enable_gqa` or by expanding
    K/V to every query head. What a fresh-prompt path could reach beside the paged kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    ks = [k.index_select(0, s.slots).transpose(0, 1).unsqueeze(0) for s in seqs]
    vs = [v.index_select(0, s.slots).transpose(0, 1).unsqueeze(0) for s in seqs]
    rep = q.shape[1] // k.shape[1]
    out = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        for gqa in ("enable_gqa", "expand"):
            kk = ks if gqa == "enable_gqa" else [x.repeat_interleave(rep, 1) for x in ks]
            vv = vs if gqa == "enable_gqa" else [x.repeat_interleave(rep, 1) for x in vs]
            o = torch.empty_like(q)

            def run():
                with sdpa_kernel(getattr(SDPBackend, name)):
                    for s, ki, vi in zip(seqs, kk, vv):
                        qs = q[s.q_start:s.q_start + s.q_len].transpose(0, 1).unsqueeze(0)
                        r = F.scaled_dot_product_attention(qs, ki, vi, is_causal=True, scale=scale,
                                                           enable_gqa=gqa == "enable_gqa")
                        o[s.q_start:s.q_start + s.q_len] = r.squeeze(0).transpose(0, 1)
                return o
            try:
                err = rel(run(), ref)
                us = timed(run, 20) * 1e6
                out[f"{name.lower()}/{gqa}"] = {"us": us, "tflops": flops / us / 1e6, "rel_err": err}
            except Exception as exc:   # a backend that does not take the shape: reported, not fatal
                out[f"{name.lower()}/{gqa}"] = {"error": str(exc).splitlines()[0][:160]}
    return out


def main() -> int:
    ap = sweep_parser(__doc__, shapes="8k,p1")
    a, cpu, dev = parse_on_device(ap)
    names = a.shapes.split(",")
    bad = [n for n in names if n not in SHAPES]
    if bad:
        ap.error(f"unknown shapes {bad}; choose from {', '.join(SHAPES)}")
    rows = [run_shape(n, a, dev, cpu) for n in (names[:1] if cpu else names)]
    print("shape  segs  tokens  sdpa us  default us  TFLOP/s (sdpa/default/best)  best config")
    for r in rows:
        print(f"{r['shape']:5} {r['segments']:5} {r['tokens']:7} {r.get('sdpa_us', 0):8.0f} {r.get('default_us', 0):11.0f}  "
              f"{r.get('sdpa_tflops', 0):6.0f} / {r.get('default_tflops', 0):4.0f} / {r.get('best_tflops', 0):4.0f}  "
              f"{r.get('best_config')}" + (f"  splits {r['splits']}: whole walks {r['whole_us']:.0f} us"
                                            if r.get("whole_us") else ""))
        for name, f in r.get("fresh", {}).items():
            print(f"  fresh {name:32} " + (f"{f['us']:6.0f} us {f['tflops']:4.0f} TFLOP/s err {f['rel_err']:.1e}"
                                           if "us" in f else f["error"]))
    return finish(a.out, meta(cpu), rows, off_reference(rows, "default_rel_err", lambda r: r["shape"]),
                  "paged prefill attention differs from the reference on")


if __name__ == "__main__":
    sys.exit(main())
