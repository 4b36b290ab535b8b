"""What a worker needs to be one rank of a group: the watchdog, the process groups, the device
(the CPU device model over gloo, CUDA streams over NCCL), the expert communication, the model's
collectives, the turnstile controller and rendezvous, the pd step, the warm-ups and D's graphs.

CPU: collectives are blocking gloo calls issued by the device model's slot threads (`CpuDevice`:
one slot stands for full SM residency, which is how a crossed order stalls here). CUDA: P and D own
a stream each; collectives are issued at once in the caller's thread on its stream (`StreamDevice`),
so D's graph can hold them (graphs.py).
"""
from __future__ import annotations

import contextlib
import os

import torch

from ..protocol.layout import EXPERT_BACKENDS
from ..protocol.plan import Phase
from .collectives import PathContext, RankCollectives, make_groups, nccl_options
from .controller import TurnstileController
from .device import CpuDevice
from .expert_comm import ExpertComm, TorchExpertComm
from .gpu_timeline import GpuTimeline
from .pd_step import TurnstileStep
from .uncrossed import BesideStep, uncrossed
from .rendezvous import make_rendezvous
from .stall_dump import dump_threads
from .streams import StreamDevice, make_streams
from .warmup import warm_fresh_attention, warm_kernels, warm_nccl
from .watchdog import Watchdog


class GroupMember:
    def __init__(self, worker, store) -> None:
        self.w = w = worker
        self.dev = self.col = self.ctl = self.rdv = self.timeline = None
        self.wd = Watchdog(store, w.rank, w.topo.world, w.opt.watchdog_bound_s, on_exit=w.exit_now,
                           on_declare=lambda err: dump_threads(w.rank), grace_s=2.0 if w.rank == 0 else 1.0,
                           extra=self._frontier).start()

    def build(self) -> None:
        w, topo, opt = self.w, self.w.topo, self.w.opt
        cuda = w.cuda
        # CUDA: the data collectives (attention reduce/gathers, expert all-to-alls) on NCCL groups;
        # plans, rendezvous and the watchdog stay on gloo (the default group and the store).
        groups = make_groups(topo, w.rank, backend="nccl" if cuda else None, registered_ctas=opt.nccl_ctas)
        progress = lambda meta: self.wd.progress()
        self.dev = StreamDevice(progress, self._on_enqueue) if cuda else \
            CpuDevice(opt.slots, on_progress=progress, on_enqueue=self._on_enqueue)
        cfg, config = w.cfg, w.config
        # a verify row carries k + 1 tokens through D's (or a fused forward's) collectives
        d_tokens = config.max_running * (1 + (config.speculative_k if config.speculative else 0))
        p_rows = min(max(config.control.prefill_budget_tokens, config.mixed_chunk_tokens) + d_tokens, 4096)
        # the expert all-to-alls' NCCL kernels are pinned like the registered pair's (--nccl-ctas):
        # they cross between P and D too, so the residency a crossed order needs is known
        extra = {"pg_backend": "nccl" if cuda else None, "pg_options": nccl_options(opt.nccl_ctas) if cuda else None}
        if opt.expert_backend != "torch":
            extra = {"host_sync": True}   # DeepEP: see DeepEPExpertComm (the GIL-held intranode spin)
        self.comm = comm = make_expert_comm(
            opt.expert_backend, ep_ranks=[list(g) for g in topo.ep_groups], rank=w.rank,
            num_experts=cfg.num_experts, hidden=cfg.hidden_size, max_tokens=p_rows, topk=cfg.num_experts_per_tok,
            dtype=w.dtype, d_max_tokens=d_tokens, device=w.device, **extra)
        self.col = RankCollectives(topo, w.rank, groups, comm, self.dev, self.wd.check, cfg.hidden_size,
                                   cfg.num_experts_per_tok, p_rows)
        # P's piecewise graphs need P with no host read and no per-replica shape: ATP1 on the token slots
        self.p_pieces = topo.atp == 1 and comm.fixed_slots
        w.model.collectives = self.col
        if cuda:
            w.streams = make_streams(w.device, opt.sm_partition, config.priority_stream_on(multi=True))
            self.col.cuda, self.col.streams = True, w.streams
            for ph in ((Phase.PREFILL, Phase.DECODE) if config.mode == "pd" else (Phase.MIXED, Phase.DECODE)):
                w.batches.staging(ph, 0)   # pinned staging before P and D overlap
            pgs = [groups.p_world, groups.atp, groups.dp]
            if hasattr(comm, "_p") and hasattr(comm, "_d"):
                pgs += [comm.state(ph).group for ph in (Phase.DECODE, Phase.PREFILL)]
            warm_nccl(pgs, w.device)
        self.rdv = make_rendezvous(opt.rendezvous, groups.rendezvous, world=topo.world)
        c = config.control
        self.ctl = TurnstileController(self.rdv, c.ordering, c.span, c.activation, watchdog=self.wd,
                                       p_pending=lambda: self.dev.pending("p"))
        # ATP1: P beside D with no turnstile (uncrossed.py); ATP>1: P's AllReduce meets D's groups
        self.uncrossed = uncrossed(topo, cuda, opt.slots)
        w.pd = self.pd = (BesideStep if self.uncrossed else TurnstileStep)(w)
        if cuda:
            rows = max(p_rows, d_tokens)
            warm_kernels(w.model, w.streams["d"], rows, topo.ep, w.device, w.rank)
            if w.backends.attention.prefill == "hybrid":   # auto in bf16
                with torch.cuda.stream(w.streams["d"]):
                    warm_fresh_attention(w.model, p_rows, w.device, w.rank)
        if config.mode == "pd":
            self.pd.warm_paths()
        if cuda and config.cuda_graphs and comm.fixed_slots and not w.eager_d:   # mtp: D runs eagerly
            adp = topo.adp

            def forward(batch, bucket):   # every replica padded to the bucket: rank-shared shapes
                self.col.begin("d", PathContext(-1, [bucket] * adp, live=batch.live))
                self.col.in_capture = torch.cuda.is_current_stream_capturing()
                try:
                    return w.model(batch, w.kv)
                finally:
                    self.col.in_capture = False
            w._capture(forward)
        if cuda:
            torch.cuda.synchronize(w.device)
            if opt.gpu_timeline:
                self.timeline = self.col.timeline = GpuTimeline(w.rank, w.device)

    # ---- per step ------------------------------------------------------------------------
    def begin(self, path: str, step: int, rows: list[int], boundary=None) -> None:
        self.col.begin(path, PathContext(step, rows, boundary))

    def span(self, name: str, stream, path: str, step: int):
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(name, stream, phase=path.upper(), step=step)

    def mark(self) -> tuple:
        return (len(self.ctl.results), len(self.rdv.latencies), self.ctl.boundaries, self.col.collectives_issued("d"),
                self.col.bytes_sent("d"), self.col.bytes_sent("p"))

    def report(self, report, mark) -> None:
        rs = self.ctl.results[mark[0]:]
        report.rounds = sum(r.rendezvous for r in rs)
        report.rendezvous_s = self.rdv.latencies[mark[1]:]
        report.turnstile_wait_s = [r.d_wait_s for r in rs if r.d_any]
        report.ordering = self.ctl.ordering.value
        report.span = self.w.control.span
        report.multiplexed = any(r.rendezvous for r in rs)

    def log_fields(self, mark) -> dict:
        """A step log's turnstile fields: the transport and each rendezvous round's timing (start,
        P to its permit, pre-D, D enqueue, post-D; the rendezvous simulator reads them)."""
        rs = self.ctl.results[mark[0]:]
        pd = getattr(self.w, "pd", None)
        return {"rendezvous": self.rdv.kind, "rendezvous_s": self.rdv.latencies[mark[1]:],
                "permits": self.ctl.boundaries - mark[2],   # P boundaries that asked for a permit
                "d_collectives": self.col.collectives_issued("d") - mark[3],   # D's collectives this step
                "d_bytes": self.col.bytes_sent("d") - mark[4],   # what they sent to peers (eager D; a replay: 0)
                "p_bytes": self.col.bytes_sent("p") - mark[5],   # P's this step (an epoch spans steps)
                "skew_ms": list(pd.skew_applied) if pd is not None else [],
                "round_t": [[r.t_start, r.p_wait_s, r.pre_s, r.enq_s, r.post_s] for r in rs if r.rendezvous]}

    # ---- the watchdog's view -------------------------------------------------------------
    def _frontier(self) -> dict:
        """The device's frontier; on CUDA also each stream's last issued collective and whether the
        stream drained (a stalled GPU shows busy streams behind peers' collectives)."""
        if self.dev is None:   # still loading
            return {}
        f = self.dev.frontier()
        if self.w.cuda and self.col is not None:
            f["cuda"] = {k: {"last": self.col.issued.get(k), "idle": s.query()} for k, s in self.w.streams.items()}
        return f

    def _on_enqueue(self, meta: dict) -> None:
        if meta.get("collective"):
            self.wd.update(last_collective=meta["collective"], phase=meta.get("phase"))
            if self.w.pd is not None:
                group = meta.get("group") or []
                self.w.pd.on_collective(meta.get("phase"), len({self.w.side(r) for r in group}) > 1)

    def close(self) -> None:
        self.wd.stop()
        if self.dev is not None:
            self.dev.close()
        if self.timeline is not None:
            self.timeline.rendezvous_s = list(self.rdv.latencies)
            os.makedirs(self.w.opt.gpu_timeline, exist_ok=True)
            self.timeline.dump(os.path.join(self.w.opt.gpu_timeline, f"rank{self.w.rank}.json"))


def make_expert_comm(backend: str, **kw) -> ExpertComm:
    """backend: 'torch' (everywhere) or 'deep_ep' (alias 'deepep'; CUDA with deep_ep importable)."""
    if backend == "torch":
        return TorchExpertComm(**kw)
    if backend in ("deep_ep", "deepep"):
        kw.pop("pg_backend", None)   # DeepEP makes its own (default-backend) setup groups
        from .deepep_comm import DeepEPExpertComm
        return DeepEPExpertComm(**kw)
    raise ValueError(f"expert backend must be one of {'|'.join(EXPERT_BACKENDS)}, got {backend!r}")
