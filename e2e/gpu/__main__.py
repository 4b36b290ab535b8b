"""The GPU tool: `python -m e2e.gpu SUBCOMMAND WHAT [ARGS...]` from the repo root (after
`source e2e/gpu/env.sh` on the GPU machine). `python -m e2e.gpu` lists what each subcommand runs;
`python -m e2e.gpu SUBCOMMAND WHAT --help` a tool's own options. DEVICE=cpu: each one's dry run here.
"""
from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# subcommand -> what -> a module of this package (its main() reads sys.argv) or a shell script here
COMMANDS: dict[str, dict[str, str]] = {
    "tests": {
        "one-stack": "one_stack",          # the one-stack checks against transformers, two GPUs
        "multinode": "multinode",          # the operator's two-node launch on two GPUs
        "rendezvous": "rendezvous",        # the rendezvous transports on two GPUs
        "deepep": "deepep_check",          # DeepEP's dispatch/combine against torch
        "ep2": "ep2_engine.sh",            # EP2 with the DeepEP backend against torch
        "release-resume": "release_resume",
        "spec-fp8": "spec_fp8",
        "ladder": "ladder",                # multi-process rank ladder on 8 GPUs
        "stall": "stall",                  # CUDA-event timeline of a stalled rank
    },
    "bench": {
        "seeds": "bench_seeds",            # the modes' makespans over seeds (the one mode bench)
        "plan": "plan.sh",                 # a named set of bench/kernel runs in one device call
        "engine": "bench_engine",          # engine-level decode/prefill steps beside their floors
        "ep2-rank": "ep2_rank",            # one EP2 rank's decode graph on one GPU, against its floor
        "variants": "bench_kernels.sh",    # bench_engine once per kernel variant, one table
        "decode-ab": "decode_ab",
        "d-beside-p": "d_beside_p",
        "fused-step": "fused_step",
        "padding-routes": "padding_routes",
        "routing": "routing_check",
        "drift": "drift",
    },
    "kernels": {
        "moe": "moe_kernels",
        "attn": "attn_kernels",
        "decode-attn": "decode_attn",
        "kv-scatter": "kv_scatter",
        "hbm": "hbm",                      # the copy rate every floor is taken against
    },
    "profile": {
        "decode": "profile_decode",
        "spy": "spy_summary",              # py-spy dumps summarised per thread
    },
    "report": {
        "repeats": "repeats",
        "spec-matrix": "spec_matrix",
        "same-tokens": "same_tokens",
        "step-pairs": "step_pairs",
        "step-costs": "step_costs",
        "critical-path": "critical_path",
        "ttft": "ttft_epochs",
    },
}


def usage() -> str:
    lines = [__doc__.strip(), ""]
    for sub, whats in COMMANDS.items():
        lines.append(f"  {sub}: {', '.join(whats)}")
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in COMMANDS or argv[1] not in COMMANDS[argv[0]]:
        known = COMMANDS.get(argv[0]) if argv else None
        what = f"unknown {argv[0]} target {argv[1]!r}" if known and len(argv) > 1 else \
            f"unknown subcommand {argv[0]!r}" if argv and not known else "no subcommand"
        print(f"{what}\n{usage()}", file=sys.stderr)
        return 2
    sub, what, rest = argv[0], argv[1], argv[2:]
    target = COMMANDS[sub][what]
    if target.endswith(".sh"):
        return subprocess.call(["bash", str(HERE / target), *rest])
    sys.argv = [f"python -m e2e.gpu {sub} {what}", *rest]   # before the import: some read it at module level
    mod = importlib.import_module(f"{__package__}.{target}")
    main = mod.main
    rc = main(rest) if inspect.signature(main).parameters else main()
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
