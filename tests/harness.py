"""Synthetic protocol driver: P epochs with safe boundaries and D iterations on the device
model, under any ordering, in real rank processes (see launch.run_ranks).

Shapes follow docs/DISTRIBUTED.md: P boundary i precedes its registered collective R_i (a model-wide
AllReduce, present when ATP>1), followed by P compute on the P background stream; a D
iteration is compute + ReduceScatter + AllGather on the rank's DP group (present when ADP>1).
The engine plugs its real P segment and D graph launch into the same controller calls:
`ctl.begin`, `ctl.boundary` / `ctl.finish` (P thread) and `ctl.round` (foreground).
"""
from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import asdict, dataclass

from pdrollout.engine.runtime.controller import TurnstileController
from pdrollout.engine.runtime.device import CpuDevice, DeviceError
from ranks import EXIT_ERROR, EXIT_STALL, RankContext
from pdrollout.engine.runtime.rendezvous import make_rendezvous
from pdrollout.engine.protocol.topology import Topology
from pdrollout.engine.runtime.collective_trace import Trace
from pdrollout.engine.protocol.turnstile import Ordering, TurnstileError
from pdrollout.engine.runtime.watchdog import StallError, Watchdog


@dataclass
class Scenario:
    name: str = "scenario"
    world: int = 4
    adp: int = 2
    ep: int = 4
    ordering: str = "fine-grained"
    span: int | str = 1
    activation: str = "on"
    slots: int = 1
    dispatch: str = "fifo"         # device pick among ready stream heads: fifo | random
    epochs: int = 2
    boundaries: int = 4            # safe boundaries per epoch
    epoch_gap_rounds: int = 0      # epoch k is released at round k * gap (rank-consistent)
    d_iters: int = 8               # D iterations in the run (counted by agreed rounds)
    d_ready_prob: float = 1.0
    per_rank_d_ready: bool = False  # ranks disagree on readiness; the rendezvous agrees (needs one)
    p_compute_s: float = 0.002
    d_compute_s: float = 0.001
    crossed: bool = False          # isolation-only: odd replicas enqueue P before D
    skew_small_s: float = 0.0      # per-step random delay, uniform below this ...
    skew_max_s: float = 0.0        # ... or, with probability skew_prob, uniform below this
    skew_prob: float = 0.0
    watchdog_bound_s: float = 3.0
    elems: int = 8
    seed: int = 0
    keep_trace: bool = True
    rendezvous: str = "gather"     # transport (rendezvous.RENDEZVOUS)


def _groups(topo: Topology, rank: int):
    import torch.distributed as dist
    p_pg = dist.new_group(list(topo.world_group)) if topo.p_collective_group else None
    d_pgs = [dist.new_group(list(g)) for g in topo.dp_groups] if topo.adp > 1 else None
    rdv_pg = dist.new_group(list(topo.world_group))
    return p_pg, (d_pgs[topo.local_index(rank)] if d_pgs else None), rdv_pg


def run_scenarios(ctx: RankContext, scenarios: list[Scenario]) -> list[dict]:
    """Run scenarios in order on this rank; a stall ends the process after writing its result."""
    done: list[dict] = []
    for sc in scenarios:
        r = _run_one(ctx, sc, done)
        done.append(r)
        if r.get("stalled"):
            break
    return done


def _run_one(ctx: RankContext, sc: Scenario, done: list[dict]) -> dict:
    import os
    import torch
    import torch.distributed as dist

    rank, topo = ctx.rank, Topology(sc.world, sc.adp, sc.ep)
    p_pg, d_pg, rdv_pg = _groups(topo, rank)
    res: dict = {"name": sc.name, "rank": rank, "scenario": asdict(sc), "stalled": False}
    trace = Trace(rank)
    t_start = time.monotonic()

    def on_exit(err: BaseException) -> None:  # main thread is stuck in a collective (a stall, or a lost peer)
        res.update(stalled=isinstance(err, StallError), stall_report=getattr(err, "report", str(err)),
                   stall_waited_s=getattr(err, "waited_s", None), stall_detected_s=time.monotonic() - t_start,
                   stall_frontiers=getattr(err, "frontiers", None), trace=trace.records)
        ctx.write_result(done + [res])
        os._exit(EXIT_STALL)

    wd = Watchdog(ctx.store(f"wd/{sc.name}"), rank, sc.world, sc.watchdog_bound_s,
                  on_exit=on_exit)
    dev = CpuDevice(sc.slots, sc.dispatch, seed=sc.seed + rank,
                    on_progress=lambda m: wd.progress(),
                    on_enqueue=lambda m: _traced(trace, wd, m))
    wd.extra = dev.frontier
    rdv = make_rendezvous(sc.rendezvous, rdv_pg, world=sc.world)
    ctl = TurnstileController(rdv, sc.ordering, sc.span, sc.activation, watchdog=wd,
                              p_pending=lambda: dev.pending("p"))
    order = Ordering(sc.ordering)
    rng = random.Random(sc.seed * 1000 + rank)
    rng_d = random.Random(sc.seed + (rank if sc.per_rank_d_ready else 0))

    def skew() -> None:
        if sc.skew_max_s or sc.skew_small_s:
            big = rng.random() < sc.skew_prob
            time.sleep(rng.uniform(0, sc.skew_max_s if big else sc.skew_small_s))

    def allreduce(pg, n):
        t = torch.ones(n)
        return lambda: dist.all_reduce(t, group=pg)

    d_count = [0]

    def enqueue_d(ready: bool) -> None:
        j = d_count[0]
        d_count[0] += 1
        last = dev.compute("d", sc.d_compute_s if ready else 0.0, name=f"D:{j}:compute")
        if d_pg is not None:
            group = topo.dp_group(rank)
            inp, mid = torch.ones(len(group) * sc.elems), torch.empty(sc.elems)
            out = [torch.empty(sc.elems) for _ in group]
            for coll, fn in (("rs", lambda: dist.reduce_scatter_tensor(mid, inp, group=d_pg)),
                             ("ag", lambda: dist.all_gather(out, mid, group=d_pg))):
                last = dev.collective("d", fn, f"D:{j}:{coll}", group, deps=[last],
                                      meta={"phase": "D", "key": f"D:{j}:{coll}", "round": j})

    started: dict[int, threading.Event] = {e: threading.Event() for e in range(sc.epochs)}
    finished: "queue.Queue[int]" = queue.Queue()
    pq: "queue.Queue[int | None]" = queue.Queue()
    p_error: list[BaseException] = []

    def producer() -> None:
        try:
            while (e := pq.get()) is not None:
                last = None
                for i in range(sc.boundaries):
                    skew()
                    ctl.boundary(e, i)
                    if p_pg is not None:
                        last = dev.collective(ctl.registered_lane, allreduce(p_pg, sc.elems), f"P:{e}:{i}",
                                              topo.world_group, deps=[last],
                                              meta={"phase": "P", "epoch": e, "boundary": i, "key": f"P:{e}:{i}"})
                    started[e].set()
                    last = dev.compute("p", sc.p_compute_s, name=f"P:{e}:{i}:compute", deps=[last])
                ctl.finish(e)
                finished.put(e)
        except BaseException as ex:  # surfaced by the foreground
            p_error.append(ex)
            finished.put(-1)

    pt = threading.Thread(target=producer, name="P", daemon=True)
    pt.start()
    wd.update(busy=True, phase="start")
    wd.start()
    rounds = 0
    try:
        if order is Ordering.ISOLATION_ONLY:
            per_epoch = max(1, sc.d_iters // max(1, sc.epochs))
            for e in range(sc.epochs):
                p_first = sc.crossed and topo.replica(rank) % 2 == 1
                ctl.begin(e)  # no turnstile: the permit is unbounded
                if p_first:
                    pq.put(e)
                    while not started[e].wait(0.05):
                        wd.check()
                for k in range(per_epoch):
                    ctl.round(True, enqueue_d)
                    if k == 0 and not p_first:
                        pq.put(e)
                _wait_queue(finished, wd, p_error)
                ctl.retire(e)
        else:
            e_next, d_left = 0, sc.d_iters
            while e_next < sc.epochs or ctl.active or d_left > 0:
                if p_error:
                    raise p_error[0]
                released = e_next < sc.epochs and rounds >= e_next * sc.epoch_gap_rounds
                if not ctl.active and released:
                    ctl.begin(e_next, d_active=d_left > 0)
                    pq.put(e_next)
                    e_next += 1
                    released = e_next < sc.epochs and rounds >= e_next * sc.epoch_gap_rounds
                d_ready = d_left > 0 and rng_d.random() < sc.d_ready_prob
                if order is Ordering.NORMAL and released:
                    d_ready = False  # strict P priority: D waits while P is queued
                skew()
                r = ctl.round(d_ready, enqueue_d, d_occupancy=1.0 if d_left else 0.0, p_pressure=1.0)
                rounds += 1
                d_left -= int(r.d_any)
        dev.synchronize(check=wd.check)
        pq.put(None)
        pt.join(5)
        if p_error:
            raise p_error[0]
        res["makespan_s"] = time.monotonic() - t_start
    except DeviceError:
        deadline = time.monotonic() + 1.0  # a peer that exited on a stall broke our collective
        while wd.stall is None and time.monotonic() < deadline:
            time.sleep(wd.poll_s)
        if wd.stall is None:
            raise
        err = wd.stall
        res.update(stalled=True, stall_report=err.report, stall_waited_s=err.waited_s,
                   stall_detected_s=time.monotonic() - t_start, stall_frontiers=err.frontiers)
    except StallError as err:
        res.update(stalled=True, stall_report=err.report, stall_waited_s=err.waited_s,
                   stall_detected_s=time.monotonic() - t_start, stall_frontiers=err.frontiers)
    except TurnstileError as err:  # peers will stall on us: report and leave now
        res.update(protocol_error=f"{type(err).__name__}: {err}", trace=trace.records)
        ctx.write_result(done + [res])
        os._exit(EXIT_ERROR)
    rs = ctl.results
    res.update(rounds=len(rs), rendezvous=rdv.stats(), d_iterations=d_count[0],
               rendezvous_rounds=sum(r.rendezvous for r in rs),
               d_wait_mean_s=(sum(r.d_wait_s for r in rs if r.d_any) / max(1, sum(r.d_any for r in rs))),
               p_incomplete_acks=sum(r.rendezvous and r.p_incomplete_at_ack for r in rs),
               producer_wait_s=ctl.producer_wait_s,
               trace=trace.records if sc.keep_trace else [])
    wd.update(busy=False, phase="done")
    if res["stalled"]:
        ctx.write_result(done + [res])
        os._exit(EXIT_STALL)
    wd.stop()
    dev.close()
    _store_barrier(ctx.store(f"end/{sc.name}"), sc.world, max(10.0, 3 * sc.watchdog_bound_s))
    return res


def _traced(trace: Trace, wd: Watchdog, meta: dict) -> None:
    if not meta.get("collective"):
        return
    trace.record(epoch=meta.get("epoch"), boundary=meta.get("boundary"), phase=meta.get("phase", "?"),
                 collective=meta["collective"], group=meta.get("group", ()), lane=meta.get("stream", ""),
                 key=meta.get("key"))
    wd.update(last_collective=meta["collective"])


def _wait_queue(q: "queue.Queue[int]", wd: Watchdog, err: list) -> None:
    while True:
        try:
            q.get(timeout=0.05)
            break
        except queue.Empty:
            wd.check()
    if err:
        raise err[0]


def _store_barrier(store, world: int, timeout_s: float) -> None:
    store.add("arrived", 1)
    deadline = time.monotonic() + timeout_s
    while int(store.add("arrived", 0)) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"end-of-scenario barrier: peers missing after {timeout_s}s")
        time.sleep(0.01)
