"""One EP2 rank's decode step on one GPU: the best stand-in for the two-GPU step this machine can run
(docs/PERF.md, "An EP2 rank's decode graph on one GPU").

An EP2/ADP2 rank at 64 rows a replica runs attention over its own 64 rows and its 64 of 128 experts
over the 2 x 64 token slots both replicas send it. Here: the Qwen3-30B-A3B shape with random bf16
weights, the shard of EP rank 0 of 2 (64 local experts, the router over all 128), 128 decode rows at
`ctx` tokens (default 1,024: the KV bytes of 64 rows at 2k), through the multi-rank D path
(RankCollectives, D's token slots) over a one-rank NCCL group, captured as a CUDA graph: tokens of
the other 64 experts go to no peer, as an EP2 rank's tokens for its peer leave it. Its floor counts
what the graph must read: attention and LM head weights, the local experts its 1,024 pairs touch, the
rows' KV; at the copy rate measured in the same call. Then the whole model (128 experts, one rank) at
`--one-rows` rows at `--one-ctx` (64 at 2k), the same way: one GPU's step beside it.

    python -m e2e.gpu bench ep2-rank OUT.json [--layers 48] [--rows 128] [--ctx 1024] [--one-rows 64] [--one-ctx 2048]
        [--reps 20] [--repeats 3]
    DEVICE=cpu python -m e2e.gpu bench ep2-rank OUT.json     # the tiny preset eagerly over gloo: a dry run
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from .bench_engine import decode_floor_bytes
from .harness import parser
from .hbm import copy_bw, replays_ms
from pdrollout.engine.model.backends import make_backends
from pdrollout.engine.model.checkpoint import random_model
from pdrollout.engine.model.kv_cache import KVCache
from pdrollout.engine.model.qwen3_moe import Shard
from pdrollout.engine.protocol.config import EngineConfig, ModelConfig, load_preset
from pdrollout.engine.protocol.plan import Phase, RowSpec
from pdrollout.engine.protocol.topology import Topology
from pdrollout.engine.runtime.collectives import Groups, PathContext, RankCollectives
from pdrollout.engine.runtime.expert_comm import TorchExpertComm

BLOCK = 16


def one_rank_group(cuda: bool) -> None:
    if not dist.is_initialized():
        store = dist.FileStore(tempfile.mktemp(prefix="ep2-rank-"), 1)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)


def build(cfg: ModelConfig, ep: int, rows: int, ctx: int, device, dtype):
    """The model of EP rank 0 of `ep`, its KV for `rows` rows of `ctx` tokens, its D path over the
    one-rank group: (forward(batch, bucket), model, kv)."""
    cuda = device.type == "cuda"
    backends = make_backends(device, dtype, EngineConfig(model="ep2-rank", device=device.type))
    model = random_model(cfg, device, dtype, 0, shard=Shard(0, 1, 0, ep), backends=backends)
    blocks = rows * (-(-(ctx + 32) // BLOCK))
    kv = KVCache(cfg.num_hidden_layers, blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
    # one peer holding num_experts / ep experts: the other experts' pairs go to no peer
    comm = TorchExpertComm([[0]], 0, num_experts=cfg.num_experts // ep, hidden=cfg.hidden_size, max_tokens=rows,
                           topk=cfg.num_experts_per_tok, dtype=dtype, d_max_tokens=rows, device=device,
                           pg_backend="nccl" if cuda else None)
    if cuda:
        from pdrollout.engine.runtime.streams import StreamDevice
        dev = StreamDevice()
    else:
        from pdrollout.engine.runtime.device import CpuDevice
        dev = CpuDevice(2)
    col = RankCollectives(Topology(1, 1, 1), 0, Groups(), comm, dev, lambda: None, cfg.hidden_size,
                          cfg.num_experts_per_tok, rows)
    col.cuda = cuda
    model.collectives = col

    def forward(batch, bucket: int):
        col.begin("d", PathContext(-1, [bucket], live=batch.live))
        col.in_capture = cuda and torch.cuda.is_current_stream_capturing()
        try:
            return model(batch, kv)
        finally:
            col.in_capture = False
    return forward, model, kv, dev


def decode_rows(rows: int, ctx: int, vocab: int) -> list[RowSpec]:
    per = -(-(ctx + 1) // BLOCK)
    g = torch.Generator().manual_seed(1)
    return [RowSpec(f"r{i}", Phase.DECODE, ctx, (int(torch.randint(2, vocab, (1,), generator=g)),),
                    tuple(range(i * per, (i + 1) * per)), True) for i in range(rows)]


def time_step(cfg: ModelConfig, ep: int, rows: int, ctx: int, reps: int, repeats: int, device, dtype) -> dict:
    forward, model, kv, dev = build(cfg, ep, rows, ctx, device, dtype)
    specs = decode_rows(rows, ctx, cfg.vocab_size)
    kv_bytes = rows * (ctx + 1) * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    weights, touched = decode_floor_bytes(model, rows, cfg.num_experts, cfg.num_experts_per_tok, cfg.tie_word_embeddings)
    out = {"ep_shard": ep, "local_experts": cfg.num_experts // ep, "rows": rows, "ctx": ctx,
           "floor_bytes": weights + kv_bytes, "kv_bytes": kv_bytes, "experts_touched_of_all": touched}
    if device.type == "cuda":
        from pdrollout.engine.runtime.graphs import DecodeGraphs
        graphs = DecodeGraphs(forward, device, BLOCK, rows, len(specs[0].blocks) + 1, kv.null_slot)
        graphs.buckets = [rows]   # this step's bucket only
        t0 = time.perf_counter()
        graphs.capture()
        out["capture_s"] = time.perf_counter() - t0
        logits = graphs.replay(specs, rows).clone()
        torch.cuda.synchronize()
        out["finite"] = bool(torch.isfinite(logits).all())
        out["replay_ms_each"] = [replays_ms(graphs.graphs[rows][0], reps) for _ in range(repeats)]
        out["replay_ms"] = statistics.median(out["replay_ms_each"])
        del graphs
    else:   # no graphs: one eager forward, to run every line of the path
        from pdrollout.engine.runtime.batch import BatchBuilder
        batch = BatchBuilder(BLOCK, device, model.backends.attention.needs_block_tables).build(specs, Phase.DECODE)
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = forward(batch, rows)
        out["eager_ms"] = (time.perf_counter() - t0) * 1e3
        out["finite"] = bool(torch.isfinite(logits).all())
        dev.close()
    out["d_collectives"] = model.collectives.collectives_issued("d")
    if ep == 1:   # the whole model: the D path's logits against one rank's forward (no collectives)
        from pdrollout.engine.model.qwen3_moe import Collectives
        from pdrollout.engine.runtime.batch import BatchBuilder
        model.collectives = Collectives()
        batch = BatchBuilder(BLOCK, device, model.backends.attention.needs_block_tables).build(specs, Phase.DECODE)
        with torch.inference_mode():
            ref = model(batch, kv).float()
        out["max_abs_diff_vs_one_rank"] = float((logits.float() - ref).abs().max())
        out["ref_scale"] = float(ref.abs().max())
    del model, kv
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0], layers=48, rows=128, ctx=1024, reps=20, repeats=3)
    ap.add_argument("--one-rows", type=int, default=64, help="the whole model's rows (one GPU's step)")
    ap.add_argument("--one-ctx", type=int, default=2048)
    a = ap.parse_args()
    cpu = os.environ.get("DEVICE") == "cpu"
    device = torch.device("cpu" if cpu else "cuda")
    dtype = torch.float32 if cpu else torch.bfloat16
    one_rank_group(not cpu)
    preset = load_preset("tiny" if cpu else "qwen3-30b-a3b")
    if not cpu:
        preset["num_hidden_layers"] = a.layers
    cfg = ModelConfig.from_dict(preset)
    bw = None if cpu else copy_bw()
    runs = {"ep2_rank": time_step(cfg, 2, a.rows, a.ctx, a.reps, a.repeats, device, dtype),
            "one_gpu": time_step(cfg, 1, a.one_rows, a.one_ctx, a.reps, a.repeats, device, dtype)}
    for r in runs.values():
        if bw:
            r["floor_ms"] = r["floor_bytes"] / bw * 1e3
            r["replay_over_floor"] = r["replay_ms"] / r["floor_ms"]
    res = {"meta": {"commit": os.environ.get("COMMIT", ""), "machine": os.environ.get("MACHINE", ""),
                    "gpu": torch.cuda.get_device_name() if not cpu else "cpu", "nproc": 1, "seed": 0,
                    "topology": "one rank standing in for EP rank 0 of EP2/ADP2 (a one-rank NCCL group)",
                    "command": "python -m e2e.gpu bench ep2-rank " + " ".join(sys.argv[1:]),
                    "layers": cfg.num_hidden_layers, "copy_bw_tbs": bw / 1e12 if bw else None},
           **runs}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("| step | rows | ctx | experts held | replay ms | floor ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        t = r.get("replay_ms", r.get("eager_ms"))
        print(f"| {name} | {r['rows']} | {r['ctx']} | {r['local_experts']} | {t:.2f} | "
              f"{r.get('floor_ms', float('nan')):.2f} | {r.get('replay_over_floor', float('nan')):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
