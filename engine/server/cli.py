"""`pdrollout serve`: argparse wiring (engine/cli.py calls add_serve_parser)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import get_args

from ..protocol.auth import ADMIN_TOKEN_FILE_ENV
from ..protocol.config import Mode


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over HTTP (SGLang native + OpenAI API)",
                              description="Rollout server: SGLang-compatible /generate, OpenAI /v1/completions, "
                                          "/metrics, live /control. See docs/SERVER.md.")
    p.add_argument("--model", required=True, help="model directory (config.json + *.safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed on stdout)")
    p.add_argument("--mode", choices=get_args(Mode), default="pd")
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
    p.add_argument("--admin-token-file", default=os.environ.get(ADMIN_TOKEN_FILE_ENV) or None,
                   help="file holding the bearer token the admin routes (PUT /control, pause/continue, "
                        f"weights, memory, flush, abort) require; default ${ADMIN_TOKEN_FILE_ENV}; "
                        "unset: those routes are open")
    p.add_argument("--admin-api-key", default=None,
                   help="SGLang's name: the admin token given inline (prefer --admin-token-file: a "
                        "command line is visible to other processes); not with --admin-token-file")
    p.add_argument("--api-key", default=None,
                   help="SGLang's --api-key: every route but /health*, /metrics, /live needs "
                        "Authorization: Bearer <key> (or x-api-key); also guards the admin routes "
                        "when no admin token is set (prefer --api-key-file)")
    p.add_argument("--api-key-file", default=None,
                   help="file holding the api key (a mounted Secret; surrounding whitespace ignored); "
                        "not with --api-key")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="also serve GET /metrics alone on this port (0: a free one), for a network "
                        "policy that admits scrapers to it and nothing else")
    p.add_argument("--admin-peers", default=None, metavar="CIDR[,CIDR...]",
                   help="requests from these peer addresses are admitted to every route without a key "
                        "(the RL trainer's pods); loopback is not trusted unless listed")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="SGLang's flag: /release_memory_occupation and /resume_memory_occupation free and "
                        "take back the weights, KV cache and CUDA graphs (without it they are refused), "
                        "and /get_server_info says enable_memory_saver true")
    p.add_argument("--tool-call-parser", choices=("qwen25", "qwen", "none"), default="qwen25",
                   help="SGLang's flag: chat completions with tools return Qwen's <tool_call> blocks as "
                        "tool_calls (none: left in the text)")
    p.add_argument("--log-level", default="info")
    from ..runtime.options import add_layout_args, add_rank_args, add_spec_args
    add_layout_args(p)
    add_rank_args(p)
    add_spec_args(p)
    p.set_defaults(func=run_serve)
    return p


def _secret(inline_flag: str, inline: str | None, file_flag: str, path: str | None, also: str = "") -> str | None:
    """A key given inline or in a file (once, not empty); ValueError names the flag that is wrong
    (`also`: where else the file's flag comes from)."""
    if inline is not None and path:
        raise ValueError(f"give it once: {inline_flag} or {file_flag}{also}, not both")
    if path:
        try:
            value = Path(path).read_text().strip()
        except OSError as e:
            raise ValueError(f"{file_flag}: {e.strerror}: {path}") from None
        if not value:
            raise ValueError(f"{file_flag} {path} is empty")
        return value
    if inline is not None and not inline.strip():
        raise ValueError(f"{inline_flag} is empty")
    return None if inline is None else inline.strip()


def _fail(message: str, code: int) -> int:
    print(f"pdrollout serve: {message}", file=sys.stderr, flush=True)
    return code


def run_serve(args: argparse.Namespace) -> int:
    from ..runtime.options import engine_overrides, layout_from_args, spec_fields
    from ..protocol.config import EngineConfig
    from ..protocol.exits import EXIT_CONFIG, flush_quietly, name as exit_name, say as say_err
    from ..protocol.layout import LayoutError
    from .app import ServerSettings
    from .serve import run
    from .tokenizer import find_tokenizer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not exit_with_parent():
        return _fail("the process that started this server is gone", EXIT_CONFIG)
    # Validate the layout and the engine config before listening, so a typo fails fast and clearly.
    try:
        layout = layout_from_args(args)
        config = EngineConfig(model=args.model, device=layout.device, mode=args.mode,
                              **{**engine_overrides(args.engine_config), **spec_fields(args)})
    except (LayoutError, ValueError) as e:   # pydantic's ValidationError is a ValueError
        return _fail(str(e), EXIT_CONFIG)
    try:
        admin_token = _secret("--admin-api-key", args.admin_api_key, "--admin-token-file", args.admin_token_file,
                              f" (${ADMIN_TOKEN_FILE_ENV})")
        api_key = _secret("--api-key", args.api_key, "--api-key-file", args.api_key_file)
    except ValueError as e:
        return _fail(str(e), EXIT_CONFIG)
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        return _fail(f"--metrics-port must be in [0, 65535], got {args.metrics_port}", EXIT_CONFIG)
    admin_peers: tuple = ()
    if args.admin_peers is not None:
        from .auth import parse_peers
        try:
            admin_peers = parse_peers(args.admin_peers)
        except ValueError as e:
            return _fail(str(e), EXIT_CONFIG)
    options = None
    if layout.world > 1:
        from ..runtime.launcher import prepare, run_worker_node
        options, error = prepare(args, config, layout, "serve")
        if error:
            return _fail(error.removeprefix("pdrollout serve: "), EXIT_CONFIG)
        if not layout.is_master:   # a worker node: its ranks, /health and /metrics; no API
            rc = run_worker_node(layout, config, options, args.host, args.port, args.metrics_port)
            flush_quietly()
            os._exit(rc)
    settings = ServerSettings(model=args.model, served_model_name=args.served_model_name, host=args.host,
                              port=args.port, mode=args.mode, device=layout.device,
                              max_body_bytes=args.max_body_bytes, drain_timeout_s=args.drain_timeout,
                              rollout_idle_s=args.rollout_idle,
                              incremental_streaming_output=args.incremental_streaming_output,
                              admin_token=admin_token, api_key=api_key, admin_peers=admin_peers,
                              metrics_port=args.metrics_port, enable_memory_saver=args.enable_memory_saver,
                              tool_call_parser=args.tool_call_parser)
    if admin_peers:
        logging.getLogger("pdrollout.server").info(
            "admin peers (admitted without a key): %s", ", ".join(map(str, admin_peers)))
    if admin_token is None and api_key is None and not admin_peers:
        logging.getLogger("pdrollout.server").warning(
            "no --admin-token-file: the admin routes (controls, weights, memory, pause, abort) are open")
    tokenizer = find_tokenizer(args.model, args.tokenizer)
    made: list = []

    def make_engine():
        if options is not None:   # node 0's rank 0 here; its other ranks spawned (or torchrun's)
            from ..runtime.launcher import start_engine
            made.append(start_engine(config, layout, options, args.host))
            return made[-1]
        from ..runtime.engine import Engine
        from ..runtime.worker import single_worker
        return Engine(config, single_worker(args, config, layout))

    def say(msg: str) -> None:
        print(msg, flush=True)

    failure: list[str] = []
    rc = asyncio.run(run(settings, make_engine, tokenizer, ready_message=say, failure=failure))
    for engine in made:   # the engine thread has stopped: tell the workers, then reap them
        from ..runtime.launcher import stop_engine
        if rc == 0:
            stop_engine(engine)
        else:                 # the group failed: no stop plan can reach it, end this node's ranks
            engine.ranks.join(0)
    if options is not None:   # stopped while the group was still joining: its ranks go too
        from ..runtime.launcher import reap_children
        reap_children()
    logging.shutdown()
    if rc != 0:   # last, after this node's ranks (and their tracebacks) ended: a log's tail is the verdict
        say_err(f"pdrollout serve: exit {rc} ({exit_name(rc)})" + (f": {failure[0]}" if failure else ""))
    # Interpreter teardown with torch loaded takes seconds; the server is already shut down
    # cleanly, so leave now (a SIGTERM'd pod should exit fast). Nothing here may raise: with no
    # one reading our output, a raise fell into the teardown, which aborted under a gloo thread.
    flush_quietly()
    os._exit(rc)


EXIT_WITH_PARENT = "PDROLLOUT_EXIT_WITH_PARENT"


def exit_with_parent() -> bool:
    """A server started by the bench (workload/servers.py sets PDROLLOUT_EXIT_WITH_PARENT to its
    pid) gets SIGTERM when the bench dies, however it dies: a bench killed by `timeout` had left
    a 30B-model server holding the GPU. False: the parent is gone already. The variable is not
    passed on (ranks have their own parent, this server)."""
    want = os.environ.pop(EXIT_WITH_PARENT, None)
    if not want or not sys.platform.startswith("linux"):
        return True
    import ctypes
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    return os.getppid() == int(want)   # checked after: a parent that died before the prctl


def main(argv=None) -> int:
    """Stand-alone entry (`python -m pdrollout.engine.server.cli`) until engine/cli.py hooks it."""
    parser = argparse.ArgumentParser(prog="pdrollout")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
