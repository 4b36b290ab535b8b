"""Entry points of the multi-rank engine: `pdrollout generate|serve --nproc N --adp D --ep E`.

This process is rank 0 (intake, planner, HTTP); ranks 1..N-1 are spawned workers. Under torchrun
(RANK/WORLD_SIZE/MASTER_ADDR in the environment) nothing is spawned: every process initializes
from the environment and ranks other than 0 run the worker loop. The topology and the model's
divisibility are checked before any process starts.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

from .launch import EXIT_ERROR
from .topology import Topology, TopologyError

_PG_TIMEOUT = datetime.timedelta(days=1)   # idle workers wait in the plan broadcast; the watchdog finds stalls


def check_topology(model_dir: str, nproc: int, adp: int, ep: int) -> Topology:
    """A clear error for any combination the model or the world cannot run."""
    from ..config import ModelConfig
    topo = Topology(nproc, adp, ep)
    cfg = ModelConfig.load(model_dir)
    if cfg.num_attention_heads % topo.atp or cfg.num_key_value_heads % topo.atp:
        raise TopologyError(f"ATP {topo.atp} (= nproc {nproc} / adp {adp}) must divide the attention heads "
                            f"({cfg.num_attention_heads} q, {cfg.num_key_value_heads} kv)")
    if cfg.num_experts % ep:
        raise TopologyError(f"EP {ep} must divide the {cfg.num_experts} experts")
    return topo


@dataclass
class RankGroup:
    """This process's place in the run and the worker processes it started (rank 0 only)."""
    rank: int
    topo: Topology
    store: object
    children: list = field(default_factory=list)

    def join(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.children:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.children:   # never leave a straggler behind
            if p.is_alive():
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()


def _init_pg(rank: int, world: int, store) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                            timeout=_PG_TIMEOUT)


def _child(rank: int, topo: Topology, host: str, port: int, config_json: str, options: dict) -> None:
    import torch.distributed as dist
    code = EXIT_ERROR
    try:
        store = dist.TCPStore(host, port, topo.world, False, timeout=datetime.timedelta(seconds=120))
        _init_pg(rank, topo.world, store)
        code = _run_worker(RankGroup(rank, topo, store), config_json, options)
    except BaseException as e:
        print(f"[rank {rank}] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    os._exit(code)   # no teardown: a collective thread may still be blocked


def _run_worker(group: RankGroup, config_json: str, options: dict) -> int:
    import torch.distributed as dist
    from ..config import EngineConfig
    from .worker import RankOptions, Worker, worker_loop
    config = EngineConfig.model_validate_json(config_json)
    w = Worker(config, group.topo, group.rank, dist.PrefixStore("wd", group.store), RankOptions(**options))
    return worker_loop(w)


def start_ranks(topo: Topology, config, options) -> RankGroup:
    """Rank 0 side: from torchrun's environment, or spawn ranks 1..N-1 around a TCPStore here."""
    import torch.distributed as dist
    import torch.multiprocessing as mp
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != topo.world:
            raise TopologyError(f"WORLD_SIZE {world} from the environment, but --nproc {topo.world}")
        import torch
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=_PG_TIMEOUT)
        from torch.distributed.distributed_c10d import _get_default_store
        group = RankGroup(rank, topo, _get_default_store())
        if rank != 0:
            os._exit(_run_worker(group, config.model_dump_json(), asdict(options)))
        return group
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store = dist.TCPStore(host, 0, topo.world, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    group = RankGroup(0, topo, store)
    for r in range(1, topo.world):
        p = ctx.Process(target=_child, args=(r, topo, host, store.port, config.model_dump_json(), asdict(options)),
                        daemon=True)
        p.start()
        group.children.append(p)
    _init_pg(0, topo.world, store)
    return group


def start_engine(config, topo: Topology, options):
    """Rank 0's MultiRankEngine (its ranks started); `engine.ranks` holds the processes."""
    import torch.distributed as dist
    from .mp_engine import MultiRankEngine
    from .worker import Worker
    check_device(config, options)
    group = start_ranks(topo, config, options)
    try:
        engine = MultiRankEngine(config, Worker(config, topo, 0, dist.PrefixStore("wd", group.store), options))
    except BaseException:
        group.join(0)
        raise
    engine.ranks = group
    return engine


def stop_engine(engine) -> None:
    try:
        engine.shutdown()
    except Exception as e:   # workers already gone (a failed rank): reap them regardless
        print(f"pdrollout: worker shutdown: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        engine.ranks.join(0)
    engine.ranks.join()


def check_device(config, options) -> None:
    """--device cpu (gloo everywhere) or cuda (rank r on cuda:<local rank>, NCCL data groups);
    the deep_ep expert backend needs cuda. A clear error before any process starts."""
    from .expert_comm import EXPERT_BACKENDS
    kind = str(config.device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--nproc > 1 runs on device cpu or cuda, got {config.device!r}")
    backend = getattr(options, "expert_backend", "torch")
    if backend not in EXPERT_BACKENDS:
        raise ValueError(f"--expert-backend must be one of {'|'.join(EXPERT_BACKENDS)}, got {backend!r}")
    if backend == "deep_ep" and kind != "cuda":
        raise ValueError(f"--expert-backend deep_ep needs --device cuda (got {config.device!r}); "
                         "the torch backend runs everywhere")
    for flag, value in (("--sm-partition", getattr(options, "sm_partition", 0)),
                        ("--nccl-ctas", getattr(options, "nccl_ctas", 0)),
                        ("--gpu-timeline", getattr(options, "gpu_timeline", None)),
                        ("--d-async", getattr(options, "d_async", False))):
        if value and kind != "cuda":
            raise ValueError(f"{flag} needs --device cuda (green contexts, NCCL, CUDA events)")
        if isinstance(value, int) and value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if getattr(options, "skew_ms", 0.0) < 0:
        raise ValueError(f"--rank-skew-ms must be >= 0, got {options.skew_ms}")


def options_from_args(a):
    from .worker import RankOptions
    return RankOptions(slots=getattr(a, "slots", 2), watchdog_bound_s=getattr(a, "watchdog_bound", 30.0),
                       step_log=getattr(a, "step_log", None),
                       cross_isolation=getattr(a, "cross_isolation", False),
                       expert_backend=getattr(a, "expert_backend", "torch"),
                       sm_partition=getattr(a, "sm_partition", 0), nccl_ctas=getattr(a, "nccl_ctas", 0),
                       skew_ms=getattr(a, "rank_skew_ms", 0.0), gpu_timeline=getattr(a, "gpu_timeline", None),
                       d_async=getattr(a, "d_async", False), rendezvous=getattr(a, "rendezvous", "gather"))


def launch_generate(a, cfg) -> int:
    """`pdrollout generate --nproc N ...`: results on stdout in input order, as with one rank."""
    from ..generate import read_requests, run_requests
    options = options_from_args(a)
    try:
        topo = check_topology(cfg.model, a.nproc, a.adp, a.ep)
        check_device(cfg, options)
    except (TopologyError, ValueError) as e:
        print(f"pdrollout generate: {e}", file=sys.stderr)
        return 2
    lines = read_requests(a.requests)
    engine = start_engine(cfg, topo, options)
    try:
        for rec in run_requests(engine, lines, sequential=a.sequential):
            print(json.dumps(rec), flush=True)
    except BaseException as e:   # a stall or a failed rank: the others may be stuck, end them
        print(f"pdrollout generate: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        engine.ranks.join(0)
        return 3 if type(e).__name__ == "StallError" else 1
    stop_engine(engine)
    if str(cfg.device).startswith("cuda"):   # skip interpreter teardown of NCCL/NVSHMEM state
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
