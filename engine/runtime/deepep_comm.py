"""DeepEP backend of phase-owned expert communication (GPU images only; imports deep_ep lazily).

Written against stock DeepEP v1.2.1 (`deep_ep.Buffer`). On one node:
* **P owns normal-mode Buffers** (`num_nvl_bytes` only): NVLink IPC ring buffers, no NVSHMEM, so
  P uses none of the runtime's QPs here; its QP range [s, 2s) stays reserved for two nodes.
  Each Buffer brings its own comm stream, 32 MiB workspace and host-mapped receive counters.
* **D owns one low-latency Buffer** (`num_rdma_bytes`, `low_latency_mode=True`): NVSHMEM symmetric
  memory, its own comm stream, workspace and LL double-buffer index. NVLink P2P carries LL
  traffic between the GPUs of a node (IBGDA needs NICs). Its `num_qps_per_rank` is the shared
  runtime's total 2s (`netenv.qp_split`): DeepEP writes it to `NVSHMEM_IBGDA_NUM_RC_PER_PE`, the
  same figure `netenv.nvshmem_env` gives the operator, and its LL kernels use QP index = local
  expert index, i.e. exactly D's range [0, s) (DeepEP requires >= s RC QPs per PE).
* Lanes: P work runs on `p_stream`, D work on `d_stream` (or on the caller's stream while it is
  capturing a CUDA graph, so the decode graph can hold the LL dispatch/combine). Each call joins
  its lane to the caller's stream and back, so a caller already on the lane pays nothing.

Split P dispatch, mapped onto stock DeepEP:
  notify      -> `get_dispatch_layout` on the P lane (send counts per rank/expert, which ranks get
                 which token); an event marks the counts ready (`counts_ready`).
  wait_permit -> the turnstile permit (nothing of DeepEP's runs here).
  move        -> `dispatch(x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                 topk_idx, topk_weights)`.
What stock DeepEP cannot split: the cross-rank count exchange (`notify_dispatch`), the host's
wait for the receive counts and the data kernel all happen inside the one `dispatch` call, so the
permit sits *before* the count exchange and `wait_counts` returns the local send counts. In the
intranode path that host wait spins with the GIL held (only the internode path releases it): a
P thread in `move` stalls the process's other Python threads until every peer has notified.
A true notify/move split needs patched kernels (the paper's). Cancel: nothing was exchanged at
notify, but the protocol rule (retire until a quiescent point) is kept for backend parity.

Across nodes both phases need NVSHMEM in one shared runtime with split QP ranges (docs/DISTRIBUTED.md),
which stock DeepEP does not offer (two RDMA Buffers in one process, DeepEP issue #76):
`nodes > 1` raises.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

from .expert_comm import ExpertComm, ExpertCommConfigError, ExpertCommError, Handle, PendingDispatch, Phase, PhaseState, RecvMeta, disjoint
from ..protocol.netenv import ALIGN, DEEP_EP_INTRANODE_RANKS, local_experts, nvshmem_env, qp_split_from_env

# Compile-time switches of stock DeepEP v1.2.1, checked before any Buffer is made (a kernel
# assertion on the GPU is far costlier than a ValueError here).
LL_HIDDEN = (2048, 2560, 4096, 5120, 6144, 7168, 8192)   # low-latency kernels' hidden sizes
LL_MAX_TOPK = 11
NORMAL_RANKS = DEEP_EP_INTRANODE_RANKS                     # intranode normal kernels
DEFAULT_LL_MAX_TOKENS = 128


def check_shapes(num_experts: int, ep: int, hidden: int, topk: int, ll_max_tokens_per_rank: int) -> list[str]:
    """Problems that stock DeepEP would assert on (empty when both phases can run)."""
    out = []
    if ep not in NORMAL_RANKS:
        out.append(f"normal (P) kernels run on {NORMAL_RANKS} ranks of one node, not {ep}")
    if ep < 1 or num_experts % ep:
        out.append(f"{num_experts} experts do not divide over EP {ep}")
    if hidden not in LL_HIDDEN:
        out.append(f"low-latency (D) kernels support hidden in {LL_HIDDEN}, not {hidden}")
    if (hidden * 2) % 16:
        out.append(f"hidden {hidden} bf16 rows are not a multiple of 16 bytes")
    if not 1 <= topk <= LL_MAX_TOPK:
        out.append(f"low-latency top-k must be 1..{LL_MAX_TOPK}, got {topk}")
    if ll_max_tokens_per_rank < 1 or (ep * ll_max_tokens_per_rank) % 4:
        out.append(f"EP x LL max tokens per rank ({ep} x {ll_max_tokens_per_rank}) must be a positive multiple of 4")
    return out


def lane_problems(streams: dict[str, int], rc_per_pe: int | None, qps) -> list[str]:
    """Run-time audit beyond `disjoint()`: every lane and comm stream distinct; the NVSHMEM RC QPs
    per PE cover both phases' ranges with D's LL traffic inside [0, s)."""
    out = []
    seen: dict[int, str] = {}
    for name, sid in streams.items():
        if sid in seen:
            out.append(f"streams {seen[sid]} and {name} are one stream ({sid:#x})")
        seen[sid] = name
    if rc_per_pe is None:
        out.append("NVSHMEM_IBGDA_NUM_RC_PER_PE unset after the LL Buffer initialized")
    elif rc_per_pe != qps.total:
        out.append(f"NVSHMEM RC QPs per PE {rc_per_pe} != 2s = {qps.total} (D {qps.decode}, P {qps.prefill})")
    return out


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _EventWork:
    """`PendingDispatch.work` for DeepEP: the layout (send counts) is ready when its event is."""

    def __init__(self, event) -> None:
        self.event = event

    def is_completed(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


class DeepEPExpertComm(ExpertComm):
    """Same constructor arguments as `TorchExpertComm` (so `make_expert_comm` can swap them);
    `d_max_tokens` is D's `num_max_dispatch_tokens_per_rank`. Collective: every EP member makes
    it (two `new_group`s per EP group, D then P, as the torch backend) and calls the same methods
    in the same order per phase."""

    def __init__(self, ep_ranks: list[list[int]], rank: int, num_experts: int, hidden: int, max_tokens: int,
                 topk: int, dtype=None, p_buffers: int = 1, p_capacity_rows: int | None = None,
                 d_max_tokens: int | None = None, *, nodes: int = 1, apply_env: bool = True,
                 num_nvl_bytes: int | None = None, device=None, host_sync: bool = False) -> None:
        if nodes > 1:
            raise ExpertCommConfigError("two RDMA DeepEP Buffers in one process need the shared-runtime, "
                                  "split-QP DeepEP of docs/DISTRIBUTED.md; stock deep_ep supports one node here")
        import torch
        import torch.distributed as dist
        import deep_ep  # GPU images only
        self.torch, self.deep_ep, self.dist = torch, deep_ep, dist
        if dtype not in (None, torch.bfloat16):
            raise ExpertCommConfigError(f"DeepEP moves bf16 rows (dtype {dtype})")
        self.dtype = torch.bfloat16
        mine = next(g for g in ep_ranks if rank in g)
        self.ep, self.rank_in_ep = len(mine), list(mine).index(rank)
        self.num_experts, self.hidden, self.topk, self.max_tokens = num_experts, hidden, topk, max_tokens
        self.e_local = local_experts(num_experts, self.ep)
        self.ll_max = d_max_tokens or DEFAULT_LL_MAX_TOKENS
        problems = check_shapes(num_experts, self.ep, hidden, topk, self.ll_max)
        if problems:
            raise ExpertCommConfigError("; ".join(problems))
        try:   # the operator's split (spec.network.nvshmem.qpsPerRank), or the engine's own
            self.qps = qp_split_from_env(os.environ, self.e_local)
        except ValueError as e:
            raise ExpertCommConfigError(str(e)) from None
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        groups = {}
        for ph in (Phase.DECODE, Phase.PREFILL):  # one communicator per phase (Buffer setup exchanges)
            for g in ep_ranks:
                pg = dist.new_group(list(g))
                if g is mine:
                    groups[ph] = pg
        # host_sync: a CPU (gloo) barrier of P's EP group right before the normal dispatch. The
        # intranode dispatch waits for the peers' counts spinning with the GIL held; entering it
        # only once every peer is about to, keeps that spin short, so the process's other threads
        # (the foreground's turnstile rounds, D's launches) are not starved while a peer is still
        # waiting for its permit. Opt-in and made on every member alike (a group creation).
        self._host_group = None
        if host_sync:
            for g in ep_ranks:
                pg = dist.new_group(list(g), backend="gloo")
                if g is mine:
                    self._host_group = pg

        # P: normal mode over NVLink; sized by DeepEP's own chunked ring-buffer hint (independent of T)
        Buffer = deep_ep.Buffer
        cfgs = (Buffer.get_dispatch_config(self.ep), Buffer.get_combine_config(self.ep))
        self.num_nvl_bytes = num_nvl_bytes or _align(max(c.get_nvl_buffer_size_hint(hidden * 2, self.ep)
                                                         for c in cfgs))
        self.p_bufs = [Buffer(groups[Phase.PREFILL], num_nvl_bytes=self.num_nvl_bytes, num_rdma_bytes=0)
                       for _ in range(p_buffers)]

        # D: low-latency mode; NVSHMEM reads its environment when the runtime initializes
        self.env = nvshmem_env(len(self.qps.decode))
        if apply_env:   # operator-injected values (same netenv arithmetic) win
            for k, v in self.env.items():
                os.environ.setdefault(k, v)
        self.num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(self.ll_max, hidden, self.ep, num_experts)
        self.d_buf = Buffer(groups[Phase.DECODE], num_rdma_bytes=self.num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=self.qps.total)
        # DeepEP rewrites some NVSHMEM variables itself (e.g. IBGDA=1); record where it differs
        self.env_overrides = {k: (v, os.environ.get(k)) for k, v in self.env.items() if os.environ.get(k) != v}

        dev, i32 = self.device, torch.int32
        self.p_stream, self.d_stream = torch.cuda.Stream(device=dev), torch.cuda.Stream(device=dev)
        u8 = torch.uint8
        self._p = PhaseState(
            Phase.PREFILL, groups[Phase.PREFILL], self.qps.prefill, "p-expert",
            buffers=[{"nvl": b.get_local_buffer_tensor(u8)} for b in self.p_bufs],
            # per buffer: tokens sent per rank | per expert (the layout's counts, written at notify)
            counters=[torch.zeros(self.ep + num_experts, dtype=i32, device=dev) for _ in self.p_bufs],
            # tokens received per local expert by the last move of each buffer (host side)
            workspace=torch.zeros(p_buffers, self.e_local, dtype=i32, device="cpu"),
            status=["free"] * p_buffers)
        self._d = PhaseState(
            Phase.DECODE, groups[Phase.DECODE], self.qps.decode, "d-expert",
            buffers=[{"rdma": self.d_buf.get_local_buffer_tensor(u8, use_rdma_buffer=True)}],
            # received rows per local expert, per LL buffer index (graph-capturable copies)
            counters=[torch.zeros(self.e_local, dtype=i32, device=dev) for _ in range(2)],
            # combined outputs, double-buffered: a result stays valid across the next D round
            workspace=torch.zeros(2, self.ll_max, hidden, dtype=self.dtype, device=dev),
            status=["free", "free"])
        self._d_out = 0

    def _inputs(self, hidden, topk_ids, topk_weights):
        """bf16 rows, int64 ids, fp32 weights. An empty chunk (a rank with no rows this step) is
        padded to one zero row routed with weight 0: stock DeepEP asserts on null data pointers
        of empty tensors; combine returns the caller's row count."""
        torch = self.torch
        x = hidden.to(self.dtype).contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        w = topk_weights.to(torch.float32).contiguous()
        if x.shape[0] == 0:
            x = torch.zeros(1, self.hidden, dtype=self.dtype, device=self.device)
            ids = (torch.arange(self.topk, device=self.device) % self.num_experts).view(1, -1)
            w = torch.zeros(1, self.topk, dtype=torch.float32, device=self.device)
        return x, ids, w

    # ---- lanes --------------------------------------------------------------------------
    @contextlib.contextmanager
    def _lane(self, stream):
        """Run on the phase's stream, ordered after the caller's work; the caller's stream waits
        for it afterwards. While the caller captures a CUDA graph, stay on the capturing stream."""
        torch = self.torch
        cur = torch.cuda.current_stream(self.device)
        if cur == stream or torch.cuda.is_current_stream_capturing():
            yield None
            return
        stream.wait_stream(cur)
        with torch.cuda.stream(stream):
            yield cur
        cur.wait_stream(stream)

    @staticmethod
    def _hand_back(cur, *tensors):
        if cur is not None:   # made on the lane, used on the caller's stream: keep the allocator honest
            for t in tensors:
                if t is not None:
                    t.record_stream(cur)

    def state(self, phase: Phase) -> PhaseState:
        return self._p if Phase(phase) is Phase.PREFILL else self._d

    def comm_streams(self) -> dict[str, Any]:
        s = {"p_lane": self.p_stream, "d_lane": self.d_stream, "d_comm": self.d_buf.get_comm_stream()}
        for i, b in enumerate(self.p_bufs):
            s[f"p_comm{i}"] = b.get_comm_stream()
        return s

    def audit(self) -> dict:
        """Table 1 at run time: storages, counters, lanes, communicators, QP ranges, streams."""
        rc = os.environ.get("NVSHMEM_IBGDA_NUM_RC_PER_PE")
        streams = {k: s.cuda_stream for k, s in self.comm_streams().items()}
        problems = disjoint(self._p, self._d) + lane_problems(streams, int(rc) if rc else None, self.qps)
        if any(b.num_rdma_bytes for b in self.p_bufs):
            problems.append("a P Buffer opened NVSHMEM memory")
        runtimes = [b.runtime for b in self.p_bufs] + [self.d_buf.runtime]
        if len({id(r) for r in runtimes}) != len(runtimes):
            problems.append("phases share a DeepEP runtime")

        def span(t):
            st = t.untyped_storage()
            return [st.data_ptr(), st.nbytes()]
        return {"problems": problems, "streams": streams,
                "qp": {"decode": list(self.qps.decode), "prefill": list(self.qps.prefill), "rc_per_pe": rc},
                "storage": {ph.value: [span(t) for buf in st.buffers for t in buf.values()] +
                            [span(t) for t in st.counters] + [span(st.workspace)]
                            for ph, st in ((Phase.PREFILL, self._p), (Phase.DECODE, self._d))},
                "nvl_bytes": self.num_nvl_bytes, "rdma_bytes": self.num_rdma_bytes,
                "env_overrides": self.env_overrides}

    # ---- P: normal path, split --------------------------------------------------------
    def notify(self, phase, hidden, topk_ids, topk_weights) -> PendingDispatch:
        torch = self.torch
        if Phase(phase) is not Phase.PREFILL:
            raise ExpertCommError("the split notify/move dispatch is the P (normal) path")
        st = self._p
        b = st.claim()
        with self._lane(self.p_stream):
            x, ids, w = self._inputs(hidden, topk_ids, topk_weights)
            per_rank, per_rdma, per_expert, in_rank, _ = self.p_bufs[b].get_dispatch_layout(ids, self.num_experts)
            cnt = st.counters[b]
            cnt[:self.ep].copy_(per_rank)
            cnt[self.ep:].copy_(per_expert)
            ev = torch.cuda.Event()
            ev.record()
        st.events.append(ev)
        del st.events[:-4]
        return PendingDispatch(b, hidden.shape[0], _EventWork(ev),
                               {"x": x, "ids": ids, "w": w, "layout": (per_rank, per_rdma, per_expert, in_rank)})

    def wait_counts(self, pending: PendingDispatch) -> list[int]:
        """Tokens this rank sends to each rank (stock DeepEP exchanges receive counts inside move)."""
        pending.work.wait()
        return self._p.counters[pending.buffer][:self.ep].tolist()

    def move(self, pending: PendingDispatch):
        pending.check_movable()
        s, b = pending.state, pending.buffer
        per_rank, per_rdma, per_expert, in_rank = s["layout"]
        if self._host_group is not None:
            self.dist.barrier(group=self._host_group)   # releases the GIL while it waits
        with self._lane(self.p_stream) as cur:
            recv_x, recv_ids, recv_w, per_local, handle, _ = self.p_bufs[b].dispatch(
                s["x"], num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=s["ids"], topk_weights=s["w"])
        self._hand_back(cur, recv_x, recv_ids, recv_w)
        self._p.workspace[b] = self.torch.tensor(per_local, dtype=self.torch.int32, device="cpu")
        self._p.status[b] = "moved"
        meta = RecvMeta("topk", recv_ids, per_local)   # expert_ids: [N, K] local expert or -1
        meta.weights = recv_w                          # [N, K] float32, 0 where the id is -1
        return recv_x, meta, Handle(Phase.PREFILL, b, pending.tokens, {"handle": handle})

    def cancel(self, pending: PendingDispatch) -> None:
        pending.cancelled = True
        self._p.status[pending.buffer] = "retired"

    def quiesce(self) -> int:
        self.p_stream.synchronize()
        for b in self.p_bufs:
            b.get_comm_stream().synchronize()
        return self._p.free_retired()

    # ---- both ---------------------------------------------------------------------------
    def dispatch(self, phase, hidden, topk_ids, topk_weights):
        torch = self.torch
        if Phase(phase) is Phase.PREFILL:
            p = self.notify(phase, hidden, topk_ids, topk_weights)
            p.permitted = True   # unsplit call: the caller holds the permit already
            return self.move(p)
        st = self._d
        with self._lane(self.d_stream) as cur:
            x, ids, w = self._inputs(hidden, topk_ids, topk_weights)
            recv_x, recv_count, handle, _, _ = self.d_buf.low_latency_dispatch(
                x, ids, self.ll_max, self.num_experts, use_fp8=False)
            idx = st.ll_index
            st.counters[idx].copy_(recv_count)
        st.ll_index ^= 1   # mirrors DeepEP's LL buffer index (flips on every LL dispatch and combine)
        self._hand_back(cur, recv_x, recv_count, ids, w)
        # recv_x: [E_local, ep * ll_max, H]; rows past recv_count[e] are padding
        return recv_x, RecvMeta("ll", None, recv_count), Handle(Phase.DECODE, idx, hidden.shape[0],
                                                               {"handle": handle, "ids": ids, "w": w,
                                                                "rows": x.shape[0]})

    def combine(self, phase, expert_out, handle: Handle):
        if Phase(phase) is not handle.phase:
            raise ExpertCommError(f"combine({Phase(phase).value}) of a {handle.phase.value} handle")
        s = handle.state
        if handle.phase is Phase.PREFILL:
            with self._lane(self.p_stream) as cur:
                out, _, _ = self.p_bufs[handle.buffer].combine(expert_out.to(self.dtype).contiguous(), s["handle"])
            self._hand_back(cur, out)
            self._p.status[handle.buffer] = "free"
            return out[:handle.tokens]
        st = self._d
        slot, self._d_out = self._d_out, self._d_out ^ 1
        with self._lane(self.d_stream):
            out, _, _ = self.d_buf.low_latency_combine(expert_out.to(self.dtype).contiguous(), s["ids"], s["w"],
                                                       s["handle"], out=st.workspace[slot, :s.get("rows", handle.tokens)])
        st.ll_index ^= 1
        return out[:handle.tokens]

    def apply_experts(self, recv_hidden, meta: RecvMeta, fn: Callable[[int, Any], Any]):
        """expert_out in the backend's layout: fn(local_expert_id, rows) -> rows. Normal (P)
        combine sums without weights, so P's rows are weighted here; LL combine weights itself."""
        torch = self.torch
        if meta.layout == "ll":   # [E_local, cap, H]; rows past the count are padding
            out = torch.zeros_like(recv_hidden)
            for e, n in enumerate(meta.counts.tolist()):
                if n:
                    out[e, :n] = fn(e, recv_hidden[e, :n]).to(out.dtype)
            return out
        acc = torch.zeros(recv_hidden.shape, dtype=torch.float32, device=recv_hidden.device)
        for e in range(self.e_local):
            m = meta.expert_ids == e
            rows = m.any(dim=1).nonzero().squeeze(1)
            if rows.numel():
                w = (meta.weights * m).sum(dim=1)[rows]
                acc[rows] += fn(e, recv_hidden[rows]).float() * w[:, None]
        return acc.to(recv_hidden.dtype)
