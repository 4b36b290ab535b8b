"""Phase-owned expert communication (docs/DISTRIBUTED.md; paper Table 1, Figure 5).

Shared by both phases: the process-level runtime, topology and links. Owned per phase, never
shared: buffers, counters, workspace, execution lane (its own process group here, its own
stream on GPU), events and QP index range (D [0,s), P [s,2s)); D also owns its double-buffer
index. The phase is always an explicit argument (Phase.PREFILL / Phase.DECODE).

P uses the normal path, split at the safe boundary:
  notify (exchange receive counts, async) -> counts arrive in the background ->
  wait for counts AND the turnstile permit -> move routed data.
At most one pending dispatch per P buffer; a cancelled dispatch retires its buffer until a
quiescent cleanup point (`quiesce`), because peers already acted on its notification.
D uses the low-latency path: one fixed-capacity exchange into stable, double-buffered slots (the
torch backend: token slots, as P's, token_slots.py).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ..protocol.plan import Phase
from ..protocol.netenv import QPSplit, local_experts, qp_split


class ExpertCommError(RuntimeError):
    """Expert communication failed at run time (exit code 5, protocol/exits.py)."""


class ExpertCommConfigError(ExpertCommError):
    """A backend that cannot be built for this layout, dtype or environment (exit code 2)."""


class PendingDispatchError(ExpertCommError):
    """No free P buffer: a dispatch is already pending (or retired) on every one."""


class PermitMissingError(ExpertCommError):
    """move() before wait_permit(): routed data must not move without the turnstile permit."""


@dataclass
class RecvMeta:
    layout: str                 # "rows": one (token, expert) pair per row; "ll": [E_local, cap, H] slots;
                                # "tokens": [ep * rows] tokens with their k global ids (token_slots.py)
    expert_ids: Any             # rows: local expert id per row; tokens: [N, k] global ids, -1 = none; ll: None
    counts: Any                 # rows: rows received per source rank (host); ll: [E_local] valid rows
                                # per expert; tokens: None
    phase: "Phase | None" = None   # whose rows (a backend may keep per-phase host buffers)
    weights: Any = None            # tokens: [N, k] routing weights, applied by the receiver


@dataclass
class Handle:
    phase: Phase
    buffer: int
    tokens: int
    state: dict


@dataclass
class PhaseState:
    """Everything one phase mutates. `disjoint(p, d)` audits Table 1."""
    phase: Phase
    group: Any
    qp_range: range
    lane: str
    buffers: list[dict]           # name -> tensor, per buffer
    counters: list[Any]           # per buffer
    workspace: Any
    events: list = field(default_factory=list)
    status: list[str] = field(default_factory=list)   # per buffer: free | pending | moved | retired
    ll_index: int = 0             # D only: double-buffer index
    issued: int = 0               # collectives this phase issued (the step log's count)
    sent: int = 0                 # bytes its exchanges sent to peers (the step log's d_bytes/p_bytes)
    slots: dict = field(default_factory=dict)   # P: the token slots' buffers (token_slots.py)

    def claim(self) -> int:
        """A free P buffer for a new dispatch: at most one pending dispatch per buffer."""
        try:
            b = self.status.index("free")
        except ValueError:
            raise PendingDispatchError(f"no free P buffer (status {self.status}): one pending dispatch "
                                       "per buffer; retired buffers free at quiesce()") from None
        self.status[b] = "pending"
        return b

    def free_retired(self) -> int:
        """At a quiescent point: retired buffers (cancelled dispatches) become free again."""
        n = 0
        for i, s in enumerate(self.status):
            if s == "retired":
                self.status[i], n = "free", n + 1
        return n


@dataclass
class PendingDispatch:
    buffer: int
    tokens: int
    work: Any
    state: dict
    permitted: bool = False
    cancelled: bool = False

    def counts_ready(self) -> bool:
        return self.work.is_completed()

    def check_movable(self) -> None:
        """Routed data may move only for a live dispatch that holds the turnstile permit."""
        if self.cancelled:
            raise ExpertCommError("move() of a cancelled dispatch")
        if not self.permitted:
            raise PermitMissingError("move() before the turnstile permit (wait_permit first)")


def disjoint(a: PhaseState, b: PhaseState) -> list[str]:
    """Problems (empty when the two phases share no mutable state)."""
    def spans(s: PhaseState):
        ts = [t for buf in s.buffers for t in buf.values()] + list(s.counters) + [s.workspace] + list(s.slots.values())
        return [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                for t in ts]
    out = []
    for x0, x1 in spans(a):
        for y0, y1 in spans(b):
            if x0 < y1 and y0 < x1:
                out.append(f"storage [{x0:#x},{x1:#x}) of {a.phase.value} overlaps {b.phase.value}")
    if set(a.qp_range) & set(b.qp_range):
        out.append(f"QP ranges overlap: {a.qp_range} vs {b.qp_range}")
    if a.group is b.group:
        out.append("phases share one communicator")
    if a.lane == b.lane:
        out.append(f"phases share lane {a.lane}")
    if a.events is b.events:
        out.append("phases share an event list")
    return out


class ExpertComm:
    """Interface both backends implement."""
    # D's dispatch takes a row-validity mask and returns fixed [ep * rows] token slots (layout
    # "tokens"): the D iteration needs no host read (TorchExpertComm); DeepEP's LL layout is [E_local, cap].
    fixed_slots = False
    counts_issued = False   # PhaseState.issued counts each collective the backend issues

    def dispatch(self, phase: Phase, hidden, topk_ids, topk_weights):  # -> (recv_hidden, RecvMeta, Handle)
        raise NotImplementedError

    def combine(self, phase: Phase, expert_out, handle: Handle):       # -> [T, H]
        raise NotImplementedError

    def notify(self, phase: Phase, hidden, topk_ids, topk_weights) -> PendingDispatch:
        raise NotImplementedError

    def wait_permit(self, pending: PendingDispatch, permit: Callable[[], None]) -> None:
        """Block in `permit` (e.g. controller.boundary(epoch, i)); counts keep arriving meanwhile."""
        permit()
        pending.permitted = True

    def move(self, pending: PendingDispatch):                          # -> (recv_hidden, RecvMeta, Handle)
        raise NotImplementedError

    def state(self, phase: Phase) -> PhaseState:
        raise NotImplementedError


class TorchExpertComm(ExpertComm):
    """torch.distributed backend: all_to_all_single over one EP group per phase (gloo or NCCL).
    Collective: every member must call the same methods in the same order per phase."""
    fixed_slots = True
    counts_issued = True

    def __init__(self, ep_ranks: list[list[int]], rank: int, num_experts: int, hidden: int,
                 max_tokens: int, topk: int, dtype=None, p_buffers: int = 1, p_capacity_rows: int | None = None,
                 d_max_tokens: int | None = None, *, device=None, pg_backend: str | None = None,
                 pg_options=None):
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        self.dtype = dtype or torch.float32
        # device: where buffers and index tensors live (cuda for NCCL groups); pg_backend: the EP
        # groups' process-group backend (None = the default group's); pg_options: e.g. NCCL CTA limits
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        mine = next(g for g in ep_ranks if rank in g)
        self.ep, self.rank_in_ep = len(mine), mine.index(rank)
        self.num_experts, self.hidden, self.topk, self.max_tokens = num_experts, hidden, topk, max_tokens
        self.e_local = local_experts(num_experts, self.ep)
        self.qps: QPSplit = qp_split(self.e_local)
        groups = {}
        for ph in (Phase.DECODE, Phase.PREFILL):  # one communicator per phase = its own QP set
            for g in ep_ranks:
                pg = dist.new_group(list(g), backend=pg_backend, pg_options=pg_options)
                if g is mine:
                    groups[ph] = pg
        self._cap_p = p_capacity_rows or max_tokens * topk * self.ep
        z = lambda *s, dt=None: torch.zeros(*s, dtype=dt or self.dtype, device=self.device)
        # The engine's P goes through the token slots (no host read); the counted path's buffers
        # (notify/move, the ExpertComm contract DeepEP shares) are made on its first use.
        from .token_slots import TokenSlots   # torch: not at import (deepep_comm imports this module)
        self.slots_p = TokenSlots(self.ep, self.e_local, hidden, topk, max_tokens, self.dtype, self.device)
        self._p = PhaseState(
            Phase.PREFILL, groups[Phase.PREFILL], self.qps.prefill, "p-expert",
            buffers=[{} for _ in range(p_buffers)],
            counters=[z(2, self.ep, dt=torch.int64) for _ in range(p_buffers)],
            workspace=z(max_tokens * topk, dt=torch.int64), status=["free"] * p_buffers,
            slots=self.slots_p.buffers)
        # D: the token slots too (a token once to each peer holding one of its experts, no host read),
        # double-buffered: `rows` a peer, the step's rank-shared bound (a graph's bucket); at most
        # d_max_tokens rows a dispatch
        d_rows = d_max_tokens or max_tokens
        self.slots_d = [TokenSlots(self.ep, self.e_local, hidden, topk, d_rows, self.dtype, self.device) for _ in range(2)]
        self._d = PhaseState(
            Phase.DECODE, groups[Phase.DECODE], self.qps.decode, "d-expert",
            buffers=[ts.buffers for ts in self.slots_d],
            counters=[z(self.ep, dt=torch.int64) for _ in range(2)],
            workspace=z(d_rows * topk, dt=torch.int64), status=["free", "free"])
        self._lock = threading.Lock()
        self.cap = d_rows   # D's rows a peer
        from .host_read import HostReader
        self.reader = HostReader(self.device)   # per-phase pinned buffers for the host reads

    def state(self, phase: Phase) -> PhaseState:
        return self._p if Phase(phase) is Phase.PREFILL else self._d

    def _route(self, topk_ids, valid=None):
        """(flat ids, destination peer per pair, pairs sorted by peer, pairs per peer over ep + 1
        bins, token of each sorted pair). Pairs of rows with `valid` False go to the spare peer
        index `ep`, sorted last."""
        torch = self.torch
        flat = topk_ids.reshape(-1).long()
        dest = flat // self.e_local
        if valid is not None:
            dest = torch.where(valid.repeat_interleave(self.topk), dest, self.ep)
        order = torch.argsort(dest, stable=True)
        # scatter_add, not bincount: bincount on CUDA reads the max back to the host, which would
        # drain P's stream at every notify and leave no P work in flight to overlap D.
        per_peer = torch.zeros(self.ep + 1, dtype=torch.int64, device=dest.device).scatter_add_(
            0, dest, torch.ones_like(dest))
        token_of = order // self.topk
        return flat, dest, order, per_peer, token_of

    # ---- P: normal path, split ------------------------------------------------------
    def notify(self, phase, hidden, topk_ids, topk_weights) -> PendingDispatch:
        if Phase(phase) is not Phase.PREFILL:
            raise ExpertCommError("the split notify/move dispatch is the P (normal) path")
        st = self._p
        with self._lock:
            b = st.claim()
        if not st.buffers[b]:
            z = lambda n: self.torch.zeros(n, self.hidden, dtype=self.dtype, device=self.device)
            st.buffers[b].update(recv=z(self._cap_p), back=z(self.max_tokens * self.topk))
        flat, _, order, per_peer, token_of = self._route(topk_ids)
        send_counts = per_peer[:self.ep]
        cnt = st.counters[b]
        cnt[0].copy_(send_counts)
        work = self.dist.all_to_all_single(cnt[1], cnt[0], group=st.group, async_op=True)
        st.issued += 1
        state = {"hidden": hidden, "order": order, "flat": flat, "token_of": token_of,
                 "weights": topk_weights.reshape(-1)[order], "send_counts": send_counts}   # host list in move
        return PendingDispatch(b, hidden.shape[0], work, state)

    def _counts(self, pending: PendingDispatch) -> tuple[list[int], list[int]]:
        """Once the count exchange is done: rows sent to and received from each peer, in one host read."""
        pending.work.wait()
        both = self.reader.read("prefill", self._p.counters[pending.buffer])
        return both[:self.ep], both[self.ep:]

    def wait_counts(self, pending: PendingDispatch) -> list[int]:
        return self._counts(pending)[1]

    def move(self, pending: PendingDispatch):
        pending.check_movable()
        st, s = self._p, pending.state
        s["send_counts"], recv_counts = self._counts(pending)   # after the permit: the split sizes
        n_recv = sum(recv_counts)
        buf = st.buffers[pending.buffer]
        if n_recv > buf["recv"].shape[0]:
            raise ExpertCommError(f"P buffer holds {buf['recv'].shape[0]} rows, {n_recv} routed here")
        rows = s["hidden"].index_select(0, s["token_of"]).to(self.dtype)
        recv = buf["recv"][:n_recv]
        self.dist.all_to_all_single(recv, rows, recv_counts, s["send_counts"], group=st.group)
        ids = self.torch.empty(n_recv, dtype=self.torch.int64, device=self.device)
        self.dist.all_to_all_single(ids, s["flat"][s["order"]] % self.e_local, recv_counts, s["send_counts"],
                                    group=st.group)
        st.status[pending.buffer] = "moved"
        st.issued += 2
        s["recv_counts"] = recv_counts
        return recv, RecvMeta("rows", ids, recv_counts, Phase.PREFILL), \
            Handle(Phase.PREFILL, pending.buffer, pending.tokens, s)

    def cancel(self, pending: PendingDispatch) -> None:
        """Plan-driven on every rank alike. The notification cannot be revoked: retire the buffer."""
        pending.cancelled = True
        self._p.status[pending.buffer] = "retired"
        self._p.events.append(pending.work)

    def quiesce(self) -> int:
        """Cleanup point with no P dispatch in flight: drain retired notifications, free buffers."""
        st = self._p
        for w in st.events:
            w.wait()
        st.events.clear()
        return st.free_retired()

    def _exchange_p(self, out, inp) -> None:
        self._exchange(self._p, out, inp)

    def _exchange_d(self, out, inp) -> None:
        self._exchange(self._d, out, inp)

    def _exchange(self, st: PhaseState, out, inp) -> None:
        self.dist.all_to_all_single(out, inp, group=st.group)
        st.issued += 1
        st.sent += inp.numel() * inp.element_size() * (self.ep - 1) // self.ep   # its own slice stays

    # ---- D: low-latency path ---------------------------------------------------------
    def _dispatch_ll(self, hidden, topk_ids, topk_weights, valid=None, rows=None):
        """One fixed-shape exchange with no host read into D's token slots (double-buffered): each token
        once to every peer holding one of its experts, `rows` slots a peer (the rank-shared bound on any
        member's rows this step, so every member sends the same shape). `valid` ([T] bool): padding rows
        go to no peer. The receiver keeps the [ep, rows] layout, so D's whole iteration can be enqueued
        without waiting for the GPU."""
        st = self._d
        rows = self.cap if rows is None else rows
        if max(rows, hidden.shape[0]) > self.cap or hidden.shape[0] > rows:
            raise ExpertCommError(f"LL dispatch of {hidden.shape[0]} tokens (bound {rows}) exceeds the D buffers' "
                                  f"capacity of {self.cap} tokens or the bound")
        b = st.ll_index
        st.ll_index ^= 1                              # D-owned double-buffer index
        x, ids, w, state = self.slots_d[b].dispatch(self._exchange_d, hidden, topk_ids, topk_weights, rows, valid)
        return x, RecvMeta("tokens", ids, None, Phase.DECODE, w), Handle(Phase.DECODE, b, hidden.shape[0], state)

    # ---- both -------------------------------------------------------------------------
    def dispatch(self, phase, hidden, topk_ids, topk_weights, valid=None, rows=None):
        if Phase(phase) is Phase.DECODE:
            return self._dispatch_ll(hidden, topk_ids, topk_weights, valid, rows)
        if rows is not None:   # P with a rank-shared row bound: the token slots, no host read
            if hidden.shape[0] > rows or rows > self.slots_p.max_rows:
                raise ExpertCommError(f"P dispatch of {hidden.shape[0]} tokens (bound {rows}) exceeds the bound "
                                      f"or the P slots' {self.slots_p.max_rows} rows a peer")
            x, ids, w, state = self.slots_p.dispatch(self._exchange_p, hidden, topk_ids, topk_weights, rows, valid)
            return x, RecvMeta("tokens", ids, None, Phase.PREFILL, w), Handle(Phase.PREFILL, -1, hidden.shape[0], state)
        if valid is not None:
            raise ExpertCommError("a row-validity mask needs a row bound (fixed slots)")
        p = self.notify(phase, hidden, topk_ids, topk_weights)
        p.permitted = True  # unsplit call: the caller holds the permit already
        return self.move(p)

    def combine(self, phase, expert_out, handle: Handle):
        torch, s = self.torch, handle.state
        if Phase(phase) is not handle.phase:
            raise ExpertCommError(f"combine({Phase(phase).value}) of a {handle.phase.value} handle")
        if s.get("kind") == "tokens":
            if handle.phase is Phase.DECODE:
                return self.slots_d[handle.buffer].combine(self._exchange_d, expert_out, s)
            return self.slots_p.combine(self._exchange_p, expert_out, s)
        if handle.phase is Phase.PREFILL:   # the counted path
            st = self._p
            back = st.buffers[handle.buffer]["back"][:s["order"].numel()]
            self.dist.all_to_all_single(back, expert_out.to(self.dtype).contiguous(), s["send_counts"],
                                        s["recv_counts"], group=st.group)
            st.issued += 1
            st.status[handle.buffer] = "free"
        # weight and sum in fp32, round once (as DeepEP's combine does); unchanged for fp32 rows
        out = torch.zeros(handle.tokens, self.hidden, dtype=torch.float32, device=self.device)
        out.index_add_(0, s["token_of"], back.float() * s["weights"].float()[:, None])
        return out.to(self.dtype)

    def apply_experts(self, recv_hidden, meta: RecvMeta, fn: Callable[[int, Any], Any]):
        """expert_out in the backend's layout: fn(local_expert_id, rows) -> rows; empty slots (id -1)
        give zeros. Rows grouped by expert with a stable sort (each expert sees its rows in arrival
        order) and one host read of the per-expert counts. The engine's D path does not come here:
        it runs the slots through grouped GEMMs (`RankCollectives`), with no host read."""
        torch, ids = self.torch, meta.expert_ids
        if meta.layout == "tokens":   # k global ids a slot: the weighted partial sum over this rank's experts
            lo = self.rank_in_ep * self.e_local
            out = torch.zeros_like(recv_hidden)
            for e in range(self.e_local):
                w = torch.where(ids == lo + e, meta.weights, torch.zeros_like(meta.weights)).sum(1)
                rows = (w != 0).nonzero()[:, 0]
                if rows.numel():
                    out[rows] += w[rows, None].to(out.dtype) * fn(e, recv_hidden[rows])
            return out
        key = torch.where(ids >= 0, ids, self.e_local)
        order = torch.argsort(key, stable=True)
        per_expert = torch.zeros(self.e_local + 1, dtype=torch.int64, device=ids.device).scatter_add_(
            0, key, torch.ones_like(key))
        counts = self.reader.read(Phase(meta.phase or Phase.PREFILL).value, per_expert)
        grouped = recv_hidden.index_select(0, order)
        out_grouped = torch.zeros_like(recv_hidden)
        lo = 0
        for e, n in enumerate(counts[:self.e_local]):
            if n:
                out_grouped[lo:lo + n] = fn(e, grouped[lo:lo + n])
            lo += n
        return torch.empty_like(recv_hidden).index_copy_(0, order, out_grouped)
