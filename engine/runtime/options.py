"""Command-line knobs of the runtime, shared by `pdrollout generate` and `pdrollout serve`: the
group layout, the rank options (device model, watchdog, diagnostics) and the engine config file."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass


@dataclass
class RankOptions:
    """Per-run knobs of a multi-rank group that are not EngineConfig fields."""
    slots: int = 2                  # CPU device model: execution slots per rank (1 = full SM residency)
    watchdog_bound_s: float = 30.0
    step_log: str | None = None     # directory for per-rank step logs (JSONL)
    cross_isolation: bool = False   # isolation-only diagnostic: odd sides enqueue P before D (Worker.side)
    expert_backend: str = "torch"   # torch | deep_ep (deep_ep: device cuda, deep_ep importable)
    # Issue 8's knobs (CUDA only): the device condition under which crossed orders stall.
    sm_partition: int = 0           # P and D streams share one green-context partition of this many SMs
    nccl_ctas: int = 0              # min = max CTAs of the registered pair's (and ATP's) NCCL kernels
    skew_ms: float = 0.0            # a seeded random 0..skew_ms delay before each D enqueue (rank skew)
    gpu_timeline: str | None = None  # directory for per-rank GPU timelines (gpu_timeline.py)
    # CUDA pd: the round's ACK does not wait for D's kernels (the delayed ACK). None: on where the
    # ordering puts P's registered collective behind D (fine-grained, global-enqueue; pd_step.py)
    d_async: bool | None = None
    rendezvous: str = "gather"      # turnstile rendezvous transport: gather | dissemination


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
    from ..protocol.layout import resolve
    return resolve({"nproc": a.nproc, "layout": a.layout, "device": a.device, "adp": a.adp, "ep": a.ep,
                    "expert_backend": a.expert_backend, "nnodes": a.nnodes, "node_rank": a.node_rank,
                    "nproc_per_node": a.nproc_per_node, "master_addr": a.master_addr,
                    "master_port": a.master_port, "join_timeout_s": a.join_timeout})


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding inside D (off by default)."""
    g = p.add_argument_group("speculative decoding (docs/ARCHITECTURE.md, 'Speculation')")
    g.add_argument("--speculative", choices=["ngram", "draft", "mtp"], default=None,
                   help="propose draft tokens per decode row and verify them in the same D iteration "
                        "(ngram: prompt lookup, no model; draft: --draft-model on rank 0; mtp: the checkpoint's own "
                        "MTP head (config num_nextn_predict_layers, mtp.* tensors), one rank)")
    g.add_argument("--speculative-k", type=int, default=None, metavar="K",
                   help="draft tokens per decode row (1..8, default 4)")
    g.add_argument("--draft-model", default=None, metavar="DIR", help="draft checkpoint of --speculative draft")


def spec_fields(a) -> dict:
    """EngineConfig fields from the speculation flags; ValueError on a combination that means nothing."""
    spec, k, draft = getattr(a, "speculative", None), getattr(a, "speculative_k", None), getattr(a, "draft_model", None)
    if spec is None:
        if k is not None or draft is not None:
            raise ValueError("--speculative-k and --draft-model need --speculative")
        return {}
    if spec == "draft" and not draft:
        raise ValueError("--speculative draft needs --draft-model DIR (a checkpoint with the target's vocabulary)")
    if draft and spec != "draft":
        raise ValueError(f"--draft-model is only used by --speculative draft, not {spec}")
    return {"speculative": spec, **({"speculative_k": k} if k is not None else {}),
            **({"draft_model": draft} if draft else {})}


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
    p.add_argument("--d-async", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA pd: the round's ACK does not wait for D's kernels (D is waited for before "
                        "sampling); default: on under fine-grained and global-enqueue")
    p.add_argument("--rendezvous", choices=["gather", "dissemination"], default="gather",
                   help="turnstile rendezvous transport: gather (all_gather, a ring in gloo) or "
                        "dissemination (log2(n) rounds of point-to-point exchanges)")
    p.add_argument("--gpu-timeline", metavar="DIR",
                   help="CUDA: write per-rank enqueue order and stream intervals to DIR/rankN.json")


def options_from_args(a, layout: GroupLayout):
    return RankOptions(slots=getattr(a, "slots", 2), watchdog_bound_s=getattr(a, "watchdog_bound", 30.0),
                       step_log=getattr(a, "step_log", None),
                       cross_isolation=getattr(a, "cross_isolation", False),
                       expert_backend=layout.expert_backend,
                       sm_partition=getattr(a, "sm_partition", 0), nccl_ctas=getattr(a, "nccl_ctas", 0),
                       skew_ms=getattr(a, "rank_skew_ms", 0.0), gpu_timeline=getattr(a, "gpu_timeline", None),
                       d_async=getattr(a, "d_async", None), rendezvous=getattr(a, "rendezvous", "gather"))
