"""`pdrollout` console script."""
from __future__ import annotations

import argparse
import json
import sys
from typing import get_args

from .protocol.config import Mode
from .runtime.options import add_layout_args, add_rank_args, add_spec_args


def _cmd_checkpoint(a) -> int:
    from .model.checkpoint import write_checkpoint, write_dequantized
    from .protocol.config import load_preset
    if a.dequantized_twin and a.dtype != "fp8":
        print("pdrollout checkpoint: --dequantized-twin needs --dtype fp8", file=sys.stderr)
        return 2
    if a.mtp_layers < 0:
        print("pdrollout checkpoint: --mtp-layers must be >= 0", file=sys.stderr)
        return 2
    config = load_preset(a.config)
    if a.mtp_layers:
        config = {**config, "num_nextn_predict_layers": a.mtp_layers}
    out = write_checkpoint(config, a.out, seed=a.seed, dtype=a.dtype, layout=a.layout)
    print(f"wrote {out}", file=sys.stderr)
    if a.dequantized_twin:
        print(f"wrote {write_dequantized(out, a.dequantized_twin)}", file=sys.stderr)
    return 0


def _cmd_generate(a) -> int:
    from .protocol.config import ControlSettings, EngineConfig
    from .protocol.exits import EXIT_CONFIG
    from .protocol.layout import LayoutError
    from .runtime.offline import read_requests, run_requests
    from .runtime.engine import Engine
    from .runtime.options import engine_overrides, layout_from_args, spec_fields
    try:
        layout = layout_from_args(a)
        fields = engine_overrides(a.engine_config)
        control = fields.pop("control", {})
        if a.control:   # the flag's keys over the file's
            control = {**control, **json.loads(a.control)}
        flags = {"dtype": a.dtype, "kv_cache_bytes": a.kv_cache_mb << 20 if a.kv_cache_mb is not None else None}
        fields.update({k: v for k, v in flags.items() if v is not None})
        fields.update(spec_fields(a))
        cfg = EngineConfig(model=a.model, device=layout.device, mode=a.mode,
                           control=ControlSettings.model_validate(control), **fields)
    except (LayoutError, ValueError) as e:   # pydantic's ValidationError and bad JSON are ValueErrors
        print(f"pdrollout generate: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if layout.world > 1:
        from .runtime.launcher import launch_generate
        return launch_generate(a, cfg, layout)
    if layout.expert_backend != "torch":
        print(f"pdrollout generate: --expert-backend {layout.expert_backend} needs --nproc > 1 (expert parallelism)",
              file=sys.stderr)
        return EXIT_CONFIG
    from .runtime.worker import single_worker
    engine = Engine(cfg, single_worker(a, cfg, layout))
    lines = read_requests(a.requests)
    for rec in run_requests(engine, lines, sequential=a.sequential):
        print(json.dumps(rec), flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdrollout", description="In-place P/D multiplexing rollout engine")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("checkpoint", help="write a random-weight Qwen3-MoE checkpoint (HF format)")
    c.add_argument("--config", required=True, help="preset name (tiny, qwen3-30b-a3b) or config.json path")
    c.add_argument("--out", required=True)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--dtype", choices=["float32", "bfloat16", "fp8"], default="float32",
                   help="fp8: the block-FP8 layout of Hugging Face FP8 releases (e4m3 + 128x128 block scales)")
    c.add_argument("--dequantized-twin", metavar="DIR",
                   help="with --dtype fp8: also write the same model dequantized to float32 (an ordinary checkpoint)")
    c.add_argument("--layout", choices=["per-expert", "fused"], default="per-expert")
    c.add_argument("--mtp-layers", type=int, default=0, metavar="N",
                   help="also write an MTP head of N layers (Qwen3-Next's mtp.* tensors; --speculative mtp)")
    c.set_defaults(func=_cmd_checkpoint)

    g = sub.add_parser("generate", help="run a JSONL file of /generate-shaped requests")
    g.add_argument("--model", required=True)
    g.add_argument("--requests", required=True, help="JSONL file, or - for stdin")
    g.add_argument("--mode", choices=get_args(Mode), default="pd")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                   help="weights' dtype (default: --engine-config's, else auto)")
    g.add_argument("--kv-cache-mb", type=int, default=None, help="KV cache budget (default: --engine-config's, else on one CUDA "
                   "rank kv_mem_fraction of the free memory, elsewhere 256)")
    g.add_argument("--sequential", action="store_true",
                   help="run one request at a time (multi-turn files then reuse earlier turns' KV)")
    g.add_argument("--control", help="initial ControlSettings as JSON, e.g. '{\"ordering\": \"fine-grained\"}'")
    g.add_argument("--engine-config", help="extra EngineConfig fields: inline JSON or a JSON file, "
                                           "e.g. '{\"block_size\": 4}' (flags win over it)")
    add_layout_args(g)
    add_rank_args(g)
    add_spec_args(g)
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
