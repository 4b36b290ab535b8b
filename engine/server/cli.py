"""`pdrollout serve`: argparse wiring (engine/cli.py calls add_serve_parser)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over HTTP (SGLang native + OpenAI API)",
                              description="Rollout server: SGLang-compatible /generate, OpenAI /v1/completions, "
                                          "/metrics, live /control. See docs/SERVER.md.")
    p.add_argument("--model", required=True, help="model directory (config.json + *.safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed on stdout)")
    p.add_argument("--mode", choices=["normal", "mixed", "pd"], default="pd")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--served-model-name", default=None, help="model id in /v1/models (default: --model)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or a directory holding one; enables text prompts and text output")
    p.add_argument("--engine-config", default=None,
                   help="extra EngineConfig fields: inline JSON or a JSON file, e.g. '{\"kv_cache_bytes\": 1e9}'")
    p.add_argument("--max-body-bytes", type=int, default=32 << 20, help="larger request bodies get 413")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGTERM before they are aborted")
    p.add_argument("--rollout-idle", type=float, default=5.0,
                   help="a rollout with no request in flight for this long is finished")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="stream only new tokens per chunk (SGLang's flag; default: cumulative)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--nproc", type=int, default=1, help="ranks (rank 0 serves HTTP, the others are workers)")
    p.add_argument("--adp", type=int, default=1, help="attention data-parallel width")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel width")
    from ..cli import add_rank_args
    add_rank_args(p)
    p.set_defaults(func=run_serve)
    return p


def _engine_overrides(spec: str | None) -> dict:
    if not spec:
        return {}
    text = Path(spec).read_text() if Path(spec).is_file() else spec
    value = json.loads(text)
    if not isinstance(value, dict):
        raise SystemExit("--engine-config must be a JSON object")
    return value


def run_serve(args: argparse.Namespace) -> int:
    from ..config import EngineConfig
    from .app import ServerSettings
    from .serve import run
    from .tokenizer import find_tokenizer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Validate the engine config before listening, so a typo fails fast with a clear message.
    config = EngineConfig(model=args.model, device=args.device, mode=args.mode,
                          **_engine_overrides(args.engine_config))
    settings = ServerSettings(model=args.model, served_model_name=args.served_model_name, host=args.host,
                              port=args.port, mode=args.mode, device=args.device,
                              max_body_bytes=args.max_body_bytes, drain_timeout_s=args.drain_timeout,
                              rollout_idle_s=args.rollout_idle,
                              incremental_streaming_output=args.incremental_streaming_output)
    tokenizer = find_tokenizer(args.model, args.tokenizer)
    made: list = []
    topo = None
    if args.nproc > 1:
        from ..distributed.entry import check_topology
        from ..distributed.topology import TopologyError
        try:
            topo = check_topology(args.model, args.nproc, args.adp, args.ep)
        except TopologyError as e:   # before any process starts
            raise SystemExit(f"pdrollout serve: {e}")

    def make_engine():
        if topo is not None:   # rank 0 here, ranks 1..N-1 spawned (or torchrun's)
            from ..distributed.entry import options_from_args, start_engine
            made.append(start_engine(config, topo, options_from_args(args)))
            return made[-1]
        from ..engine import Engine
        return Engine(config)

    def say(msg: str) -> None:
        print(msg, flush=True)

    rc = asyncio.run(run(settings, make_engine, tokenizer, ready_message=say))
    for engine in made:   # the engine thread has stopped: tell the workers, then reap them
        from ..distributed.entry import stop_engine
        stop_engine(engine)
    # Interpreter teardown with torch loaded takes seconds; the server is already shut down
    # cleanly, so leave now (a SIGTERM'd pod should exit fast).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def main(argv=None) -> int:
    """Stand-alone entry (`python -m pdrollout.engine.server.cli`) until engine/cli.py hooks it."""
    parser = argparse.ArgumentParser(prog="pdrollout")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
