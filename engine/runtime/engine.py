"""The engine on rank 0: intake, one scheduler per attention replica, and the step loop. One rank
is the world of one: the same loop hands the rank-shared plan to its own worker, or broadcasts it
to every rank and gathers the sampled tokens back.

`step()` = control change → each replica's scheduler plans → one StepPlan (rows with tokens and
block tables, the control, new requests and drops) → every rank executes it (runtime/worker.py) →
the replica leaders' tokens go back to their schedulers → a typed StepRecord. A request goes to the
replica with the fewest unfinished requests and stays there (its KV and prefix blocks live there).
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time

from ..protocol.config import ControlSettings, EngineConfig
from ..protocol.plan import NewRequest, Phase, ReplicaWork, RowSpec, StepPlan, StepReport
from ..protocol.records import StepRecord
from ..scheduler.request import RequestError, RequestOutput, SamplingParams
from ..scheduler.scheduler import Scheduler
from .engine_ops import EngineOps
from .kv_budget import spare_blocks


def _spec_counts(launched) -> dict:
    v, p, a = (sum(x.spec[i] for x in launched if x is not None) for i in range(3))
    return {"spec_verify": v, "spec_proposed": p, "spec_accepted": a}


# prefill warm-up (warm_prefill): step sizes in tokens, odd and aligned, below the budget; row length
WARM_P_TOKENS = (1, 37, 256, 999, 2048, 4099, 8192, 16384)
WARM_ROW = 2048
WARM_CONT_TOKENS = 128   # then one continuation over up to WARM_ROW cached: the paged launch's split walks
SOLO_P_WAIT_BOUND_MS = 200.0   # pd on one CUDA rank: the default TTFT bound (ControlSettings.p_wait_bound_ms)


class Engine(EngineOps):
    def __init__(self, config: EngineConfig, worker=None) -> None:
        """`worker`: this rank's Worker (a multi-rank group's rank 0); None builds a world of one."""
        if worker is None:
            from .worker import Worker
            worker = Worker.single(config)
        self.config, self.worker, self.topo = config, worker, worker.topo
        self.model_config = worker.cfg
        proposers = [None] * self.topo.adp
        spare = spare_blocks(config)
        self.mtps = []   # the MTP proposers, one per replica: fed the target's hidden states (_exchange)
        paged, models = [], []   # model proposers and the models only they hold (memory release)
        if config.speculative == "draft":   # on rank 0, beside the planner: its drafts travel in the plan
            from .draft import DraftProposer
            paged = [DraftProposer(config, worker.device, worker.num_blocks + spare)]
            paged += [DraftProposer(config, worker.device, worker.num_blocks + spare, paged[0].model)
                      for _ in range(self.topo.adp - 1)]   # one draft model shared by the replicas
            models = [paged[0].model]
        elif config.speculative == "mtp":   # on rank 0 too; one head model shared by the replicas' proposers
            from .mtp import MTPProposer, head_model
            head = head_model(config, worker)
            if head is not worker.model:   # weight updates reach rank 0's unsharded copy too
                worker.weights.add_copy(head)
                models = [head]
            self.mtps = paged = [MTPProposer(config, worker, worker.num_blocks + spare, head)
                                 for _ in range(self.topo.adp)]
        self.proposer_memory = None
        if paged:
            from .draft import ProposerMemory
            proposers = paged
            self.proposer_memory = ProposerMemory(paged, models)
        self.schedulers = [Scheduler(config, worker.cfg, worker.num_blocks, p) for p in proposers]
        self.replica_of: dict[str, int] = {}
        self._solo_overlap = worker.solo is not None   # pd on one rank, its P epochs beside D
        self._solo_fuse_tokens = config.solo_fuse_tokens_on(worker.device.type)
        self.control = config.control
        if self._solo_overlap:
            # P epochs beside D's graphs no longer stall D, so a long-waiting P may take the whole
            # budget, and a burst of first turns runs alone as under `normal`: both on unless the
            # config says otherwise (docs/PERF.md, "Defaults")
            c = self.control
            self.control = c.model_copy(update={
                "p_wait_bound_ms": SOLO_P_WAIT_BOUND_MS if c.p_wait_bound_ms is None else c.p_wait_bound_ms,
                "p_burst_first": True if c.p_burst_first is None else c.p_burst_first})
        self._pending_control: ControlSettings | None = None
        self.records: list[StepRecord] = []          # drained by the server's metrics
        self._new: list[NewRequest] = []
        self._announced: set[str] = set()
        self.step_id = 0
        # pd on several ranks: a P epoch that goes on under the next steps' D (pd_step.py): its
        # epoch and, per replica, the launched P rows whose results are still to come
        self._flight: tuple[int, list] | None = None
        self._p_ready = False
        self.ranks = None                            # launcher.RankGroup of a multi-rank group
        self.channel = None                          # several ranks: plans out, reports back
        if self.topo.world > 1:
            from .plan_channel import PlanChannel
            self.channel = worker.channel = PlanChannel(self.topo, 0)
        self.closed = False
        self._init_ops()
        self._first_step()

    # --- requests ---------------------------------------------------------------------------
    def submit(self, rid: str, input_ids: list[int], sampling: SamplingParams,
               return_logprob: bool = False, rollout_id: str | None = None, routes_from: int | None = None,
               priority: int = 0) -> None:
        """`routes_from`: report the routing of positions [routes_from, end) (None: no routing);
        `priority`: admission order, higher first (policy.py)."""
        if isinstance(rid, str) and rid in self.replica_of:
            raise RequestError(f"request id {rid!r} is already running")
        if self.released:
            tags = sorted(self.released)
            raise RequestError(f"the engine's memory is released: tag(s) {', '.join(tags)} still released; POST "
                               f"/resume_memory_occupation {{\"tags\": {json.dumps(tags)}}} (or {{}} for all) first")
        r = min(range(len(self.schedulers)), key=lambda i: (len(self.schedulers[i].reqs), i))
        self.schedulers[r].submit(rid, input_ids, sampling, return_logprob, rollout_id, routes_from, priority)
        self.replica_of[rid] = r
        self._new.append(NewRequest(rid, r, sampling))

    def abort(self, rid: str, message: str = "aborted") -> bool:
        r = self.replica_of.get(rid)
        if r is None or not self.schedulers[r].abort(rid, message):
            return False
        del self.replica_of[rid]   # the rid is free again (a retry may reuse it at once)
        return True

    def abort_all(self) -> int:
        return sum(self.abort(rid) for rid in list(self.replica_of))

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.schedulers)

    @property
    def hold_until(self) -> float | None:
        """When the planner held waiting work back on purpose (p_idle_gather_ms): the
        time (monotonic) to plan again by, unless new work arrives first; None: no hold."""
        holds = [s.hold_until for s in self.schedulers if s.hold_until is not None]
        return min(holds) if holds else None

    def set_control(self, control: ControlSettings) -> None:
        self._pending_control = control       # every replica and rank takes it at the next step

    @property
    def requested_control(self) -> ControlSettings:
        """The settings the next step will run with (a pending change, else the current ones)."""
        return self._pending_control or self.control

    def flush_cache(self, allow_waiting: bool = False) -> bool:
        """Drops cached prefix blocks; False while a request holds KV (or, unless allowed, waits)."""
        if self.holds_kv() or (not allow_waiting and any(s.reqs for s in self.schedulers)):
            return False
        if self.proposer_memory is not None:
            self.proposer_memory.drop_kept()
        return all(s.flush_cache(allow_waiting) for s in self.schedulers)

    # --- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        return self.finish(self.launch())

    def launch(self):
        """Plan and run one step; its results are applied by `finish` (work submitted in between,
        e.g. an abort and a retry under the same rid, meets a launched step: results of an earlier
        lifetime are discarded there)."""
        # a new control waits for an epoch in flight to finish: its rounds run under the old one
        if self._pending_control is not None and self._flight is None:
            self.control, self._pending_control = self._pending_control, None
        if self.released:   # waiting (retracted) requests wait for the resume
            return None
        p_busy = self._flight is not None
        launched = [s.plan_step(self.control, p_busy=p_busy) for s in self.schedulers]
        self.step_id += 1
        if all(x is None for x in launched) and not p_busy:
            return None
        works = tuple(x.work if x else ReplicaWork() for x in launched)
        alive = {rid for s in self.schedulers for rid in s.reqs}
        new = tuple(n for n in self._new if n.rid in alive)
        self._new = []
        drop = tuple(self._announced - alive)
        self._announced = (self._announced | {n.rid for n in new}) & alive
        step = next((x.plan.step for x in launched if x is not None), self.step_id - 1)
        multiplexing = any(x is not None and x.plan.multiplexing for x in launched)
        plan = StepPlan(step, self.control.model_dump(), works, new, drop, multiplexing,
                        p_flight=self._flight[0] if p_busy else None, p_collect=p_busy and self._p_ready)
        plan = dataclasses.replace(plan, p_span=self._spans(plan))
        t0 = time.monotonic()
        mine, reports = self._exchange(plan)
        return plan, launched, reports, mine, t0

    def finish(self, launched=None) -> list[RequestOutput]:
        """Apply a launched step's results (None: nothing ran) and return every ready output."""
        if launched is not None:
            self._apply(*launched)
        outs = [o for s in self.schedulers for o in s.outputs()]
        for o in outs:
            r = self.replica_of.get(o.rid)
            if o.finished and r is not None and o.rid not in self.schedulers[r].reqs:
                del self.replica_of[o.rid]
        return outs

    def _spans(self, plan: StepPlan) -> bool:
        """May this step's P epoch go on under the next steps' D? pd on several ranks (or on one with
        solo_overlap, when its P is past `solo_fuse_tokens`), P and D in the step, no routing replay
        (a P epoch's routes must come back with its own rows)."""
        if not ((self.topo.world > 1 or self._solo_overlap) and self.config.mode == "pd" and plan.p_any
                and plan.d_any and not plan.routes_any):
            return False
        return self.topo.world > 1 or plan.prefill_tokens > self._solo_fuse_tokens

    def _apply(self, plan: StepPlan, launched, reports, mine: StepReport, t0: float) -> None:
        now = time.monotonic()
        lead = lambda r: reports[r * self.topo.atp]   # the replica leader's tokens and routing
        parts = [None] * len(self.schedulers)
        for r, (s, x) in enumerate(zip(self.schedulers, launched)):
            if x is None:
                continue
            if mine.p_pending:   # D's results now, P's when its epoch finishes
                x, parts[r] = x.split()
            s.apply_result(x, lead(r).tokens, now, lead(r).routes)
        if mine.p_done is not None:
            epoch, done = self._flight
            if epoch != mine.p_done:
                raise RuntimeError(f"step {plan.step}: the ranks finished P epoch {mine.p_done}, rank 0 has {epoch}")
            for r, (s, x) in enumerate(zip(self.schedulers, done)):
                if x is not None:
                    s.apply_result(x, lead(r).tokens, now, lead(r).routes)
            self._flight = None
        if mine.p_pending:
            self._flight = (plan.step, parts)
        # ATP1: every rank's P of the epoch is done, the next step collects it (uncrossed.py)
        self._p_ready = self._flight is not None and all(r.p_ready for r in reports)
        compiled = [k for r in reports for k in r.jit_compiles]
        if compiled:   # past warm-up a compile is a stall of this step: say which kernels (jit_watch.py)
            print(f"step {plan.step}: {len(compiled)} Triton compile(s) mid-run ({', '.join(sorted(set(compiled)))}); "
                  f"the step took {now - t0:.3f} s", file=sys.stderr, flush=True)
        self.records.append(StepRecord(
            step=plan.step, t=t0, duration_s=now - t0, mode=self.config.mode, jit_compiles=len(compiled),
            decode_rows=plan.decode_rows, prefill_tokens=plan.prefill_tokens,
            decode_wait_s=tuple(w for x in launched if x for w in x.decode_waits),
            multiplexing_active=mine.multiplexed if self.topo.world > 1 else plan.multiplexing,
            span=max((x.plan.span for x in launched if x), default=1), rendezvous_s=tuple(mine.rendezvous_s),
            turnstile_rounds=mine.rounds, turnstile_wait_s=tuple(mine.turnstile_wait_s), ordering=mine.ordering,
            graph=mine.graph, p_epoch=mine.p_epoch, p_beside=plan.p_flight is not None, **_spec_counts(launched)))

    def _first_step(self) -> None:
        """Step 0: one warm-up row per path and replica, writing only the KV cache's null slot. On
        several ranks it runs every collective once: when it returns, every rank of every node has
        joined and run a step."""
        null = self.worker.num_blocks   # block id of the null slot's block
        row = lambda kind: RowSpec("warmup", kind, 0, (0,), (null,), samples=False)
        work = tuple(ReplicaWork(decode=(row(Phase.DECODE),), prefill=(row(Phase.PREFILL),)) for _ in self.schedulers)
        self._exchange(StepPlan(0, self.control.model_dump(), work, multiplexing=self.config.mode == "pd"))
        warm = self.config.prefill_warmup
        if warm and self.topo.world > 1:
            raise ValueError("prefill_warmup runs on one rank; several ranks warm their GEMM shapes at start "
                             "(runtime/warmup.py): leave it unset")
        if warm or (warm is None and self.topo.world == 1 and self.worker.cuda):
            self.warm_prefill()
        self.step_id = 1
        for s in self.schedulers:
            s.step_id = 1

    def warm_prefill(self, totals: tuple[int, ...] | None = None) -> int:
        """Prefill-only steps of growing size before serving (EngineConfig.prefill_warmup): every
        regime of the prefill kernels runs once — odd and 16-aligned token counts, the MoE path's tile
        tiers and pair layouts (`fused_regime_tokens`), up to the whole budget. Rows are split
        like prompts (≤ WARM_ROW tokens), write only KV blocks no request holds yet, sample nothing;
        on one rank only (several ranks warm their GEMMs in member.py). By default a last step is one
        continuation of WARM_CONT_TOKENS over a cached context (what a fused step carries at P1: few
        tiles, so the attention's walks split along the context). Under `prefill_attention: hybrid` (auto
        in bf16 on CUDA), then every fresh-prompt cuDNN shape up to the budget or SDPA_FRESH_MAX_TOKENS
        (warmup.warm_fresh_attention).
        Returns the steps run."""
        budget = max(self.control.prefill_budget_tokens, self.config.mixed_chunk_tokens)
        continuation = totals is None
        if totals is None:   # a fused step carries up to the budget of P and max_running D rows
            from ..model.backends import fused_regime_tokens
            regimes = fused_regime_tokens(self.worker.cfg.num_experts_per_tok)
            totals = tuple(sorted({t for t in WARM_P_TOKENS if t < budget} | {budget}
                                  | {t for t in regimes if t <= budget + self.config.max_running}))
        bs, free = self.config.block_size, self.worker.num_blocks
        t0, n = time.monotonic(), 0
        steps = []
        for total in totals:
            rows, block = [], 0
            while total > 0:
                length = min(total, WARM_ROW)
                need = -(-length // bs)
                if block + need > free:
                    break                      # a small KV cache: warm what fits
                rows.append(RowSpec("warmup", Phase.PREFILL, 0, (0,) * length,
                                    tuple(range(block, block + need)), samples=False))
                block, total = block + need, total - length
            steps.append(rows)
        if continuation:   # its context is whatever the steps above left in those blocks
            ctx = min(WARM_ROW, free * bs - WARM_CONT_TOKENS)
            if ctx > 0:
                steps.append([RowSpec("warmup", Phase.PREFILL, ctx, (0,) * WARM_CONT_TOKENS,
                                      tuple(range(-(-(ctx + WARM_CONT_TOKENS) // bs))), samples=False)])
        for rows in steps:
            if rows:
                work = tuple(ReplicaWork(prefill=tuple(rows)) for _ in self.schedulers)
                self._exchange(StepPlan(0, self.control.model_dump(), work))
                n += 1
        print(f"prefill warm-up: {n} steps up to {max(totals)} tokens, {time.monotonic() - t0:.2f} s",
              file=sys.stderr, flush=True)
        if self.worker.backends.attention.prefill == "hybrid":   # CUDA; shapes the steps did not run
            from .warmup import warm_fresh_attention
            warm_fresh_attention(self.worker.model, budget, self.worker.device, 0)
        return n

    def drain(self) -> None:
        """Finish a P epoch in flight (before an op or a shutdown): steps with no new rows, whose
        rounds let P run to its end; its results go to the schedulers' outputs."""
        while self._flight is not None:
            works = tuple(ReplicaWork() for _ in self.schedulers)
            plan = StepPlan(self.step_id, self.control.model_dump(), works, p_flight=self._flight[0])
            mine, reports = self._exchange(plan)
            self._apply(plan, [None] * len(self.schedulers), reports, mine, time.monotonic())

    def _exchange(self, plan: StepPlan) -> tuple[StepReport, list[StepReport]]:
        """Every rank executes the plan; returns this rank's report and every rank's."""
        if self.topo.world == 1:
            mine = self.worker.execute(plan)
            reports = [mine]
        else:   # each rank its replica's share, in a binary layout (plan_channel.py)
            self.channel.send(plan)
            mine = self.worker.execute(plan)
            reports = self.channel.gather(mine)
        if self.mtps:   # rank 0 leads replica 0; the other leaders' states came in their reports
            self.mtps[0].add(self.worker.hidden.take())
            for r in reports:
                if r.hidden:
                    self.mtps[self.topo.replica(r.rank)].add(r.hidden)
        return mine, reports

    def shutdown(self) -> None:
        """Stop the other ranks (call from the thread that ran the steps)."""
        if self.closed:
            return
        self.closed = True
        if self.topo.world > 1:
            import torch.distributed as dist
            try:
                self.drain()
            except Exception:   # a failed group: the stop plan below is all that is left to send
                pass
            self.channel.send(StepPlan(self.step_id, self.control.model_dump(), stop=True))
            dist.barrier()
        self.worker.close()

    # --- failure (a multi-rank group) -------------------------------------------------------
    def check(self) -> None:
        """Raises the group's failure (a stall or a lost peer) even while no step runs."""
        self.worker.check()

    def verdict(self, exc: BaseException) -> int:
        """The exit code for a failure of this engine (protocol/exits.py)."""
        return self.worker.verdict(exc)

    def cause(self) -> str | None:
        """The report of the group's failure in its store (another rank's, or a launcher's), if any."""
        return self.worker.wd.cause() if self.worker.wd is not None else None

    def on_exit(self, hook) -> None:
        """`hook(err, code)` runs before a forced exit of this process (the group failed while a
        thread was stuck in a collective)."""
        self.worker.exit_hooks.append(hook)

    # --- introspection ----------------------------------------------------------------------
    def stats(self) -> dict:
        ss = [s.stats() for s in self.schedulers]
        total = sum(s["kv_blocks_total"] for s in ss)
        used = sum(s["kv_blocks_used"] for s in ss)
        out = {"num_running_reqs": sum(s["num_running_reqs"] for s in ss),
               "num_queue_reqs": sum(s["num_queue_reqs"] for s in ss),
               "token_usage": used / total if total else 0.0, "kv_blocks_total": total, "kv_blocks_used": used,
               "kv_blocks_cached": sum(s["kv_blocks_cached"] for s in ss), "step": self.step_id}
        if self.topo.adp > 1:
            out["replica_running_reqs"] = [s["num_running_reqs"] for s in ss]
        return out

    def model_info(self) -> dict:
        c = self.model_config
        return {"model_path": self.model_path, "weight_version": self.weight_version, "vocab_size": c.vocab_size,
                "max_context_len": self.schedulers[0].max_context_len, "eos_token_ids": list(c.eos_token_ids),
                "num_experts": c.num_experts, "num_layers": c.num_hidden_layers,
                "dtype": str(self.worker.dtype).removeprefix("torch."), "device": self.config.device,
                "mode": self.config.mode, "is_generation": True, "nproc": self.topo.world, "adp": self.topo.adp,
                "ep": self.topo.ep, "atp": self.topo.atp, "backends": self.worker.backends.name,
                "speculative": self.config.speculative,
                "speculative_k": self.config.speculative_k if self.config.speculative else 0,
                # block-FP8 weights (the checkpoint's quantization_config), else the activations' dtype
                "weights": f"fp8-e4m3-{c.fp8_block[0]}x{c.fp8_block[1]}" if c.fp8_block else
                           str(self.worker.dtype).removeprefix("torch.")}
