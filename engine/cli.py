"""`pdrollout` console script."""
from __future__ import annotations

import argparse
import json
import sys


def _cmd_checkpoint(a) -> int:
    from .checkpoint import write_checkpoint
    from .config import load_preset
    out = write_checkpoint(load_preset(a.config), a.out, seed=a.seed, dtype=a.dtype, layout=a.layout)
    print(f"wrote {out}", file=sys.stderr)
    return 0




def _cmd_generate(a) -> int:
    from .config import ControlSettings, EngineConfig
    from .engine import Engine
    from .generate import run_requests, read_requests
    extra = json.loads(a.engine_config) if a.engine_config else {}
    control = ControlSettings.model_validate(json.loads(a.control)) if a.control else ControlSettings()
    cfg = EngineConfig(model=a.model, device=a.device, dtype=a.dtype, mode=a.mode,
                       kv_cache_bytes=a.kv_cache_mb << 20, control=control, **extra)
    if a.nproc > 1:
        from .distributed.entry import launch_generate   # multi-rank engine
        return launch_generate(a, cfg)
    if a.expert_backend != "torch":
        print(f"pdrollout generate: --expert-backend {a.expert_backend} needs --nproc > 1 (expert parallelism)",
              file=sys.stderr)
        return 2
    engine = Engine(cfg)
    lines = read_requests(a.requests)
    for rec in run_requests(engine, lines, sequential=a.sequential):
        print(json.dumps(rec), flush=True)
    return 0


def add_rank_args(p: argparse.ArgumentParser) -> None:
    """Knobs of the multi-rank engine's device model and watchdog (--nproc > 1)."""
    p.add_argument("--slots", type=int, default=2, help="CPU device execution slots per rank (1 = full SM residency)")
    p.add_argument("--watchdog-bound", type=float, default=30.0, help="seconds without progress that are a stall")
    p.add_argument("--step-log", help="directory for per-rank step logs (rankN.jsonl)")
    p.add_argument("--cross-isolation", action="store_true",
                   help="isolation-only diagnostic: odd replicas (ATP-only: odd ranks) enqueue P before D "
                        "(shows the stall)")
    p.add_argument("--expert-backend", choices=["torch", "deep_ep"], default="torch",
                   help="expert all-to-all backend of the multi-rank engine (deep_ep: --device cuda)")
    p.add_argument("--sm-partition", type=int, default=0, metavar="SMS",
                   help="CUDA: run P and D streams in one green-context partition of SMS SMs (0: whole GPU)")
    p.add_argument("--nccl-ctas", type=int, default=0, metavar="N",
                   help="CUDA: pin the NCCL kernels that can cross (registered pair, ATP, expert "
                        "all-to-alls) to N CTAs (0: NCCL's choice)")
    p.add_argument("--rank-skew-ms", type=float, default=0.0, metavar="MS",
                   help="delay each rank's D enqueue by a seeded random 0..MS ms (rank skew)")
    p.add_argument("--d-async", action="store_true",
                   help="CUDA pd: the round's ACK does not wait for D's kernels (D is waited for before sampling)")
    p.add_argument("--rendezvous", choices=["gather", "dissemination"], default="gather",
                   help="turnstile rendezvous transport: gather (all_gather, a ring in gloo) or "
                        "dissemination (log2(n) rounds of point-to-point exchanges)")
    p.add_argument("--gpu-timeline", metavar="DIR",
                   help="CUDA: write per-rank enqueue order and stream intervals to DIR/rankN.json")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdrollout", description="In-place P/D multiplexing rollout engine")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("checkpoint", help="write a random-weight Qwen3-MoE checkpoint (HF format)")
    c.add_argument("--config", required=True, help="preset name (tiny, qwen3-30b-a3b) or config.json path")
    c.add_argument("--out", required=True)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    c.add_argument("--layout", choices=["per-expert", "fused"], default="per-expert")
    c.set_defaults(func=_cmd_checkpoint)

    g = sub.add_parser("generate", help="run a JSONL file of /generate-shaped requests")
    g.add_argument("--model", required=True)
    g.add_argument("--requests", required=True, help="JSONL file, or - for stdin")
    g.add_argument("--mode", choices=["normal", "mixed", "pd"], default="pd")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    g.add_argument("--kv-cache-mb", type=int, default=256)
    g.add_argument("--sequential", action="store_true",
                   help="run one request at a time (multi-turn files then reuse earlier turns' KV)")
    g.add_argument("--nproc", type=int, default=1)
    g.add_argument("--adp", type=int, default=1)
    g.add_argument("--ep", type=int, default=1)
    g.add_argument("--control", help="initial ControlSettings as JSON, e.g. '{\"ordering\": \"fine-grained\"}'")
    g.add_argument("--engine-config", help="extra EngineConfig fields as JSON, e.g. '{\"block_size\": 4}'")
    add_rank_args(g)
    g.set_defaults(func=_cmd_generate)

    # Subcommands owned by other modules register themselves here.
    for mod, fns in (("server.cli", ("add_serve_parser",)),
                     ("workload.cli", ("add_trace_parser", "add_bench_parser"))):
        try:
            m = __import__(f"pdrollout.engine.{mod}", fromlist=list(fns))
        except ModuleNotFoundError as e:
            if e.name != f"pdrollout.engine.{mod}":
                raise
            continue
        for fn in fns:
            getattr(m, fn)(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
