"""The model's cross-rank collectives on several ranks: the P path and the D path (docs/DISTRIBUTED.md).

Both paths shard attention heads the same way (so P and D share one KV cache) and move routed
tokens through the phase-owned expert communicator; they differ in the groups they reduce over,
and the groups intersect. Per decoder layer, with ATP = a, ADP = d:

P path (eager, variable length; phase "prefill", and "mixed" for a fused forward):
  1. attention: model-wide AllReduce of a zero-padded [sum of all replicas' P rows, H] buffer in
     which each rank wrote its head-shard partial into its replica's segment: sums the ATP
     partials and gathers every replica's P rows (a>1 only; with a=1 the heads are whole).
  2. MoE: rank j of a replica takes chunk j of its replica's rows; safe boundary (turnstile
     permit) -> dispatch into fixed token slots (one all-to-all, no host read: token_slots.py) ->
     experts -> combine (one all-to-all). DeepEP: notify (count exchange) -> permit -> move.
  3. model-wide AllReduce of the zero-padded buffer holding each rank's chunk outputs: every ATP
     rank gets its replica's full MoE output back (a>1 only).
D path (decode rows; phase "decode"):
  1. attention: AllReduce on the ATP group (the ATP reduction correctness needs; a>1 only).
  2. DP gather: rank j takes chunk j of its replica's rows; AllGather on its DP-attention group
     (same local index across replicas), then each member dispatches an even share of the
     gathered valid rows, so the fixed-capacity LL buffers see the mean, not the largest replica.
     With fixed slots (torch backend) the share is strided over the valid-first order, m rows
     with a validity mask, so no count is read back to the host.
  3. LL dispatch / experts / LL combine on the D-owned expert communicator. Torch backend: D's
     own token slots (token_slots.py: each token once to every peer holding one of its experts,
     [ep, rows] slots a rank, the receiver's weighted partial sums back): the D iteration reads
     nothing back to the host and can be enqueued ahead of the GPU.
  4. DP scatter: ReduceScatter on the DP group returns each chunk's output to its owner (d>1).
  5. AllGather on the ATP group restores the replica's full rows (a>1 only).
Every collective is enqueued on the device model (a lane of CpuDevice) and waited for with the
watchdog polled, so a crossed order stalls on the device and is reported, never hangs.
On CUDA (NCCL data groups) the lane's slot thread issues the collective on the *caller's* current
CUDA stream (the worker runs P and D on their own streams), so NCCL orders it after the caller's
kernels and the caller's stream after it; the lane keeps the per-path enqueue order. The
registered P collective on the D lane (fine-grained) is issued on the D stream instead, so the
device itself runs R- < G < R+ in stream order.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..model.qwen3_moe import Collectives
from ..protocol.plan import Phase
from .gpu_timeline import is_registered
from .host_read import HostReader
from ..protocol.topology import Topology


@dataclass
class Groups:
    """Process groups of one rank, created in the same order on every rank (`make_groups`)."""
    p_world: object = None      # P's model-wide AllReduce (ATP>1)
    atp: object = None          # this rank's ATP group (ATP>1)
    dp: object = None           # this rank's DP-attention group (ADP>1)
    rendezvous: object = None   # the turnstile's CPU group


def nccl_options(ctas: int):
    """ProcessGroupNCCL options pinning a communicator's kernels to `ctas` CTAs (min = max), so the
    residency a collective needs is known (issue 8's knob); None leaves NCCL's choice."""
    if not ctas:
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.min_ctas = opts.config.max_ctas = ctas
    return opts


def make_groups(topo: Topology, rank: int, backend: str | None = None, registered_ctas: int = 0) -> Groups:
    """`registered_ctas` (NCCL only) applies to the groups of the registered pair and the ATP group."""
    g = Groups()
    g.rendezvous = dist.new_group(list(topo.world_group), backend="gloo")
    opts = nccl_options(registered_ctas) if backend == "nccl" else None
    new = lambda ranks: dist.new_group(list(ranks), backend=backend, pg_options=opts)
    if topo.atp > 1:
        g.p_world = new(topo.world_group)
        for grp in topo.atp_groups:
            pg = new(grp)
            if rank in grp:
                g.atp = pg
    if topo.adp > 1:
        for grp in topo.dp_groups:
            pg = new(grp)
            if rank in grp:
                g.dp = pg
    return g


@dataclass
class PathContext:
    """One forward's rank-shared shape: rows per replica; P also gets the boundary hook."""
    step: int
    rows: list[int]
    boundary: Callable[[int], None] | None = None   # P: blocks at safe boundary i until permitted
    moe_index: int = 0
    enqueued: int = 0
    compute_from: object = None   # CUDA timeline: event after the path's previous collective
    live: object = None           # D graph: int32 [rows], 0 marks a padding row (routed to no expert)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _ring(t: torch.Tensor, g: int) -> int:
    """A rank's bytes to peers in an all-reduce of `t` over g ranks (ring: reduce-scatter, all-gather)."""
    return 2 * (g - 1) * _nbytes(t) // g


class RankCollectives(Collectives):
    def __init__(self, topo: Topology, rank: int, groups: Groups, comm, device, check: Callable[[], None],
                 hidden: int, topk: int, p_max_rows: int) -> None:
        self.topo, self.rank, self.g, self.comm, self.dev = topo, rank, groups, comm, device
        self.check, self.hidden, self.topk, self.p_max_rows = check, hidden, topk, p_max_rows
        self.replica, self.j = topo.replica(rank), topo.local_index(rank)
        self.a, self.d = topo.atp, topo.adp
        self.ctx: dict[str, PathContext] = {}
        self.p_lane = "d"          # the registered P collective's lane (set per step from the controller)
        self.cuda = False          # set by the worker on CUDA: collectives run on the caller's stream
        self.streams: dict = {}    # CUDA: the worker's P and D streams
        self.timeline = None       # CUDA: a GpuTimeline (--gpu-timeline)
        self.issued: dict[str, str] = {}   # CUDA: last collective issued per stream (the watchdog's view)
        self.in_capture = False            # a D graph is being captured (graphs.py): check it stays valid
        self._issued = {"p": 0, "d": 0}    # collectives issued per path, the expert comm's aside
        self._sent = {"p": 0, "d": 0}      # bytes they sent to peers (ring all-reduce: 2(g-1)/g of the buffer)
        # D's compact shares need a count on the host, only for backends without fixed slots
        self.reader = None if comm.fixed_slots else HostReader(comm.device, ("decode",))

    # ---- per forward -------------------------------------------------------------------
    def begin(self, path: str, ctx: PathContext) -> None:
        self.ctx[path] = ctx

    def collectives_issued(self, path: str) -> int:
        """Collectives `path` issued so far, each expert all-to-all one (the step log's count)."""
        phase = Phase.DECODE if path == "d" else Phase.PREFILL
        return self._issued[path] + (self.comm.state(phase).issued if self.comm.counts_issued else 0)

    def bytes_sent(self, path: str) -> int:
        """Bytes `path`'s collectives sent to peers so far, the expert comm's included (the step log's)."""
        phase = Phase.DECODE if path == "d" else Phase.PREFILL
        return self._sent[path] + (self.comm.state(phase).sent if self.comm.counts_issued else 0)

    @staticmethod
    def path(phase) -> str:
        return Phase(phase).path

    def _run(self, path: str, name: str, group: tuple, fn: Callable[[], object], sent: int = 0):
        """Enqueue `fn` (one blocking collective, `sent` bytes to peers) on the path's lane; wait,
        polling the watchdog."""
        ctx = self.ctx[path]
        self._sent[path] += sent
        box: list = []
        key = f"{path.upper()}:{ctx.step}:{ctx.enqueued}:{name}"
        if name not in ("dispatch", "combine") or not self.comm.counts_issued:
            self._issued[path] += 1
        ctx.enqueued += 1
        phase = path.upper()
        registered = is_registered(phase, name)
        lane = self.p_lane if path == "p" else "d"
        stream = torch.cuda.current_stream() if self.cuda else None
        # On CUDA the registered P collective follows the lane onto the D stream: stream FIFO then
        # gives R- < G < R+ on the device too, not only in the host enqueue order.
        on_d = stream is not None and path == "p" and lane == "d" and registered and "d" in self.streams
        if self.timeline is not None:
            self.timeline.trace.record(epoch=ctx.step, boundary=ctx.moe_index, phase=phase, collective=name,
                                       group=group, lane=lane, key=key, registered=registered)

        def issue(s) -> None:
            self.issued["d" if on_d or path == "d" else "p"] = key
            capturing = s is not None and torch.cuda.is_current_stream_capturing()
            if self.in_capture and not capturing:
                raise RuntimeError(f"the CUDA graph capture was invalidated before {key}")
            timed = contextlib.nullcontext() if self.timeline is None else \
                self.timeline.span(name, s, phase=phase, key=key, registered=registered, lane=lane)
            with timed:
                box.append(fn())
            if capturing and not torch.cuda.is_current_stream_capturing():   # name what broke a D graph
                raise RuntimeError(f"{key} invalidated the CUDA graph capture it was issued into")

        def call() -> None:
            with torch.inference_mode():   # the slot thread writes the forward's inference tensors
                if stream is None:
                    box.append(fn())
                    return
                torch.cuda.set_device(stream.device)   # the slot thread's device is thread-local
                if on_d:
                    d = self.streams["d"]
                    d.wait_stream(stream)              # R sees P's data
                    with torch.cuda.stream(d):
                        issue(d)
                    stream.wait_stream(d)              # P continues after R
                    return
                with torch.cuda.stream(stream):        # NCCL orders against the caller's stream
                    issue(stream)
        if path == "p":
            self._compute_cut(ctx, key)
        ev = self.dev.collective(lane, call, key, group,
                                 meta={"phase": phase, "epoch": ctx.step, "boundary": ctx.moe_index,
                                       "key": key})
        while not ev.wait(0.05):
            self.check()
        if path == "p":
            self._compute_resume(ctx)
        return box[0] if box else None

    # CUDA timeline (no-ops without one): P's compute segments on its stream, between two of its
    # collectives or a collective and the permit wait (the stream idles while P waits).
    def _compute_cut(self, ctx: PathContext, key: str) -> None:
        if self.timeline is not None and ctx.compute_from is not None:
            s = torch.cuda.current_stream()
            self.timeline.add("compute", ctx.compute_from, self.timeline.mark(s), phase="P", key=key)
            ctx.compute_from = None

    def _compute_resume(self, ctx: PathContext) -> None:
        if self.timeline is not None:
            ctx.compute_from = self.timeline.mark(torch.cuda.current_stream())

    def _segment(self, rows: list[int]) -> tuple[int, int]:
        off = sum(rows[:self.replica])
        return off, sum(rows)

    # ---- attention ---------------------------------------------------------------------
    def attn_reduce(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        if self.a == 1:
            return x
        path = self.path(phase)
        if path == "d":
            out = x.clone()
            self._run("d", "atp-allreduce", self.topo.atp_group(self.rank),
                      lambda: dist.all_reduce(out, group=self.g.atp), _ring(out, self.a))
            return out
        return self._world_gather("attn-allreduce", x, 0, x.shape[0])

    def _world_gather(self, name: str, part: torch.Tensor, lo: int, n: int) -> torch.Tensor:
        """P's model-wide AllReduce of a zero-padded buffer; `part` sits at rows [lo, ...) of this
        replica's segment. Returns the replica's n rows."""
        off, total = self._segment(self.ctx["p"].rows)
        buf = torch.zeros(total, self.hidden, dtype=part.dtype, device=part.device)
        buf[off + lo:off + lo + part.shape[0]] = part
        self._run("p", name, self.topo.world_group, lambda: dist.all_reduce(buf, group=self.g.p_world),
                  _ring(buf, self.topo.world))
        return buf[off:off + n]

    # ---- experts -----------------------------------------------------------------------
    def experts(self, layer, x, topk_ids, topk_weights, phase: str) -> torch.Tensor:
        if self.path(phase) == "p":
            return self._p_experts(layer, x, topk_ids, topk_weights)
        return self._d_experts(layer, x, topk_ids, topk_weights)

    def _experts_of(self, layer, recv, meta):
        """This rank's experts over what the all-to-all delivered: the routed rows through the
        layer's expert backend (grouped GEMMs on CUDA, no host read); DeepEP's per-expert layout
        through its own per-expert loop."""
        if meta.layout == "rows":
            return layer.routed_experts(recv, meta.expert_ids)
        if meta.layout == "tokens":   # weighted partial sums over this rank's experts
            return layer.local_experts(recv, meta.expert_ids, meta.weights)
        ex = layer.experts
        dtype = recv.dtype if ex.block is not None else ex.gate_up_proj.dtype

        def fn(e: int, rows: torch.Tensor) -> torch.Tensor:
            gu, dn = ex.weights(e, dtype)   # dequantized per expert when FP8
            gate, up = F.linear(rows.to(dtype), gu).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, dn)
        return self.comm.apply_experts(recv, meta, fn)

    def _p_experts(self, layer, x, ids, w) -> torch.Tensor:
        ctx = self.ctx["p"]
        n = x.shape[0]
        m = _ceil(max(ctx.rows), self.a)                 # rank-shared chunk size
        lo, hi = min(n, self.j * m), min(n, (self.j + 1) * m)
        passes = max(1, _ceil(m, self.p_max_rows))       # same count on every rank
        step = _ceil(m, passes)
        outs = []
        slotted = self.comm.fixed_slots   # token slots: no count exchange, no host read
        for q in range(passes):
            s, e = min(hi, lo + q * step), min(hi, lo + (q + 1) * step)
            pend = None if slotted else self.comm.notify(Phase.PREFILL, x[s:e], ids[s:e], w[s:e])
            if q == 0 and ctx.boundary is not None:
                i = ctx.moe_index
                self._compute_cut(ctx, f"P:{ctx.step}:boundary{i}")
                if slotted:
                    ctx.boundary(i)                                          # the safe boundary
                else:
                    self.comm.wait_permit(pend, lambda: ctx.boundary(i))     # counts arrive meanwhile
                self._compute_resume(ctx)
            elif pend is not None:
                pend.permitted = True
            if slotted:   # every member's slots hold the pass's rank-shared bound; padding goes nowhere
                ok = None if ctx.live is None else ctx.live[s:e] > 0
                move = lambda s=s, e=e, ok=ok: self.comm.dispatch(Phase.PREFILL, x[s:e], ids[s:e], w[s:e],
                                                                  rows=step, valid=ok)
            else:
                move = lambda: self.comm.move(pend)
            recv, meta, handle = self._run("p", "dispatch", self._ep_group(), move)
            y = self._experts_of(layer, recv, meta)
            outs.append(self._run("p", "combine", self._ep_group(),
                                  lambda: self.comm.combine(Phase.PREFILL, y, handle)))
        ctx.moe_index += 1
        y = torch.cat(outs).to(x.dtype) if outs else x.new_zeros(0, self.hidden)
        if self.a == 1:
            return y
        return self._world_gather("moe-allreduce", y, lo, n)

    def _d_experts(self, layer, x, ids, w) -> torch.Tensor:
        ctx = self.ctx["d"]
        n, H, k = x.shape[0], self.hidden, self.topk
        m = _ceil(max(ctx.rows), self.a)
        lo = min(n, self.j * m)
        valid = max(0, min(n, lo + m) - lo)
        fixed = self.comm.fixed_slots
        ok = None   # fixed slots: which of this member's rows are real (padding routes nowhere)
        if self.a == 1:   # each replica sends its own rows: the two expert all-to-alls, nothing else
            if fixed and ctx.live is not None:
                ok = ctx.live[:n] > 0
            hs, ids_m, w_m = x, ids, w
        elif self.d > 1:
            pack = torch.zeros(m, H + 2 * k + 1, device=x.device)
            pack[:valid, :H] = x[lo:lo + valid].float()
            pack[:valid, H:H + k] = ids[lo:lo + valid].float()
            pack[:valid, H + k:H + 2 * k] = w[lo:lo + valid].float()
            pack[:valid, -1] = 1.0
            parts = [torch.empty_like(pack) for _ in range(self.d)]
            self._run("d", "dp-allgather", self.topo.dp_group(self.rank),
                      lambda: dist.all_gather(parts, pack, group=self.g.dp), _nbytes(pack) * (self.d - 1))
            gathered = torch.cat(parts)
            real = gathered[:, -1] > 0
            # The real rows first, in order; every member dispatches an even share of them.
            first = torch.argsort((~real).to(torch.int8), stable=True)
            if fixed:   # member r takes rows r, r+d, ... of that order: m rows, no host read
                mine = first[self.replica::self.d]
                ok = real[mine]
            else:       # compact shares need the count (see host_read.py)
                n_real = self.reader.read("decode", real.sum())[0]
                share = _ceil(n_real, self.d)
                mine = first[:n_real][self.replica * share:(self.replica + 1) * share]
            hs = gathered[mine, :H].to(x.dtype)
            ids_m, w_m = gathered[mine, H:H + k].long(), gathered[mine, H + k:H + 2 * k].to(w.dtype)
        else:
            hs, ids_m, w_m = x[lo:lo + valid], ids[lo:lo + valid], w[lo:lo + valid]
        extra = {"rows": m} if fixed else {}   # every member sends slots for the step's bound
        if ok is not None:
            extra["valid"] = ok
        recv, meta, handle = self._run("d", "dispatch", self._ep_group(),
                                       lambda: self.comm.dispatch(Phase.DECODE, hs, ids_m, w_m, **extra))
        y_e = self._experts_of(layer, recv, meta)
        y = self._run("d", "combine", self._ep_group(), lambda: self.comm.combine(Phase.DECODE, y_e, handle))
        if self.a == 1:
            return y.to(x.dtype)
        if self.d > 1:
            buf = torch.zeros(self.d * m, H, dtype=y.dtype, device=y.device)
            buf[mine] = y
            own = torch.empty(m, H, dtype=y.dtype, device=y.device)
            self._run("d", "dp-reducescatter", self.topo.dp_group(self.rank),
                      lambda: dist.reduce_scatter_tensor(own, buf, group=self.g.dp), _nbytes(own) * (self.d - 1))
        else:
            own = torch.zeros(m, H, dtype=y.dtype, device=y.device)
            own[:valid] = y
        if self.a > 1:
            parts = [torch.empty_like(own) for _ in range(self.a)]
            self._run("d", "atp-allgather", self.topo.atp_group(self.rank),
                      lambda: dist.all_gather(parts, own, group=self.g.atp), _nbytes(own) * (self.a - 1))
            own = torch.cat(parts)
        return own[:n].to(x.dtype)

    def _ep_group(self) -> tuple:
        return self.topo.ep_group(self.rank)
