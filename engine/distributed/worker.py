"""One rank of the multi-rank engine: its shard of the model, its KV cache (one per rank, shared
by P and D), the device model, the turnstile controller, and the execution of a StepPlan.

Every rank executes the same plan. Modes `normal` and `mixed` run P and D in one forward (P path,
no turnstile). Mode `pd` runs the P segment on the P thread as epoch = step, stopping at each MoE
layer's safe boundary, while the foreground runs the D iteration through `ctl.round` (the
ordering, span and activation are the plan's control, so a change lands at the same step on
every rank). Replica leaders (local index 0) sample; rank 0 gathers the tokens.
"""
from __future__ import annotations

import json
import os
import queue
import random
import shutil
import subprocess
import sys
import threading
import time
import traceback
import zlib
from dataclasses import dataclass

import torch

from ..checkpoint import random_model
from ..config import ControlSettings, EngineConfig, ModelConfig
from ..kv_cache import KVCache
from ..loader import load_model
from ..model import ForwardBatch, SeqSlice, Shard
from ..sampling import make_generator, sample
from .collectives import PathContext, RankCollectives, make_groups, nccl_options
from .controller import TurnstileController
from .device import CpuDevice
from .expert_comm import make_expert_comm
from .gpu_timeline import GpuTimeline
from .launch import EXIT_ERROR, EXIT_STALL
from .rendezvous import Rendezvous
from .step_plan import ReplicaWork, RowSpec, StepPlan, StepReport
from .topology import Topology
from .turnstile import END, Ordering
from .watchdog import Watchdog

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RankOptions:
    """Per-run knobs of the multi-rank engine that are not EngineConfig fields."""
    slots: int = 2                  # device execution slots per rank (1 = full SM residency)
    watchdog_bound_s: float = 30.0
    step_log: str | None = None     # directory for per-rank step logs (JSONL)
    cross_isolation: bool = False   # isolation-only diagnostic: odd sides enqueue P before D (Worker.side)
    expert_backend: str = "torch"   # torch | deep_ep (deep_ep: device cuda, deep_ep importable)
    # Issue 8's knobs (CUDA only): the device condition under which crossed orders stall.
    sm_partition: int = 0           # P and D streams share one green-context partition of this many SMs
    nccl_ctas: int = 0              # min = max CTAs of the registered pair's (and ATP's) NCCL kernels
    skew_ms: float = 0.0            # a seeded random 0..skew_ms delay before each D enqueue (rank skew)
    gpu_timeline: str | None = None  # directory for per-rank GPU timelines (gpu_timeline.py)
    d_async: bool = False           # CUDA pd: do not wait for D's kernels before the round's ACK


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """cpu, or cuda:<local rank> (LOCAL_RANK under torchrun, else rank modulo the visible GPUs)."""
    if torch.device(config.device).type != "cuda":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
    return torch.device("cuda", local)


def shard_of(topo: Topology, rank: int) -> Shard:
    # ETP>1 replicates each expert shard over its ETP group (no expert tensor parallelism).
    return Shard(topo.local_index(rank), topo.atp, rank // topo.etp, topo.ep)


def gemm_shapes(model: torch.nn.Module) -> list[tuple[int, int, torch.dtype, bool]]:
    """The distinct (N, K, dtype, expert) of every matrix a forward multiplies by: 2-D weights
    (not embeddings, which are looked up) and each expert's slice of the 3-D expert weights."""
    looked_up = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    out: dict[tuple, None] = {}
    for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.dim() >= 2 and id(p) not in looked_up:
            out[(int(p.shape[-2]), int(p.shape[-1]), p.dtype, p.dim() == 3)] = None
    return list(out)


def warm_rows(m_max: int) -> list[int]:
    """The M values a GEMM warm-up runs: every M to 1024, every 8th to 8192, every 64th beyond
    (cuBLASLt's choice changes at thresholds; dense where batches are common, bounded in cost)."""
    return [m for m in range(1, m_max + 1)
            if m <= 1024 or (m <= 8192 and m % 8 == 0) or m % 64 == 0 or m == m_max]


def warm_gemms(model: torch.nn.Module, rows: int, expert_rows: int, device: torch.device) -> int:
    """x @ W.T for every GEMM shape of `model` and every M of `warm_rows` up to the rows that
    weight can see (`rows` for a forward's own tokens, `expert_rows` for an expert, which gets
    rows from every EP peer); returns the GEMM count."""
    n = 0
    for out_dim, k, dtype, expert in gemm_shapes(model):
        m_max = expert_rows if expert else rows
        w = torch.zeros(out_dim, k, dtype=dtype, device=device)
        x = torch.zeros(m_max, k, dtype=dtype, device=device)
        for m in warm_rows(m_max):
            torch.nn.functional.linear(x[:m], w)
            n += 1
    return n


def warm_slot_experts(layer, slots: int, device: torch.device) -> int:
    """D's grouped expert GEMMs (`RankCollectives._slot_experts`) for every row count of
    `warm_rows(slots)`, rows spread over the local experts; returns the call count."""
    e_local = layer.experts.gate_up_proj.shape[0]
    h = layer.experts.gate_up_proj.shape[-1]
    x = torch.zeros(slots, h, dtype=layer.experts.gate_up_proj.dtype, device=device)
    ids = torch.arange(slots, device=device) % e_local
    ms = warm_rows(slots)
    for m in ms:
        RankCollectives._slot_experts(layer, x[:m], ids[:m])
    return len(ms)


def kv_blocks(config: EngineConfig, cfg: ModelConfig, topo: Topology, dtype: torch.dtype) -> int:
    """The same block count on every rank: each rank's KV budget over its share of the KV heads."""
    per = KVCache.bytes_per_block(cfg.num_hidden_layers, config.block_size,
                                  cfg.num_key_value_heads // topo.atp, cfg.head_dim, dtype)
    return config.num_blocks or max(config.kv_cache_bytes // per, 1)


class Worker:
    def __init__(self, config: EngineConfig, topo: Topology, rank: int, store, options: RankOptions) -> None:
        self.config, self.topo, self.rank, self.opt = config, topo, rank, options
        self.cfg = ModelConfig.load(config.model)
        self.replica, self.leader = topo.replica(rank), topo.local_index(rank) == 0
        self.device = rank_device(config, rank)
        self.cuda = self.device.type == "cuda"
        if self.cuda:   # before any CUDA or NCCL work of this process (the current device is per thread)
            torch.cuda.set_device(self.device)
        # CUDA: the data collectives (attention reduce/gathers, expert all-to-alls) on NCCL groups;
        # plans, rendezvous and the watchdog stay on gloo (the default group and the store).
        groups = make_groups(topo, rank, backend="nccl" if self.cuda else None, registered_ctas=options.nccl_ctas)
        self.wd = Watchdog(store, rank, topo.world, options.watchdog_bound_s, on_stall_exit=self._stall_exit,
                           on_declare=self._thread_stacks)
        self.dev = CpuDevice(options.slots, on_progress=lambda m: self.wd.progress(),
                             on_enqueue=self._on_enqueue)
        self.wd.extra = self._frontier
        dtype = None if config.dtype == "auto" else _DTYPES[config.dtype]
        shard = shard_of(topo, rank)
        if config.random_weights:   # a benchmark shape with no checkpoint on disk (config.json only)
            self.model = random_model(self.cfg, self.device, dtype or torch.bfloat16, config.seed, shard=shard)
        else:
            self.model = load_model(config.model, device=self.device, dtype=dtype, shard=shard)
        self.dtype = next(self.model.parameters()).dtype
        p_rows = min(max(config.control.prefill_budget_tokens, config.mixed_chunk_tokens) + config.max_running, 4096)
        # the expert all-to-alls' NCCL kernels are pinned like the registered pair's (--nccl-ctas):
        # they cross between P and D too, so the residency a crossed order needs is known
        extra = {"pg_backend": "nccl" if self.cuda else None,
                 "pg_options": nccl_options(options.nccl_ctas) if self.cuda else None}
        if options.expert_backend != "torch":
            extra = {"host_sync": True}   # DeepEP: see DeepEPExpertComm (the GIL-held intranode spin)
        self.comm = comm = make_expert_comm(
            options.expert_backend, ep_ranks=[list(g) for g in topo.ep_groups], rank=rank,
            num_experts=self.cfg.num_experts, hidden=self.cfg.hidden_size, max_tokens=p_rows,
            topk=self.cfg.num_experts_per_tok, dtype=self.dtype, d_max_tokens=config.max_running,
            device=self.device, **extra)
        self.col = RankCollectives(topo, rank, groups, comm, self.dev, self.wd.check, self.cfg.hidden_size,
                                   self.cfg.num_experts_per_tok, p_rows)
        self.col.cuda = self.cuda
        # CUDA: P and D run on their own streams (the P thread's and the foreground's forward)
        self._streams = self._make_streams() if self.cuda else {}
        self.col.streams = self._streams
        self.timeline = None   # created after the warm-up, which is not part of the measured run
        self._skew = random.Random(config.seed * 7919 + rank)
        self._stage: dict[str, torch.Tensor] = {}
        if self.cuda:   # pinned staging for this mode's batch inputs, allocated before P and D overlap
            for ph in (("prefill", "decode") if config.mode == "pd" else ("mixed",)):
                self._staging(ph, 0)
            self._warm_nccl(groups)
        self.model.collectives = self.col
        self.num_blocks = kv_blocks(config, self.cfg, topo, self.dtype)
        kv_heads = self.model.model.layers[0].self_attn.kv_heads
        self.kv = KVCache(self.cfg.num_hidden_layers, self.num_blocks, config.block_size, kv_heads,
                          self.cfg.head_dim, self.dtype, self.device)
        self.rdv = Rendezvous(groups.rendezvous, world=topo.world)
        c = config.control
        self.ctl = TurnstileController(self.rdv, c.ordering, c.span, c.activation, watchdog=self.wd,
                                       p_pending=lambda: self.dev.pending("p"))
        self.control = c
        self.gens: dict[str, torch.Generator] = {}
        self.sampling: dict[str, object] = {}
        self._pq: "queue.Queue" = queue.Queue()
        self._p_done: "queue.Queue" = queue.Queue()
        threading.Thread(target=self._producer, name="P", daemon=True).start()
        self._gate = {"p": threading.Event(), "d": threading.Event()}
        self._log = None
        self._skew_applied: list[float] = []
        if options.step_log:
            os.makedirs(options.step_log, exist_ok=True)
            self._log = open(os.path.join(options.step_log, f"rank{rank}.jsonl"), "w")
        if config.mode == "pd":
            self._warm_paths()
        if self.cuda and options.gpu_timeline:
            self.timeline = self.col.timeline = GpuTimeline(rank, self.device)
        self.wd.start()

    def _warm_kernels(self) -> None:
        """Before P and D can overlap on CUDA: every GEMM the paths can issue, once. Native stacks of
        the crossed stall on two H200s (issue 8, docs/perf/stall4-x2) show the other path's thread
        blocked in the driver at a *first use*: cuBLASLt setting a new kernel's attributes
        (cuKernelSetAttribute) and a first cuDNN handle loading its modules (cuModuleLoadData). Both
        wait for a context-wide synchronization, i.e. for every kernel on the GPU, including a
        collective spinning for a peer. cuBLASLt picks kernels by M, so the M values up to the
        largest row count a weight can see run here (`warm_rows`). cuDNN attention (modules built
        per shape) is off in the ranks' processes; the precompiled memory-efficient kernel serves
        the masks instead."""
        torch.backends.cuda.enable_cudnn_sdp(False)
        rows = max(self.col.p_max_rows, self.config.max_running)
        t0 = time.monotonic()
        with torch.cuda.stream(self._streams["d"]):
            n = warm_gemms(self.model, rows, rows * self.topo.ep, self.device)
            if self.comm.fixed_slots:   # D's experts: grouped GEMMs over every slot count
                layer = next(mod for mod in self.model.modules() if hasattr(mod, "experts"))
                n += warm_slot_experts(layer, self.comm.ep * self.comm.cap, self.device)
        torch.cuda.synchronize(self.device)
        print(f"[rank {self.rank}] kernel warm-up: {n} GEMMs, M up to {rows} ({rows * self.topo.ep} for "
              f"experts), {time.monotonic() - t0:.2f} s", file=sys.stderr, flush=True)

    def _warm_paths(self) -> None:
        """One tiny P forward (on the P thread), then one D forward (here), one after the other on
        every rank, before P and D can overlap: each path's first-use work (cuBLAS handles and
        workspaces for its thread and stream, allocator segments, kernel loading, NCCL on its
        stream) happens while no collective waits for peers. A first use behind the other path's
        spinning NCCL kernel blocks the host (issue 8). The eager analogue of capturing D's graph
        before P is admitted (DESIGN §5). Both rows write only the KV cache's null slot."""
        if self.cuda:
            self._warm_kernels()
        null = self.num_blocks   # block id of the null slot's block
        row = lambda kind: RowSpec("warmup", kind, 0, (0,), (null,), samples=False)
        plan = StepPlan(step=-1, control={}, replicas=tuple(
            ReplicaWork(decode=(row("decode"),), prefill=(row("prefill"),)) for _ in range(self.topo.adp)))
        for lane in ("p", "d"):   # the registered P collectives on either stream
            self.col.p_lane = lane
            self._pq.put((plan, None))
            self._wait_p()
        self._forward("d", plan, plan.replicas, lambda w: w.decode)
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _frontier(self) -> dict:
        """The host device model's frontier; on CUDA also each stream's last issued collective and
        whether the stream drained (a stalled GPU shows busy streams behind peers' collectives)."""
        f = self.dev.frontier()
        if self.cuda and getattr(self, "col", None) is not None:
            f["cuda"] = {k: {"last": self.col.issued.get(k), "idle": s.query()}
                         for k, s in getattr(self, "_streams", {}).items()}
        return f

    def _make_streams(self) -> dict:
        if not self.opt.sm_partition:
            return {k: torch.cuda.Stream(self.device) for k in ("p", "d")}
        from torch.cuda.green_contexts import GreenContext
        # Two green contexts of one SM count take the same SMs (the split of the device's SM
        # resource is deterministic), so P and D compete for one partition's residency: the
        # device condition of DESIGN §2. e2e/gpu/stall4.py checks the sharing by timing.
        self._green = [GreenContext.create(self.opt.sm_partition, self.device.index) for _ in range(2)]
        out = {}
        for k, g in zip(("p", "d"), self._green):
            s = g.Stream()
            out[k] = torch.cuda.Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
        return out

    def _warm_nccl(self, groups) -> None:
        """Create every NCCL communicator now, in one order on every rank, before P and D run
        concurrently (a lazy first-use init inside a crossed order is avoidable risk)."""
        import torch.distributed as dist
        pgs = [groups.p_world, groups.atp, groups.dp]
        if hasattr(self.comm, "_p") and hasattr(self.comm, "_d"):
            pgs += [self.comm.state(ph).group for ph in ("decode", "prefill")]
        for pg in pgs:
            if pg is not None and dist.get_backend(pg) == "nccl":
                dist.all_reduce(torch.zeros(1, device=self.device), group=pg)
        torch.cuda.synchronize(self.device)

    # ---- stalls -------------------------------------------------------------------------
    def _thread_stacks(self, err) -> None:
        """Where every named thread of this rank is (a GPU stall blocks host threads in CUDA
        calls), as one write so that ranks sharing stderr do not interleave line by line."""
        names = {t.ident: t.name for t in threading.enumerate()}
        parts = [f"[rank {self.rank}] threads at the stall:"]
        for ident, frame in sys._current_frames().items():
            stack = "".join(traceback.format_stack(frame, limit=12))
            parts.append(f"--- rank {self.rank} thread {names.get(ident, ident)}\n{stack}")
        sys.stderr.write("\n".join(parts) + "\n")
        sys.stderr.flush()
        # PDROLLOUT_STALL_NATIVE=DIR: also the native stacks (which CUDA or NCCL call each thread
        # is in) through py-spy, if installed, into DIR/rankN.txt
        out = os.environ.get("PDROLLOUT_STALL_NATIVE")
        spy = shutil.which("py-spy")
        if out and spy:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, f"rank{self.rank}.txt"), "w") as f:
                subprocess.run([spy, "dump", "--native", "--pid", str(os.getpid())], stdout=f,
                               stderr=subprocess.STDOUT, timeout=120, check=False)

    def _stall_exit(self, err) -> None:   # a thread is stuck inside a collective: leave (stacks: _thread_stacks)
        os._exit(EXIT_STALL)

    def _on_enqueue(self, meta: dict) -> None:
        if meta.get("collective"):
            self.wd.update(last_collective=meta["collective"], phase=meta.get("phase"))
            group = meta.get("group") or []
            if meta.get("phase") == "P" or len({self.side(r) for r in group}) > 1:
                self._gate["p" if meta.get("phase") == "P" else "d"].set()

    def side(self, rank: int) -> int:
        """A rank's side in the crossed diagnostic: its replica; with one replica (ATP only) its
        local index, so the two sides still meet in the ATP group's and the model-wide collectives."""
        return self.topo.replica(rank) if self.topo.adp > 1 else self.topo.local_index(rank)

    # ---- one step ----------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepReport:
        self._skew_applied = []
        for nr in plan.new:
            if nr.replica == self.replica:
                seed = self.config.seed ^ zlib.crc32(nr.rid.encode())
                self.gens[nr.rid], self.sampling[nr.rid] = make_generator(nr.sampling, seed), nr.sampling
        for rid in plan.drop:
            self.gens.pop(rid, None)
            self.sampling.pop(rid, None)
        control = ControlSettings.model_validate(plan.control)
        if control != self.control:
            self.ctl.set_control(ordering=control.ordering, span=control.span, activation=control.activation)
            self.control = control
        mine = plan.replicas[self.replica]
        self.wd.update(busy=True, phase="step", epoch=plan.step)
        n_results, n_rdv = len(self.ctl.results), len(self.rdv.latencies)
        if self.config.mode == "pd":
            logits_d, logits_p = self._run_pd(plan, mine)
        else:
            logits_d, logits_p = None, self._forward("p", plan, plan.replicas,
                                                     lambda w: w.decode + w.prefill)
        rs = self.ctl.results[n_results:]
        report = StepReport(self.rank, plan.step, rounds=sum(r.rendezvous for r in rs),
                            rendezvous_s=self.rdv.latencies[n_rdv:],
                            ordering=self.ctl.ordering.value, span=self.control.span,
                            multiplexed=any(r.rendezvous for r in rs))
        if self.leader:
            rows = list(mine.decode) + list(mine.prefill) if logits_d is None else list(mine.prefill)
            self._sample(rows, logits_p, report)
            if logits_d is not None:
                self._sample(list(mine.decode), logits_d, report)
        self.wd.update(busy=False, phase="idle")
        if self._log:
            self._log.write(json.dumps({"step": plan.step, "rank": self.rank, "control": plan.control,
                                        "ordering": report.ordering, "rounds": report.rounds,
                                        "decode_rows": mine.decode_rows,
                                        "prefill_tokens": mine.prefill_tokens,
                                        "rendezvous_s": report.rendezvous_s,
                                        "skew_ms": self._skew_applied}) + "\n")
            self._log.flush()
        return report

    def _run_pd(self, plan: StepPlan, mine: ReplicaWork):
        """D through the turnstile, P on the P thread as epoch `plan.step`."""
        out: dict[str, torch.Tensor] = {}
        order = self.ctl.ordering if self.control.activation != "off" else Ordering.NORMAL
        self.col.p_lane = self.ctl.registered_lane

        def enqueue_d(ready: bool) -> None:
            if self.opt.skew_ms:
                delay = self._skew.uniform(0, self.opt.skew_ms)
                self._skew_applied.append(delay)   # the step log's record of the injected skew
                time.sleep(delay / 1e3)
            # --d-async: return once D's kernels are enqueued (the ACK orders enqueue, not
            # completion), so P's next work can overlap D's tail; D is waited for before sampling.
            out["d"] = self._forward("d", plan, plan.replicas, lambda w: w.decode, wait=not self.opt.d_async)

        occupancy = max(w.decode_rows for w in plan.replicas) / self.config.max_running
        if not plan.p_any:
            if plan.d_any:
                self.ctl.round(True, enqueue_d, d_occupancy=occupancy)
            return self._d_done(out.get("d")), None
        epoch = plan.step
        self.ctl.begin(epoch, d_active=plan.d_any)
        for g in self._gate.values():
            g.clear()
        # The crossed diagnostic: odd sides enqueue P before D, even ones D before P.
        d_first = self.opt.cross_isolation and order is Ordering.ISOLATION_ONLY and plan.d_any \
            and self.side(self.rank) % 2 == 0
        if not d_first:
            self._pq.put((plan, epoch))
        if order is Ordering.ISOLATION_ONLY:
            if self.opt.cross_isolation and not d_first and plan.d_any:
                self._wait(self._gate["p"])
            if d_first:   # release P once D holds a collective that needs the other side
                threading.Thread(target=lambda: (self._wait(self._gate["d"]), self._pq.put((plan, epoch))),
                                 daemon=True).start()
            if plan.d_any:
                self.ctl.round(True, enqueue_d)
            out["p"] = self._wait_p()
            self.ctl.retire(epoch)
            return self._d_done(out.get("d")), out["p"]
        first = True
        pressure = sum(w.prefill_tokens for w in plan.replicas) / max(1, self.control.prefill_budget_tokens)
        while True:
            r = self.ctl.round(first and plan.d_any, enqueue_d, d_occupancy=occupancy, p_pressure=pressure)
            first = False
            if r.epoch == epoch and r.boundary == END:
                break
        p = self._wait_p()
        return self._d_done(out.get("d")), p

    def _wait(self, ev: threading.Event) -> None:
        while not ev.wait(0.05):
            self.wd.check()

    def _wait_p(self):
        while True:
            try:
                return self._p_done.get(timeout=0.05)
            except queue.Empty:
                self.wd.check()

    def _producer(self) -> None:
        while True:
            plan, epoch = self._pq.get()
            try:
                if epoch is None:   # the start-up warm-up: no turnstile
                    self._p_done.put(self._forward("p", plan, plan.replicas, lambda w: w.prefill))
                    continue

                def boundary(i: int) -> None:
                    self.ctl.boundary(epoch, i)
                logits = self._forward("p", plan, plan.replicas, lambda w: w.prefill, boundary=boundary)
                self.ctl.finish(epoch)
                self._p_done.put(logits)
            except BaseException:   # fail fast: peers see the closed connections and stop too
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(EXIT_STALL if self.wd.stall is not None else EXIT_ERROR)

    # ---- forward -------------------------------------------------------------------------
    def _d_done(self, logits):
        if logits is not None and self.cuda and self.opt.d_async:
            self._streams["d"].synchronize()
        return logits

    def _forward(self, path: str, plan: StepPlan, replicas, pick, boundary=None, wait: bool = True) -> torch.Tensor:
        rows_all = [pick(w) for w in replicas]
        self.col.begin(path, PathContext(plan.step, [sum(r.length for r in rs) for rs in rows_all], boundary))
        phase = "decode" if path == "d" else ("mixed" if self.config.mode != "pd" else "prefill")
        if not self.cuda:
            return self.model(self._batch(rows_all[self.replica], phase), self.kv)
        torch.cuda.set_device(self.device)    # the P thread's device is its own
        s = self._streams[path]
        with torch.cuda.stream(s):
            batch = self._batch(rows_all[self.replica], phase)
            if self.timeline is None:
                logits = self.model(batch, self.kv)
            else:
                with self.timeline.span("forward", s, phase=path.upper(), step=plan.step):
                    logits = self.model(batch, self.kv)
        if wait:
            s.synchronize()                   # eager: the step's logits are complete for sampling
        return logits

    def _batch(self, rows: list[RowSpec], phase: str) -> ForwardBatch:
        bs = self.config.block_size
        ids, pos, slot_map, seqs, logit_rows, t = [], [], [], [], [], 0
        for r in rows:
            table = torch.tensor(r.blocks, dtype=torch.long)
            ctx_pos = torch.arange(r.start + r.length)
            slots = table[ctx_pos // bs] * bs + ctx_pos % bs
            ids.extend(r.tokens)
            pos.extend(range(r.start, r.start + r.length))
            slot_map.append(slots[r.start:])
            seqs.append(SeqSlice(t, r.length, r.start + r.length, slots))
            if r.samples:
                logit_rows.append(t + r.length - 1)
            t += r.length
        long = lambda xs: torch.tensor(xs, dtype=torch.long)
        host = [long(ids), long(pos), torch.cat(slot_map) if slot_map else long([]), long(logit_rows)]
        host += [q.slots for q in seqs]
        if self.device.type != "cpu":
            host = self._upload(phase, host)
        seqs = [SeqSlice(q.q_start, q.q_len, q.ctx_len, t) for q, t in zip(seqs, host[4:])]
        return ForwardBatch(host[0], host[1], host[2], seqs, host[3], phase=phase)

    def _upload(self, phase: str, arrays: list[torch.Tensor]) -> list[torch.Tensor]:
        """One non-blocking copy from a pinned staging buffer per path. A pageable copy
        (`torch.tensor(..., device=cuda)`) blocks the host while a peer-waiting NCCL kernel of the
        other path spins on this GPU (seen on the H200s: the crossed order then stalls on a whole
        GPU), and the path's next batch could never be issued. The buffer is reused only after the
        path's stream synchronized (every step waits for its forwards before sampling)."""
        sizes = [a.numel() for a in arrays]
        total = sum(sizes)
        stage = self._staging(phase, total)
        if total:
            torch.cat(arrays, out=stage[:total])
        flat = stage[:total].to(self.device, non_blocking=True)
        return list(torch.split(flat, sizes))

    def _staging(self, phase: str, total: int) -> torch.Tensor:
        """The phase's pinned buffer of at least `total` elements (pinned allocation: at start, or rarely)."""
        stage = self._stage.get(phase)
        if stage is None or stage.numel() < total:
            stage = self._stage[phase] = torch.empty(max(total, 1 << 20), dtype=torch.long, pin_memory=True)
        return stage

    def _sample(self, rows: list[RowSpec], logits: torch.Tensor | None, report: StepReport) -> None:
        rows = [r for r in rows if r.samples]
        if not rows:
            return
        want = any(r.logprob for r in rows)
        toks, lps = sample(logits, [self.sampling[r.rid] for r in rows], [self.gens[r.rid] for r in rows], want)
        for i, r in enumerate(rows):
            report.tokens[r.rid] = (toks[i], lps[i] if lps is not None else None)

    def close(self) -> None:
        self.wd.stop()
        self.dev.close()
        if self.timeline is not None:
            self.timeline.rendezvous_s = list(self.rdv.latencies)
            os.makedirs(self.opt.gpu_timeline, exist_ok=True)
            self.timeline.dump(os.path.join(self.opt.gpu_timeline, f"rank{self.rank}.json"))
        if self._log:
            self._log.close()


def worker_loop(worker: Worker) -> int:
    """Ranks other than 0: execute broadcast plans until the stop plan."""
    import torch.distributed as dist
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        plan: StepPlan = box[0]
        if plan.stop:
            worker.close()
            dist.barrier()   # rank 0's broadcast has completed everywhere before anyone leaves
            return 0
        try:
            report = worker.execute(plan)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(EXIT_ERROR)
        dist.gather_object(report, None, dst=0)
