"""One rank: its shard of the model, its KV cache (shared by P and D), its attention and expert
backends, and the execution of a StepPlan. One rank is the world of one: the same worker runs a
single-GPU engine and every rank of a group.

Per step: decode-only steps replay D's CUDA graph where there is one (every world size; on several
ranks the graph holds D's collectives); otherwise one forward of the replica's rows (P and D fused
on one rank, and under the normal/mixed policies), or, under pd on several ranks, P on its thread and
D through the turnstile (pd_step.py); on one rank with `solo_overlap`, P on its thread beside the
next steps' D (solo_p.py). Replica leaders (local index 0) sample.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch

from ..model.backends import make_backends
from ..model.checkpoint import random_model
from ..model.kv_cache import KVCache
from ..model.loader import load_model, resolve_dtype
from ..protocol.config import ControlSettings, EngineConfig, ModelConfig
from ..protocol.plan import Phase, RowSpec, StepPlan, StepReport
from ..protocol.topology import Topology
from .batch import BatchBuilder, forward_order
from .jit_watch import compile_watch
from .kv_sizing import settle, start_blocks
from .mtp import HiddenStates
from .options import RankOptions, options_from_args
from .shard import shard_of
from .sampler import accept_greedy, make_generator, request_seed, sample, verify
from .steplog import StepLog


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """cpu, or cuda[:N] on one rank; on several, cuda:<local rank> (LOCAL_RANK under torchrun, else
    rank modulo the visible GPUs)."""
    dev = torch.device(config.device)
    if dev.type != "cuda":
        return torch.device("cpu")
    if dev.index is not None and rank == 0 and "LOCAL_RANK" not in os.environ:
        return dev
    local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
    return torch.device("cuda", local)


class Worker:
    def __init__(self, config: EngineConfig, topo: Topology, rank: int, store=None,
                 options: RankOptions | None = None, counters=None) -> None:
        self.config, self.topo, self.rank = config, topo, rank
        self.opt = options = options or RankOptions()
        self.multi = topo.world > 1
        self.counters = counters           # node.RankCounters: this node's view of its ranks' steps
        self.exit_hooks: list = []         # run before a forced exit (rank 0: answer in-flight requests)
        self.wd = self.group = None
        if self.multi:   # the watchdog first: heartbeats from here on (a rank that dies loading is lost)
            from .member import GroupMember
            self.group = GroupMember(self, store)
            self.wd = self.group.wd
        self.cfg = ModelConfig.load(config.model)
        self.replica, self.leader = topo.replica(rank), topo.local_index(rank) == 0
        self.device = rank_device(config, rank)
        self.cuda = self.device.type == "cuda"
        self.compiles = compile_watch(self.cuda)   # Triton compiles per step (the interpreter compiles none)
        if self.cuda:   # before any CUDA or NCCL work of this process (the current device is per thread)
            torch.cuda.set_device(self.device)
            # SDPA's cuDNN backend builds a plan per new (q_len, ctx_len): a burst of new lengths
            # spent most of its time building plans (docs/PERF.md). Flash / memory-efficient
            # attention need no per-shape plan.
            torch.backends.cuda.enable_cudnn_sdp(False)
        # random weights stand for a benchmark shape: bf16 unless told otherwise
        dtype = torch.bfloat16 if config.random_weights and config.dtype == "auto" else \
            resolve_dtype(config.dtype, self.cfg)
        self.backends = make_backends(self.device, dtype, config)
        shard = shard_of(topo, rank)
        # --speculative mtp: replica leaders keep their rows' final hidden states for the proposer on
        # rank 0 (self.hidden; the other ranks of an ATP group hold the same ones). One rank's D
        # graphs output them too; on several ranks D runs eagerly (their graphs' collectives are
        # sized for one token per row, and only leaders keep hidden states).
        # One rank loads the head into its model; on several rank 0 loads an unsharded copy (mtp.py).
        mtp = config.speculative == "mtp"
        self.keep_hidden, self.eager_d = mtp and self.leader, mtp and self.multi
        if config.random_weights:   # a benchmark shape with no checkpoint on disk (config.json only)
            self.model = random_model(self.cfg, self.device, dtype, config.seed, shard=shard, backends=self.backends,
                                      mtp=mtp and not self.multi)
        else:
            self.model = load_model(config.model, device=self.device, dtype=dtype, shard=shard,
                                    backends=self.backends, mtp=mtp and not self.multi)
        self.dtype = next(self.model.parameters()).dtype
        self.num_blocks, sized = start_blocks(config, self.cfg, topo, self.dtype, self.device.type, self.multi)
        kv_heads = self.model.model.layers[0].self_attn.kv_heads
        self.kv = KVCache(self.cfg.num_hidden_layers, self.num_blocks, config.block_size, kv_heads,
                          self.cfg.head_dim, self.dtype, self.device)
        self.batches = BatchBuilder(config.block_size, self.device, self.backends.attention.needs_block_tables)
        self.control = config.control
        self.gens: dict[str, torch.Generator] = {}
        self._routes: dict[str, bytes] = {}
        self.hidden = HiddenStates()          # the rows' final hidden states (keep_hidden; mtp.py)
        self.sampling: dict[str, object] = {}
        self.streams: dict = {}
        self.d_end = None   # CUDA: an event after a D that returned before its kernels ended
        self.graphs = None
        self.pd = self.channel = None   # several ranks: the pd step; the plan channel (for the step log)
        self._log = StepLog(options.step_log, rank) if options.step_log else None
        self._capture_forward = None
        self.p_graphs = None   # piecewise graphs of forwards that carry P (one rank)
        if self.multi:
            self.group.build()     # collectives, expert comm, streams, turnstile; warm-ups; D graphs
        elif self.cuda and config.cuda_graphs:
            self._capture(lambda batch, b: self.model(batch, self.kv))
        p_tokens = config.prefill_graph_tokens_on(self.device.type, self.multi and not self.group.p_pieces)
        if p_tokens:
            from .prefill_graphs import PrefillGraphs
            self.p_graphs = PrefillGraphs(self.model, self.kv, p_tokens, graphs=self.cuda,
                                          collectives=self.group.col if self.multi else None, replicas=topo.adp)
            self.p_graphs.capture()
        self.kv_sizing = settle(self, sized)   # the probe's cache measured and resized (kv_sizing.py), logged
        self.solo = None   # pd on one rank with solo_overlap: a P epoch beside the next steps' D
        if not self.multi and config.mode == "pd" and config.solo_overlap_on(self.device.type):
            from .solo_p import SoloEpochs
            self.solo = SoloEpochs(self, config)   # on CUDA: P's and D's streams
        from .weight_sync import RankWeights
        self.weights = RankWeights(self)   # the rank-shared ops: new weights, memory release/resume
        self.compiles.take()   # the start's compiles (graph captures) are not a step's

    @classmethod
    def single(cls, config: EngineConfig) -> "Worker":
        """The world of one."""
        return cls(config, Topology(1), 0)

    def _capture(self, forward) -> None:
        from .graphs import DecodeGraphs
        self._capture_forward = forward
        max_ctx = min(self.cfg.max_position_embeddings, self.config.max_context_len or 1 << 62)
        rows = self.config.max_running
        if self.config.speculative and not self.multi:   # verify steps replay too: k + 1 tokens a row
            rows *= 1 + self.config.speculative_k
        self.graphs = DecodeGraphs(forward, self.device, self.config.block_size, rows,
                                   -(-max_ctx // self.config.block_size), self.kv.null_slot,
                                   keep_hidden=self.keep_hidden)
        # On a stream of the graphs' own: the watchdog's thread queries the worker's streams, and a
        # query of a stream under capture invalidates the capture.
        self.graphs.capture()

    def recapture(self) -> None:
        """D's and P's graphs again, after a memory resume moved the tensors they read."""
        if self._capture_forward is not None:
            self._capture(self._capture_forward)
        if self.p_graphs is not None:
            self.p_graphs.capture()

    # ---- one step ----------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepReport:
        if plan.ops:   # between steps, on every rank at the same plan boundary
            report = StepReport(self.rank, plan.step)
            if self.multi:   # a group may wait for its trainer: not a stall of this engine
                self.wd.update(busy=False, phase="op:" + plan.ops[0].kind)
            report.ops = [self.weights.run(op) for op in plan.ops]
            return report
        t_start = time.monotonic()
        for nr in plan.new:
            if nr.replica == self.replica:
                seed = request_seed(self.config.seed, nr.rid)
                self.gens[nr.rid], self.sampling[nr.rid] = make_generator(nr.sampling, seed, self.device), nr.sampling
        for rid in plan.drop:
            self.gens.pop(rid, None)
            self.sampling.pop(rid, None)
        control = ControlSettings.model_validate(plan.control) if plan.control else self.control
        if control != self.control:
            if self.multi:
                self.group.ctl.set_control(ordering=control.ordering, span=control.span,
                                           activation=control.activation)
            self.control = control
        mine = plan.replicas[self.replica]
        report = StepReport(self.rank, plan.step)
        if self.multi:
            self.wd.update(busy=True, phase="step", epoch=plan.step)
            mark = self.group.mark()
        p_rows = list(mine.prefill)
        if self.multi and self.config.mode == "pd":
            logits_d, logits_p, report.graph, p_plan = self.pd.run(plan)
            report.p_pending = self.pd.flight is not None and self.pd.flight[1] == plan.step
            report.p_ready = self.pd.p_ready
            if plan.p_flight is not None and logits_p is not None:   # an earlier step's epoch finished
                report.p_done = plan.p_flight
                p_rows = list(p_plan.replicas[self.replica].prefill)
        elif self.solo is not None and (plan.p_span or plan.p_flight is not None):
            logits_d, logits_p, report.graph, p_plan = self.solo.run(plan)
            report.p_pending = self.solo.flight is not None and self.solo.flight[0].step == plan.step
            report.p_epoch = self.solo.finished
            if logits_p is not None and p_plan.step != plan.step:   # an earlier step's epoch finished
                report.p_done = plan.p_flight
                p_rows = list(p_plan.replicas[self.replica].prefill)
        elif not plan.p_any:
            (logits_d, report.graph), logits_p = self.forward_d(plan), None
        else:   # one forward of everything: P and D fused (one rank), or the normal/mixed policies
            phase = Phase.MIXED if plan.d_any else Phase.PREFILL
            logits_d, logits_p = None, self.forward(phase, plan, "both")
        if self.multi:
            self.group.report(report, mark)
        if self.leader:
            if logits_p is not None:
                rows = p_rows if logits_d is not None or report.p_done is not None \
                    else list(mine.decode) + list(mine.prefill)
                self._sample(rows, logits_p, report)
            if logits_d is not None:
                self._sample(list(mine.decode), logits_d, report)
        if self._routes:
            report.routes, self._routes = self._routes, {}
        if self.keep_hidden and self.rank != 0:   # rank 0's engine takes its own (on the device)
            report.hidden = self.hidden.take(host=True)
        if self.multi:
            self.wd.update(busy=False, phase="idle")
        report.jit_compiles = self.compiles.take()
        if self.counters is not None:
            self.counters.add(self.rank, steps=1, rounds=report.rounds, rendezvous=len(report.rendezvous_s),
                              rendezvous_s=sum(report.rendezvous_s), decode_rows=mine.decode_rows,
                              prefill_tokens=mine.prefill_tokens)
        if self._log:
            fields = {**(self.group.log_fields(mark) if self.multi else {}), **(self.channel.log_fields() if self.channel else {})}
            self._log.step(plan, report, mine, time.monotonic() - t_start,
                           self.p_graphs.replays if self.p_graphs is not None else None, fields)
        return report

    # ---- forwards ------------------------------------------------------------------------
    def forward(self, phase: Phase, plan: StepPlan, parts: str, boundary=None, wait: bool = True) -> torch.Tensor:
        """One eager forward of this replica's "decode", "prefill" or "both" rows; logits of sampling rows."""
        own = plan.replicas[self.replica]
        mine = own.decode if parts == "decode" else own.prefill if parts == "prefill" else own.decode + own.prefill
        shared = None   # several ranks: the largest replica's rows when P's pieces may take them
        if self.multi:   # every replica's tokens: rank-shared counts (other replicas are shapes here)
            counts = [w.decode_tokens * (parts != "prefill") + w.prefill_tokens * (parts != "decode") for w in plan.replicas]
            self.group.begin(phase.path, plan.step, counts, boundary)
            if not plan.routes_any and (boundary is None or not self.cuda):   # rank-shared facts only
                shared = max(counts)
        if not self.cuda:
            batch = self.batches.build(mine, phase)
            self._want_routes(batch, mine)
            logits = self._model(phase, batch, shared)
            self._keep_routes(phase, batch, mine)
            self.hidden.keep(batch, mine)
            return logits
        torch.cuda.set_device(self.device)    # a P thread's device is its own
        s = self.streams.get(phase.path) or torch.cuda.current_stream()
        with torch.cuda.stream(s):
            batch = self.batches.build(mine, phase)
            self._want_routes(batch, mine)
            with self.group.span("forward", s, phase.path, plan.step) if self.multi else contextlib.nullcontext():
                logits = self._model(phase, batch, shared)
        if wait or batch.routes is not None:   # the routes' host copy below runs on another stream
            s.synchronize()                   # eager: the step's logits are complete for sampling
        self._keep_routes(phase, batch, mine)
        self.hidden.keep(batch, mine)
        return logits

    def _model(self, phase: Phase, batch, shared: int | None) -> torch.Tensor:
        """A forward that carries P replays P's pieces when they hold it (prefill_graphs.py); on
        several ranks every rank decides alike, from the rank-shared `shared` rows (None: eager)."""
        pg = self.p_graphs
        if phase is not Phase.DECODE and pg is not None and (shared is not None or not self.multi) \
                and pg.fits(batch, shared):
            return pg.forward(batch, shared)
        return self.model(batch, self.kv)

    # ---- routing replay (return_routed_experts) ------------------------------------------
    def _want_routes(self, batch, rows) -> None:
        if self.leader and any(r.routes for r in rows):
            batch.routes = []
        batch.want_hidden = self.keep_hidden and bool(rows)

    def _keep_routes(self, phase: Phase, batch, rows) -> None:
        """Each routed row's input tokens' top-k expert ids per layer (-1 on dense layers), as
        int32 bytes [tokens, layers, top-k], in the batch builder's row order."""
        if batch.routes is None:
            return
        cfg = self.cfg
        moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        t = batch.input_ids.shape[0]
        full = torch.full((t, cfg.num_hidden_layers, cfg.num_experts_per_tok), -1, dtype=torch.int32)
        if moe:
            full[:, moe] = torch.stack([ids.to("cpu", torch.int32) for ids in batch.routes], dim=1)
        ordered = forward_order(rows)
        t0 = 0
        for r in ordered:
            if r.routes:
                self._routes[r.rid] = full[t0:t0 + r.length].numpy().tobytes()
            t0 += r.length

    def forward_d(self, plan: StepPlan, wait: bool = True) -> tuple[torch.Tensor, bool]:
        """The D iteration: a graph replay for the rank-shared bucket when one is captured (every
        rank replays it, rows or not: its collectives need every rank), else an eager forward."""
        n = max(w.decode_rows for w in plan.replicas)
        if plan.spec_any:   # a graph row is a token: verify rows take k + 1 (graphs.py)
            n = max(w.decode_tokens for w in plan.replicas)
        # A graph keeps no routing ids. On several ranks the graphs' collectives are sized for one
        # token per row, so verify steps run eagerly there.
        if self.graphs is None or not self.graphs.fits(n) or plan.routes_any or self.eager_d \
                or (plan.spec_any and self.multi):
            logits, graph = self.forward(Phase.DECODE, plan, "decode", wait=wait), False
        else:
            s, graph = self.streams.get("d") or torch.cuda.current_stream(), True
            rows = list(plan.replicas[self.replica].decode)
            with torch.cuda.stream(s):
                with self.group.span("forward", s, "d", plan.step) if self.multi else contextlib.nullcontext(), \
                        self._log.timed_d(s) if self._log else contextlib.nullcontext():   # the log's d_gpu_s
                    logits = self.graphs.replay(rows, self.graphs.bucket(n))
                if self.keep_hidden and rows:   # a copy: the next replay overwrites the graph's output
                    self.hidden.keep_rows(self.graphs.last_hidden.clone(), rows)
            if wait:
                s.synchronize()
        if not wait and self.cuda:   # D's end, waited on alone (pd_step.d_done), not the whole stream
            self.d_end = (self.streams.get("d") or torch.cuda.current_stream()).record_event()
        return logits, graph

    def _sample(self, rows: list[RowSpec], logits: torch.Tensor | None, report: StepReport) -> None:
        rows = forward_order([r for r in rows if r.samples])   # the logits' order (batch.py)
        if not rows:
            return
        if any(r.draft for r in rows):
            logits = self._verify(rows, logits, report)
            rows = [r for r in rows if not r.draft]
            if not rows:
                return
        live = [i for i, r in enumerate(rows) if r.rid in self.gens]
        if len(live) < len(rows):   # aborted while its P epoch was in flight (plan.drop): no token
            logits, rows = logits[live], [rows[i] for i in live]
            if not rows:
                return
        want = any(r.logprob for r in rows)
        toks, lps = sample(logits, [self.sampling[r.rid] for r in rows], [self.gens[r.rid] for r in rows], want)
        for i, r in enumerate(rows):
            report.tokens[r.rid] = (toks[i], lps[i] if lps is not None else None)

    def _verify(self, rows: list[RowSpec], logits: torch.Tensor, report: StepReport) -> torch.Tensor:
        """Verify rows' results into the report; returns the logits of the other rows (in order)."""
        keep, i = [], 0
        # greedy rows' argmax for every position at once: one device-to-host copy, not one per row
        greedy = any(r.draft and self.sampling[r.rid].greedy for r in rows)
        argmax = torch.argmax(logits, dim=-1).tolist() if greedy else None
        for r in rows:
            n = r.logit_rows
            if not r.draft:
                keep.append(i)
                i += 1
                continue
            part = logits[i:i + n]
            p, drafts = self.sampling[r.rid], list(r.tokens[1:])
            toks = accept_greedy(argmax[i:i + n], drafts) if p.greedy else verify(part, drafts, p, self.gens[r.rid])
            lps = None
            if r.logprob:   # of the unscaled distribution at each emitted position
                lp = torch.log_softmax(part[:len(toks)].float(), dim=-1)
                lps = tuple(lp[torch.arange(len(toks)), torch.tensor(toks)].tolist())
            report.tokens[r.rid] = (tuple(toks), lps)
            i += n
        return logits[keep]

    # ---- a group's failure ---------------------------------------------------------------
    def check(self) -> None:
        if self.wd is not None:
            self.wd.check()

    def verdict(self, exc: BaseException) -> int:
        from ..protocol.exits import exit_code
        return self.wd.verdict(exc) if self.wd is not None else exit_code(exc)

    def exit_now(self, err: BaseException) -> None:
        """The group failed and a thread may be stuck inside a collective: leave with the verdict,
        after the exit hooks had their say."""
        from ..protocol.exits import EXIT_STALL, last_words, lost_report, say
        code = self.verdict(err)
        if self.wd is not None:   # tell the group the cause first, so every rank exits with its code
            from .watchdog import report_lost
            if code != EXIT_STALL:
                report_lost(self.wd.store, self.rank, lost_report(self.rank, code, err), code)
        for hook in self.exit_hooks:
            try:
                hook(err, code)
            except Exception as e:
                say(f"[rank {self.rank}] exit hook failed: {e!r}")
        # one line per rank that says how it ended (a rank orphaned by its launcher has no one else to
        # say it); last, after the hooks ended this node's other ranks, so a log's tail is the verdict
        say(last_words(self.rank, code, err))
        os._exit(code)

    def side(self, rank: int) -> int:
        """A rank's side in the crossed diagnostic: its replica; with one replica (ATP only) its
        local index, so the two sides still meet in the ATP group's and the model-wide collectives."""
        return self.topo.replica(rank) if self.topo.adp > 1 else self.topo.local_index(rank)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        if self._log:
            self._log.close()


def worker_loop(worker: Worker) -> int:
    """Ranks other than 0: execute rank 0's plans until the stop plan."""
    import torch.distributed as dist
    import traceback
    from .plan_channel import PlanChannel
    channel = worker.channel = PlanChannel(worker.topo, worker.rank)
    while True:
        plan = channel.recv()
        if plan.stop:
            worker.close()
            dist.barrier()   # rank 0's stop plan has reached every rank before anyone leaves
            return 0
        try:
            report = worker.execute(plan)
        except BaseException as e:
            traceback.print_exc()
            worker.exit_now(e)
        channel.report(report)


def single_worker(a, cfg, layout):
    """The world of one, with the rank options the flags give (e.g. --step-log)."""
    return Worker(cfg, Topology(1), 0, options=options_from_args(a, layout))
