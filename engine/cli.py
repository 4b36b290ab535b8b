"""`pdrollout` console script."""
from __future__ import annotations

import argparse
import json
import sys


def _cmd_checkpoint(a) -> int:
    from .model.checkpoint import write_checkpoint
    from .protocol.config import load_preset
    out = write_checkpoint(load_preset(a.config), a.out, seed=a.seed, dtype=a.dtype, layout=a.layout)
    print(f"wrote {out}", file=sys.stderr)
    return 0




def _cmd_generate(a) -> int:
    from .protocol.config import ControlSettings, EngineConfig
    from .protocol.exits import EXIT_CONFIG
    from .protocol.layout import LayoutError
    from .runtime.engine import Engine
    from .generate import run_requests, read_requests
    try:
        layout = layout_from_args(a)
        fields = {"kv_cache_bytes": 256 << 20, **engine_overrides(a.engine_config)}
        control = fields.pop("control", {})
        if a.control:   # the flag's keys over the file's
            control = {**control, **json.loads(a.control)}
        flags = {"dtype": a.dtype, "kv_cache_bytes": a.kv_cache_mb << 20 if a.kv_cache_mb is not None else None}
        fields.update({k: v for k, v in flags.items() if v is not None})
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
    engine = Engine(cfg, single_worker(a, cfg, layout))
    lines = read_requests(a.requests)
    for rec in run_requests(engine, lines, sequential=a.sequential):
        print(json.dumps(rec), flush=True)
    return 0


def single_worker(a, cfg, layout):
    """The world of one, with the rank options the flags give (e.g. --step-log)."""
    from .protocol.topology import Topology
    from .runtime.launcher import options_from_args
    from .runtime.worker import Worker
    return Worker(cfg, Topology(1), 0, options=options_from_args(a, layout))


def engine_overrides(spec: str | None) -> dict:
    """Extra EngineConfig fields from `--engine-config`: inline JSON or a JSON file."""
    from pathlib import Path
    if not spec:
        return {}
    try:
        text = Path(spec).read_text() if Path(spec).is_file() else spec
        value = json.loads(text)
    except (OSError, ValueError) as e:
        raise ValueError(f"--engine-config {spec!r}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--engine-config must be a JSON object")
    return value


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """The group layout (docs/DISTRIBUTED.md): flags override PDROLLOUT_* env, which overrides the
    layout file. Unset flags (None) leave the other sources' values."""
    g = p.add_argument_group("group layout (flags > PDROLLOUT_* env > layout file)")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default cpu; env PDROLLOUT_DEVICE)")
    g.add_argument("--nproc", type=int, default=None,
                   help="ranks in the group on one node (the world size; several nodes: --nnodes/--nproc-per-node)")
    g.add_argument("--adp", type=int, default=None, help="attention data-parallel width (default 1)")
    g.add_argument("--ep", type=int, default=None, help="expert-parallel width (default 1)")
    g.add_argument("--expert-backend", choices=["torch", "deep_ep"], default=None,
                   help="expert all-to-all backend of the multi-rank engine (default torch; deep_ep: --device cuda)")
    g.add_argument("--nnodes", type=int, default=None, help="nodes (pods) forming one engine (default 1)")
    g.add_argument("--node-rank", type=int, default=None, help="this node's index; node 0 serves the API")
    g.add_argument("--nproc-per-node", type=int, default=None, help="local ranks per node (GPUs, or CPU processes)")
    g.add_argument("--master-addr", default=None, help="node 0's address (its store and HTTP API)")
    g.add_argument("--master-port", type=int, default=None, help="node 0's store port (default 29500)")
    g.add_argument("--join-timeout", type=float, default=None,
                   help="seconds a node waits for the whole group before it exits with 'peer lost' (default 300)")
    g.add_argument("--layout", default=None,
                   help="layout file (JSON, the operator's rollout.json; default: $PDROLLOUT_ROLLOUT_INFO)")


def layout_from_args(a: argparse.Namespace):
    """The GroupLayout from flags, env and the layout file; LayoutError if they do not form a group."""
    from .protocol.layout import resolve
    return resolve({"nproc": a.nproc, "layout": a.layout, "device": a.device, "adp": a.adp, "ep": a.ep,
                    "expert_backend": a.expert_backend, "nnodes": a.nnodes, "node_rank": a.node_rank,
                    "nproc_per_node": a.nproc_per_node, "master_addr": a.master_addr,
                    "master_port": a.master_port, "join_timeout_s": a.join_timeout})


def add_rank_args(p: argparse.ArgumentParser) -> None:
    """Knobs of the multi-rank engine's device model and watchdog (--nproc > 1)."""
    p.add_argument("--slots", type=int, default=2, help="CPU device execution slots per rank (1 = full SM residency)")
    p.add_argument("--watchdog-bound", type=float, default=30.0, help="seconds without progress that are a stall")
    p.add_argument("--step-log", help="directory for per-rank step logs (rankN.jsonl)")
    p.add_argument("--cross-isolation", action="store_true",
                   help="isolation-only diagnostic: odd replicas (ATP-only: odd ranks) enqueue P before D "
                        "(shows the stall)")
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
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                   help="weights' dtype (default: --engine-config's, else auto)")
    g.add_argument("--kv-cache-mb", type=int, default=None, help="KV cache budget (default 256, or --engine-config's)")
    g.add_argument("--sequential", action="store_true",
                   help="run one request at a time (multi-turn files then reuse earlier turns' KV)")
    g.add_argument("--control", help="initial ControlSettings as JSON, e.g. '{\"ordering\": \"fine-grained\"}'")
    g.add_argument("--engine-config", help="extra EngineConfig fields: inline JSON or a JSON file, "
                                           "e.g. '{\"block_size\": 4}' (flags win over it)")
    add_layout_args(g)
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
