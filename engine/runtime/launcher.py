"""Entry points of the multi-rank engine: `pdrollout generate|serve` over a group layout.

Node 0 runs rank 0 in this process (intake, planner, HTTP) and spawns its other local ranks;
node k > 0 spawns all of its local ranks and serves /health and /metrics for them (node.py).
Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR in the environment) nothing is spawned: every
process initializes from the environment and ranks other than 0 run the worker loop. The layout,
the topology and the model's divisibility are checked before any process starts.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from ..protocol.exits import EXIT_CONFIG, EXIT_ERROR, EXIT_PEER_LOST, EXIT_STALL, exit_code, last_words, lost_report, name as exit_name, say, flush_quietly
from ..protocol.layout import GroupLayout, LayoutError
from ..protocol.topology import Topology, TopologyError

_PG_TIMEOUT = datetime.timedelta(days=1)   # idle workers wait in the plan broadcast; the watchdog finds stalls


def check_topology(model_dir: str, nproc: int, adp: int, ep: int) -> Topology:
    """A clear error for any combination the model or the world cannot run."""
    from ..protocol.config import ModelConfig
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
    """This process's place in the run and the local ranks it started (node 0's rank 0)."""
    rank: int
    layout: GroupLayout
    store: object
    local: object = None          # local_ranks.LocalRanks, or None under torchrun
    counters: object = None       # node.RankCounters of this node's ranks
    stop_watch: object = field(default=None)

    @property
    def topo(self) -> Topology:
        return self.layout.topology

    def join(self, timeout_s: float = 30.0) -> None:
        if self.stop_watch is not None:
            self.stop_watch.set()
        if self.local is not None:   # never leave a straggler behind
            self.local.wait_all(timeout_s)
            self.local.terminate(grace_s=2.0)


def _init_pg(rank: int, world: int, store) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                            timeout=_PG_TIMEOUT)


def _child(rank: int, layout: GroupLayout, config_json: str, options: dict, counters) -> None:
    """A spawned rank: join the group, run the worker loop, exit with the group's verdict."""
    import signal
    import torch.distributed as dist
    # Ctrl-C reaches the whole process group: the launcher stops the group, the rank must not die first
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    leave_with_launcher(rank)
    from .node import connect_and_join
    from .watchdog import report_lost
    code, store, box = EXIT_ERROR, None, []
    try:
        store = connect_and_join(layout, rank)
        _init_pg(rank, layout.world, store)
        code = _run_worker(rank, layout, store, config_json, options, counters, box)
    except BaseException as e:
        code = box[0].wd.verdict(e) if box else exit_code(e)
        say(f"[rank {rank}] {type(e).__name__}: {e}")
        if store is not None and code != EXIT_STALL:   # tell the group at once, with the cause
            report_lost(dist.PrefixStore("wd", store), rank, lost_report(rank, code, e), code)
        # last, Worker.exit_now's line: an error outside a step (rank 0 gone while this rank waited for
        # its next plan) ends here, and an orphaned rank has no one else to say how it ended
        say(last_words(rank, code, e))
    os._exit(code)   # no teardown: a collective thread may still be blocked


class LauncherGone(ConnectionError):
    """This rank's launcher died without stopping it (the rank was reparented)."""


def leave_with_launcher(rank: int, poll_s: float = 0.5) -> None:
    """A rank outlives no launcher: once it is gone (a signal before its handlers, SIGKILL, the OOM
    killer) the rank is reparented (its parent, the launcher's forkserver, ends with the launcher:
    local_ranks.start_process), and leaves within poll_s with the lost-peer code. A rank left behind in a
    deleted pod kept running until the pod's grace ended, joined the next group under node 0's
    stable name, and took that group down when it was killed (a second group restart)."""
    import multiprocessing
    parent = os.getppid()
    starter = multiprocessing.parent_process()
    launcher = starter.pid if starter is not None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        # the same last words as any other ending: an orphan's log tail is all anyone reads
        gone = LauncherGone(f"this rank's launcher (pid {launcher}) is gone; leaving")
        say(last_words(rank, EXIT_PEER_LOST, gone))
        os._exit(EXIT_PEER_LOST)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def _run_worker(rank: int, layout: GroupLayout, store, config_json: str, options: dict, counters,
                box: list) -> int:
    import torch.distributed as dist
    from ..protocol.config import EngineConfig
    from .options import RankOptions
    from .worker import Worker, worker_loop
    config = EngineConfig.model_validate_json(config_json)
    w = Worker(config, layout.topology, rank, dist.PrefixStore("wd", store), RankOptions(**options), counters)
    box.append(w)
    return worker_loop(w)


def start_ranks(layout: GroupLayout, config, options, host: str | None = None) -> RankGroup:
    """Node 0's rank 0: from torchrun's environment, or host the store and spawn ranks 1..L-1."""
    import torch.distributed as dist
    from .local_ranks import spawn
    from .node import RankCounters, bind_gloo, connect_store, join
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != layout.world:
            raise TopologyError(f"WORLD_SIZE {world} from the environment, but the layout has {layout.world} ranks")
        import torch
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=_PG_TIMEOUT)
        from torch.distributed.distributed_c10d import _get_default_store
        group = RankGroup(rank, layout, _get_default_store())
        if rank != 0:
            os._exit(_run_worker(rank, layout, group.store, config.model_dump_json(), asdict(options), None, []))
        return group
    bind_gloo(host)
    store = connect_store(layout, 0, master=True)
    layout = dataclasses.replace(layout, master_port=store.port)   # port 0: the one picked
    counters = RankCounters(layout.local_ranks)
    local = spawn(layout, range(1, layout.nproc_per_node), _child,
                  (layout, config.model_dump_json(), asdict(options), counters))
    group = RankGroup(0, layout, store, local, counters)
    try:
        join(store, layout, 0, ended=local.first_exit)
        _init_pg(0, layout.world, store)
    except BaseException:
        group.join(0)
        raise
    return group


def start_engine(config, layout: GroupLayout, options, host: str | None = None):
    """Node 0's Engine over its group, joined and its first step run; `engine.ranks` holds the group."""
    import threading
    import torch.distributed as dist
    from .engine import Engine
    from .local_ranks import watch
    from .worker import Worker
    check_device(config, options)
    group = start_ranks(layout, config, options, host)
    worker = None
    try:
        worker = Worker(config, layout.topology, 0, dist.PrefixStore("wd", group.store), options, group.counters)
        if group.local is not None:   # a local rank that ends is a lost peer for the whole group
            worker.exit_hooks.append(lambda err, code: group.local.terminate(grace_s=1.0))
            group.stop_watch = threading.Event()
            watch(group.local, lambda r, c: c != EXIT_STALL and worker.wd.declare_lost(
                f"lost: rank {r} (node 0) exited with code {c} ({exit_name(c)})"), stop=group.stop_watch)
        engine = Engine(config, worker)   # runs step 0: the group can fail (or stall) here
    except BaseException as e:
        if worker is not None:
            e.exit_code = worker.wd.verdict(e)
        group.join(0)
        raise
    engine.ranks = group
    return engine


def reap_children(grace_s: float = 2.0) -> None:
    """End every rank this process spawned that is still running (SIGTERM, then SIGKILL after the
    grace), and start none after: a launcher that leaves, e.g. on SIGTERM while the group was still
    joining, before any engine held its ranks, must not leave them behind."""
    import multiprocessing
    import time
    from .local_ranks import stop_spawning
    stop_spawning()
    live = multiprocessing.active_children()
    for p in live:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in live:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2)


def stop_engine(engine) -> None:
    engine.ranks.stop_watch and engine.ranks.stop_watch.set()
    try:
        engine.shutdown()
    except Exception as e:   # workers already gone (a failed rank): reap them regardless
        print(f"pdrollout: worker shutdown: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        engine.ranks.join(0)
    engine.ranks.join()


def run_worker_node(layout: GroupLayout, config, options, host: str | None = None, port: int | None = None,
                    metrics_port: int | None = None) -> int:
    """Node k > 0: start this node's ranks, serve /health and /metrics, exit with their verdict."""
    from .node import WorkerNode, bind_gloo, log_stderr
    check_device(config, options)
    bind_gloo(host)
    node = WorkerNode(layout, _child, (layout, config.model_dump_json(), asdict(options)), host, port,
                      exit_wait_s=2 * options.watchdog_bound_s + 10, log=log_stderr, metrics_port=metrics_port)
    return node.run()


def check_device(config, options) -> None:
    """--device cpu (gloo everywhere) or cuda (rank r on cuda:<local rank>, NCCL data groups);
    the deep_ep expert backend needs cuda. A clear error before any process starts."""
    from ..protocol.layout import EXPERT_BACKENDS
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


def prepare(a, cfg, layout: GroupLayout, command: str):
    """Options for `layout`, checked with the model: (options, None) or (None, a bad-configuration message)."""
    from .options import options_from_args
    options = options_from_args(a, layout)
    try:
        check_topology(cfg.model, layout.world, layout.adp, layout.ep)
        check_device(cfg, options)
    except (TopologyError, LayoutError, ValueError) as e:
        return None, f"pdrollout {command}: {e}"
    return options, None


def _exit_now(code: int) -> None:
    """No interpreter teardown: a collective thread of this rank may still be blocked in gloo, and
    finalizing under it aborts the process (SIGABRT, "terminate called without an active
    exception") instead of exiting with the verdict."""
    flush_quietly()
    os._exit(code)


def launch_generate(a, cfg, layout: GroupLayout) -> int:
    """`pdrollout generate` on several ranks: results on stdout in input order, as with one rank.
    On node k > 0 this process only runs its node's ranks."""
    from .offline import read_requests, run_requests
    options, error = prepare(a, cfg, layout, "generate")
    if error:
        print(error, file=sys.stderr)
        return EXIT_CONFIG
    if not layout.is_master:
        return run_worker_node(layout, cfg, options)
    lines = read_requests(a.requests)
    try:
        engine = start_engine(cfg, layout, options)
    except BaseException as e:
        code = exit_code(e)
        print(f"pdrollout generate: {type(e).__name__}: {e} (exit {code}: {exit_name(code)})",
              file=sys.stderr, flush=True)
        if hasattr(e, "exit_code"):   # the group had formed: a collective thread may still be blocked
            _exit_now(code)           # (step 0 stalls too), and teardown under it aborts (see below)
        return code
    try:
        for rec in run_requests(engine, lines, sequential=a.sequential):
            print(json.dumps(rec), flush=True)
    except BaseException as e:   # a stall or a failed rank: the others may be stuck, end them
        code = engine.worker.wd.verdict(e)
        print(f"pdrollout generate: {type(e).__name__}: {e} (exit {code}: {exit_name(code)})",
              file=sys.stderr, flush=True)
        engine.ranks.join(0)
        _exit_now(code)
    stop_engine(engine)
    if str(cfg.device).startswith("cuda"):   # skip interpreter teardown of NCCL/NVSHMEM state
        _exit_now(0)
    return 0
