"""Rank 0's engine on several ranks: intake, one planner per attention replica, and the step
loop that broadcasts one StepPlan to every rank and gathers the sampled tokens back.

It has the single-rank Engine's API (submit/abort/step/finish/set_control/stats/events), so
`generate` and the HTTP server drive it unchanged. Requests go to the least-loaded replica at
submission and stay there (DP attention: replica r holds its requests' KV).
"""
from __future__ import annotations

import time

import torch.distributed as dist

from ..config import ControlSettings, EngineConfig, ModelConfig
from ..engine import Engine
from ..request import RequestError, RequestOutput, SamplingParams
from ..runner import Row, StepResult
from .step_plan import NewRequest, ReplicaWork, RowSpec, StepPlan, StepReport
from .worker import Worker


class ReplicaEngine(Engine):
    """Request and KV-block bookkeeping of one attention replica: no model, no tensors."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, num_blocks: int, dtype) -> None:
        self.config, self.model_config, self.dtype = config, model_config, dtype
        self._init_state(num_blocks)


class MultiRankEngine:
    def __init__(self, config: EngineConfig, worker: Worker) -> None:
        self.config, self.worker, self.topo = config, worker, worker.topo
        self.model_config = worker.cfg
        self.replicas = [ReplicaEngine(config, worker.cfg, worker.num_blocks, worker.dtype)
                         for _ in range(self.topo.adp)]
        self.replica_of: dict[str, int] = {}
        self.control = config.control
        self._pending_control: ControlSettings | None = None
        self.events: list[dict] = []
        self._new: list[NewRequest] = []
        self._announced: set[str] = set()
        self.step_id = 0
        self.closed = False
        self._first_step()

    # --- requests ---------------------------------------------------------------------------
    def submit(self, rid: str, input_ids: list[int], sampling: SamplingParams,
               return_logprob: bool = False, rollout_id: str | None = None) -> None:
        if isinstance(rid, str) and rid in self.replica_of:
            raise RequestError(f"request id {rid!r} is already running")
        r = min(range(len(self.replicas)), key=lambda i: (len(self.replicas[i].reqs), i))
        self.replicas[r].submit(rid, input_ids, sampling, return_logprob, rollout_id)
        self.replica_of[rid] = r
        self._new.append(NewRequest(rid, r, sampling))

    def abort(self, rid: str, message: str = "aborted") -> bool:
        r = self.replica_of.get(rid)
        return r is not None and self.replicas[r].abort(rid, message)

    def abort_all(self) -> int:
        return sum(rep.abort_all() for rep in self.replicas)

    def has_unfinished(self) -> bool:
        return any(rep.has_unfinished() for rep in self.replicas)

    def set_control(self, control: ControlSettings) -> None:
        self._pending_control = control       # every replica and rank takes it at the next step

    @property
    def requested_control(self) -> ControlSettings:
        """The settings the next step will run with (a pending change, else the current ones)."""
        return self._pending_control or self.control

    def flush_cache(self) -> bool:
        if any(rep.reqs for rep in self.replicas):
            return False
        return all(rep.flush_cache() for rep in self.replicas)

    def check(self) -> None:
        """Raises the group's failure (a stall or a lost peer) even while no step runs."""
        self.worker.wd.check()

    def verdict(self, exc: BaseException) -> int:
        """The exit code for a failure of this group (distributed/exits.py)."""
        return self.worker.wd.verdict(exc)

    def on_exit(self, hook) -> None:
        """`hook(err, code)` runs before a forced exit of this process (the group failed while a
        thread was stuck in a collective)."""
        self.worker.exit_hooks.append(hook)

    # --- the loop ---------------------------------------------------------------------------
    def _first_step(self) -> None:
        """Step 0: one warm-up row per path and replica through every collective, writing only the
        KV cache's null slot. Once it returns, every rank of every node has joined and run a step."""
        null = self.worker.num_blocks   # block id of the null slot's block
        row = lambda kind: RowSpec("warmup", kind, 0, (0,), (null,), samples=False)
        work = tuple(ReplicaWork(decode=(row("decode"),), prefill=(row("prefill"),)) for _ in self.replicas)
        self._exchange(StepPlan(0, self.control.model_dump(), work, multiplexing=self.config.mode == "pd"))
        self.step_id = 1
        for rep in self.replicas:
            rep.step_id = 1

    def _exchange(self, plan: StepPlan) -> tuple[StepReport, list[StepReport]]:
        """Broadcast one plan, run this rank's part, gather every rank's report."""
        dist.broadcast_object_list([plan], src=0)
        mine = self.worker.execute(plan)
        reports: list[StepReport] = [None] * self.topo.world
        dist.gather_object(mine, reports, dst=0)
        return mine, reports

    def step(self) -> list[RequestOutput]:
        if self._pending_control is not None:
            self.control, self._pending_control = self._pending_control, None
            for rep in self.replicas:
                rep.set_control(self.control)
        planned = [rep.plan_step() for rep in self.replicas]
        self.step_id += 1
        if any(p is not None for p in planned):
            self._run(planned)
        outs = [o for rep in self.replicas for o in rep.finish(None)]
        for o in outs:
            if o.finished:
                self.replica_of.pop(o.rid, None)
        return outs

    def finish(self, launched=None) -> list[RequestOutput]:
        """Outputs that are ready without a step (aborts while paused)."""
        outs = [o for rep in self.replicas for o in rep.finish(None)]
        for o in outs:
            if o.finished:
                self.replica_of.pop(o.rid, None)
        return outs

    def _run(self, planned) -> None:
        plans = [p[0] if p else None for p in planned]
        works = [self._work(rep, p) for rep, p in zip(self.replicas, plans)]
        alive = {rid for rep in self.replicas for rid in rep.reqs}
        new = tuple(n for n in self._new if n.rid in alive)
        self._new = []
        drop = tuple(self._announced - alive)
        self._announced = (self._announced | {n.rid for n in new}) & alive
        step = next(p.step for p in plans if p is not None)
        plan = StepPlan(step, self.control.model_dump(), tuple(works), new, drop,
                        any(p is not None and p.multiplexing for p in plans))
        t0 = time.monotonic()
        mine, reports = self._exchange(plan)
        now = time.monotonic()
        for r, (rep, p) in enumerate(zip(self.replicas, plans)):
            if p is None:
                continue
            leader = reports[r * self.topo.atp]
            rows = [Row(rep.reqs[rid], rep.reqs[rid].reservation, rep.reqs[rid].lifetime, "decode", 1, True)
                    for rid in p.decode]
            rows += [Row(rep.reqs[s.rid], rep.reqs[s.rid].reservation, rep.reqs[s.rid].lifetime, "prefill",
                         s.length, s.completes) for s in p.prefill]
            tokens, lps = {}, {}
            for i, row in enumerate(rows):
                if row.samples:
                    tokens[i], lp = leader.tokens[row.req.rid]
                    if lp is not None:
                        lps[i] = lp
            rep.apply_result(StepResult(rows, tokens, lps), now)
        waits = [w for pl in planned if pl for w in pl[2]]
        self.events.append({
            "step": step, "t": t0, "duration_s": now - t0, "mode": self.config.mode,
            "decode_rows": sum(w.decode_rows for w in works),
            "prefill_tokens": sum(w.prefill_tokens for w in works), "decode_wait_s": waits,
            "multiplexing_active": mine.multiplexed, "span": max((p.span for p in plans if p), default=1),
            "rendezvous_s": mine.rendezvous_s, "turnstile_rounds": mine.rounds, "ordering": mine.ordering})

    @staticmethod
    def _work(rep: ReplicaEngine, plan) -> ReplicaWork:
        if plan is None:
            return ReplicaWork()

        def spec(rid, kind, start, n, samples):
            r = rep.reqs[rid]
            return RowSpec(rid, kind, start, tuple(r.tokens[start:start + n]), tuple(r.reservation.blocks),
                           samples, r.return_logprob)
        decode = tuple(spec(rid, "decode", len(rep.reqs[rid].tokens) - 1, 1, True) for rid in plan.decode)
        prefill = tuple(spec(s.rid, "prefill", s.start, s.length, s.completes) for s in plan.prefill)
        return ReplicaWork(decode, prefill)

    def shutdown(self) -> None:
        """Stop the worker ranks (rank 0 only; call from the thread that ran the steps)."""
        if self.closed:
            return
        self.closed = True
        dist.broadcast_object_list([StepPlan(self.step_id, self.control.model_dump(), stop=True)], src=0)
        dist.barrier()
        self.worker.close()

    # --- introspection ----------------------------------------------------------------------
    def stats(self) -> dict:
        ss = [rep.stats() for rep in self.replicas]
        total = sum(s["kv_blocks_total"] for s in ss)
        used = sum(s["kv_blocks_used"] for s in ss)
        return {"num_running_reqs": sum(s["num_running_reqs"] for s in ss),
                "num_queue_reqs": sum(s["num_queue_reqs"] for s in ss),
                "token_usage": used / total if total else 0.0, "kv_blocks_total": total, "kv_blocks_used": used,
                "kv_blocks_cached": sum(s["kv_blocks_cached"] for s in ss), "step": self.step_id,
                "replica_running_reqs": [s["num_running_reqs"] for s in ss]}

    def model_info(self) -> dict:
        info = self.replicas[0].model_info()
        info.update(nproc=self.topo.world, adp=self.topo.adp, ep=self.topo.ep, atp=self.topo.atp)
        return info
