"""DeepEP backend of phase-owned expert communication (GPU images only; imports deep_ep lazily).

P owns a normal-mode Buffer (NVLink-only on one node: no NVSHMEM), D owns a low-latency Buffer
(NVSHMEM; QPs [0,s)). Across nodes both need NVSHMEM in one shared runtime with split QP ranges
(DESIGN §4), which stock DeepEP does not offer (DeepEP issue #76): `nodes > 1` raises.
Stock DeepEP's normal dispatch performs notify and data movement in one call, so the split P
path here computes the layout (local) at notify and places the turnstile permit before the
whole dispatch; a true notify/move split needs the paper's patched kernels.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from .expert_comm import (ExpertComm, ExpertCommError, Handle, PendingDispatch, PermitMissingError, Phase,
                          PhaseState, RecvMeta)
from .netenv import ll_rdma_bytes_hint, normal_nvl_bytes_hint, nvshmem_env, qp_split


class DeepEPExpertComm(ExpertComm):
    def __init__(self, group: Any, num_experts: int, hidden: int, max_tokens: int, topk: int,
                 nodes: int = 1, ll_max_tokens_per_rank: int = 128, apply_env: bool = True) -> None:
        if nodes > 1:
            raise ExpertCommError("two RDMA DeepEP Buffers in one process need the shared-runtime, "
                                  "split-QP DeepEP of DESIGN §4; stock deep_ep supports one node here")
        import torch
        import torch.distributed as dist
        import deep_ep  # noqa: F401  (GPU images only)
        self.torch, self.deep_ep = torch, deep_ep
        ep = dist.get_world_size(group)
        self.num_experts, self.hidden, self.topk = num_experts, hidden, topk
        self.e_local = num_experts // ep
        self.qps = qp_split(self.e_local)
        self.ll_max = ll_max_tokens_per_rank
        if apply_env:  # before the LL Buffer initializes NVSHMEM
            for k, v in nvshmem_env(self.e_local).items():
                os.environ.setdefault(k, v)
        nvl = normal_nvl_bytes_hint(max_tokens, hidden, ep, topk)
        hint = getattr(deep_ep.Buffer, "get_low_latency_rdma_size_hint", None)
        rdma = hint(self.ll_max, hidden, ep, num_experts) if hint else ll_rdma_bytes_hint(
            self.ll_max, hidden, ep, num_experts)
        self.p_buffer = deep_ep.Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=0)
        self.d_buffer = deep_ep.Buffer(group, num_nvl_bytes=0, num_rdma_bytes=rdma, low_latency_mode=True,
                                       num_qps_per_rank=self.e_local)
        self.p_stream, self.d_stream = torch.cuda.Stream(), torch.cuda.Stream()
        self._p = PhaseState(Phase.PREFILL, self.p_buffer, self.qps.prefill, "p-expert", [], [],
                             None, status=["free"])
        self._d = PhaseState(Phase.DECODE, self.d_buffer, self.qps.decode, "d-expert", [], [], None,
                             status=["free", "free"])

    def state(self, phase: Phase) -> PhaseState:
        return self._p if Phase(phase) is Phase.PREFILL else self._d

    def notify(self, phase, hidden, topk_ids, topk_weights) -> PendingDispatch:
        if Phase(phase) is not Phase.PREFILL:
            raise ExpertCommError("the split notify/move dispatch is the P (normal) path")
        if self._p.status[0] != "free":
            raise ExpertCommError(f"P buffer is {self._p.status[0]}: one pending dispatch per buffer")
        self._p.status[0] = "pending"
        with self.torch.cuda.stream(self.p_stream):
            layout = self.p_buffer.get_dispatch_layout(topk_ids, self.num_experts)
        done = self.torch.cuda.Event()
        done.record(self.p_stream)
        work = type("LayoutWork", (), {"is_completed": lambda s: done.query(), "wait": lambda s: done.synchronize()})()
        return PendingDispatch(0, hidden.shape[0], work,
                               {"hidden": hidden, "topk_ids": topk_ids, "weights": topk_weights, "layout": layout})

    def move(self, pending: PendingDispatch):
        if not pending.permitted:
            raise PermitMissingError("move() before the turnstile permit (wait_permit first)")
        s = pending.state
        per_rank, per_rdma, per_expert, in_rank, _ = s["layout"]
        with self.torch.cuda.stream(self.p_stream):
            recv_x, recv_ids, recv_w, counts, handle, _ = self.p_buffer.dispatch(
                s["hidden"], topk_idx=s["topk_ids"], topk_weights=s["weights"], num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        self._p.status[0] = "moved"
        meta = RecvMeta("topk", recv_ids, counts)
        meta.weights = recv_w
        return recv_x, meta, Handle(Phase.PREFILL, 0, pending.tokens, {"handle": handle})

    def cancel(self, pending: PendingDispatch) -> None:
        pending.cancelled = True
        self._p.status[0] = "retired"

    def quiesce(self) -> int:
        self.p_stream.synchronize()
        n = self._p.status.count("retired")
        self._p.status = ["free"]
        return n

    def dispatch(self, phase, hidden, topk_ids, topk_weights):
        if Phase(phase) is Phase.PREFILL:
            p = self.notify(phase, hidden, topk_ids, topk_weights)
            p.permitted = True
            return self.move(p)
        with self.torch.cuda.stream(self.d_stream):
            recv_x, recv_count, handle, _, _ = self.d_buffer.low_latency_dispatch(
                hidden, topk_ids, self.ll_max, self.num_experts, use_fp8=False)
        self._d.ll_index ^= 1  # mirrors DeepEP's internal LL double buffer
        return recv_x, RecvMeta("ll", None, recv_count), Handle(Phase.DECODE, self._d.ll_index, hidden.shape[0],
                                                                {"handle": handle, "topk_ids": topk_ids,
                                                                 "weights": topk_weights})

    def combine(self, phase, expert_out, handle: Handle):
        s = handle.state
        if Phase(phase) is Phase.PREFILL:
            with self.torch.cuda.stream(self.p_stream):
                out, _, _ = self.p_buffer.combine(expert_out, s["handle"])
            self._p.status[0] = "free"
            return out
        with self.torch.cuda.stream(self.d_stream):
            out, _, _ = self.d_buffer.low_latency_combine(expert_out, s["topk_ids"], s["weights"], s["handle"])
        return out

    def apply_experts(self, recv_hidden, meta: RecvMeta, fn: Callable[[int, Any], Any]):
        torch = self.torch
        if meta.layout == "ll":  # [E_local, cap, H]; rows past the count are padding
            out = torch.zeros_like(recv_hidden)
            for e in range(recv_hidden.shape[0]):
                n = int(meta.counts[e])
                if n:
                    out[e, :n] = fn(e, recv_hidden[e, :n])
            return out
        out = torch.zeros_like(recv_hidden)  # normal: weight each local expert's rows here
        for e in range(self.e_local):
            m = (meta.expert_ids == e)
            rows = m.any(dim=1)
            if rows.any():
                w = (meta.weights * m).sum(dim=1)[rows]
                out[rows] += fn(e, recv_hidden[rows]) * w[:, None].to(out.dtype)
        return out
