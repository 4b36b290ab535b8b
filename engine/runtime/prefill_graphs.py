"""Piecewise CUDA graphs of the P forward on one rank: every forward that carries prefill (a P
epoch, `normal`'s P step, `mixed`'s fused step) replays captured pieces instead of issuing ~35 eager
kernels a layer from Python.

Why: a P epoch at P1 carries 160-320 new tokens, and its thread spent 50-90 ms issuing an eager
forward whose kernels take ~27 ms (docs/PERF.md, "Defaults"); every first token in the epoch waited for that
host time. D has had graphs from the start because its shapes are fixed; P's are not, in two ways:
- the token count: rows are padded up to a bucket (ids and positions stale, slots the KV cache's
  null slot, so padding writes no real K/V; `live` 0, so its stale tokens route to no expert, as a
  decode graph's padding does: P forwards faster (docs/PERF.md), the real rows' logits
  bitwise those of routed padding and of the eager forward; `qwen3_moe.SKIP_P_PADDING_ROUTES`), and
  one set of pieces is captured per bucket;
- the segments (how many, how long, how much context): only the attention reads them, so the
  attention stays eager and the graph is cut around it, as SGLang's and vLLM's piecewise graphs do.
  A layer is then one replay and one attention launch.

The pieces are the model's own calls (Qwen3MoeModel.embed/enter/project/after_attention/logits),
so the graphed forward is the eager one cut at each attention, reading and writing static buffers:
  head      embed, RoPE tables, layer 0's input norm and project (q/k/v, norm, RoPE, KV write)
  layer i   layer i-1 from o_proj to layer i's project
  tail      the last layer from o_proj to the final residual add
The final norm and lm_head run eagerly on the sampled rows only (padding would cost a vocab GEMM).

On several ranks at ATP1 with the torch expert backend too: P's expert exchange goes through fixed
token slots (token_slots.py, no host read), every rank pads to the bucket of the largest replica's
rows (the plan is rank-shared, so all replay one bucket and their all-to-alls match), and padding
rows are sent to no peer. Not at ATP > 1 (P's AllReduce buffers follow each replica's rows), not
with DeepEP (its normal path reads dispatch sizes on the host), and on CUDA not where a turnstile
permit sits inside the forward (a replay would skip it). Not for routing replay
(the pieces keep no expert ids). MTP's hidden states come out of the eager final norm, over the
real rows (a new tensor: the next replay cannot overwrite it). Without `graphs` (CPU, tests) the pieces run
eagerly through the same buffers and padding.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..model.qwen3_moe import ForwardBatch
from ..protocol.plan import Phase
from .collectives import PathContext

# From 32 tokens on, padding costs a bucket at most 1.5× the tokens: in P's kernels (MoE GEMMs, projections), never in
# its attention (eager, real rows only).
BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def buckets(max_tokens: int) -> list[int]:
    if max_tokens < 1:
        raise ValueError(f"prefill graphs need a token bound >= 1, got {max_tokens}")
    return [b for b in BUCKETS if b < max_tokens] + [max_tokens]


class PrefillGraphs:
    def __init__(self, model, kv, max_tokens: int, graphs: bool = True, collectives=None, replicas: int = 1):
        self.model, self.kv, self.graphs = model, kv, graphs
        self.col, self.replicas = collectives, replicas   # several ranks: RankCollectives, ADP
        self.layers = model.model.layers
        self.buckets = buckets(max_tokens)
        n, dev = self.buckets[-1], kv.k[0].device
        attn = self.layers[0].self_attn
        dtype = model.model.embed_tokens.weight.dtype
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), kv.null_slot, dtype=torch.long, device=dev)
        self.live = torch.zeros(n, dtype=torch.int32, device=dev)   # 0: padding (qwen3_moe.SKIP_P_PADDING_ROUTES)
        self.x = torch.zeros(n, model.cfg.hidden_size, dtype=dtype, device=dev)             # residual stream
        self.q = torch.zeros(n, attn.heads, attn.head_dim, dtype=dtype, device=dev)         # the next attention's queries
        self.o = torch.zeros(n, attn.heads * attn.head_dim, dtype=dtype, device=dev)        # its output (real rows)
        self.cos = torch.zeros(n, attn.head_dim, dtype=dtype, device=dev)   # ops.rope_cos_sin's rows
        self.sin = torch.zeros_like(self.cos)
        # bucket -> the pieces, in order: head, layers 1..L-1, tail (graph replays, or eager calls)
        self.pieces: dict[int, list[Callable[[], None]]] = {}
        self.replays = 0      # forwards served by the pieces (the step log and tests read it)

    # ---- the pieces ---------------------------------------------------------------------------
    def _stub(self, b: int) -> ForwardBatch:
        """What the MLP pieces read of a batch: its phase, its live rows (padding: 0) and no routing
        ids (one rank: no comm)."""
        return ForwardBatch(self.input_ids[:b], self.positions[:b], self.slot_mapping[:b], [],
                            self.positions[:0], phase=Phase.PREFILL, live=self.live[:b])

    def _head(self, b: int) -> None:
        m, kv = self.model, self.kv
        x, cos, sin = m.embed(self.input_ids[:b], self.positions[:b])
        self.cos[:b].copy_(cos)
        self.sin[:b].copy_(sin)
        x, h = m.enter(self.layers, x)
        self.x[:b].copy_(x)
        self.q[:b].copy_(self.layers[0].self_attn.project(h, cos, sin, kv.k[0], kv.v[0], self.slot_mapping[:b]))

    def _layer(self, b: int, i: int, stub: ForwardBatch) -> None:
        """Layer i-1 from its attention output to layer i's queries (the tail when i is past the last)."""
        x, h = self.model.after_attention(self.layers, i - 1, self.x[:b], self.o[:b], stub)
        self.x[:b].copy_(x)
        if h is not None:
            self.q[:b].copy_(self.layers[i].self_attn.project(h, self.cos[:b], self.sin[:b], self.kv.k[i],
                                                              self.kv.v[i], self.slot_mapping[:b]))

    def _calls(self, b: int) -> list[Callable[[], None]]:
        stub = self._stub(b)
        return [lambda: self._head(b)] + [lambda i=i: self._layer(b, i, stub) for i in range(1, len(self.layers) + 1)]

    def _begin(self, b: int, step: int = -1, boundary=None) -> None:
        """Several ranks: P's collectives see every replica at the bucket, padding marked by `live`."""
        if self.col is not None:
            self.col.begin("p", PathContext(step, [b] * self.replicas, boundary, live=self.live[:b]))

    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket's pieces, largest first into one memory pool (replays never overlap: one P
        forward at a time). Padding and capture write K/V only to the null slot. Without `graphs`
        the pieces are the eager calls themselves."""
        self.slot_mapping.fill_(self.kv.null_slot)
        if not self.graphs:
            self.pieces = {b: self._calls(b) for b in self.buckets}
            return
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in reversed(self.buckets):
                self._begin(b)
                for call in self._calls(b):   # warm-up: Triton compiles, cuBLAS picks per shape
                    call()
            torch.cuda.synchronize()
            for b in reversed(self.buckets):
                self._begin(b)
                graphs = []
                for call in self._calls(b):
                    g = torch.cuda.CUDAGraph()
                    # thread_local: the watchdog and D's thread touch streams while we capture
                    with torch.cuda.graph(g, pool=pool, stream=side, capture_error_mode="thread_local"):
                        call()
                    graphs.append(g.replay)
                self.pieces[b] = graphs
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def drop(self) -> None:
        """Forget the pieces (a memory release is about to move what they read): forwards run
        eagerly until capture() runs again."""
        self.pieces = {}

    # ---- a forward ----------------------------------------------------------------------------
    def fits(self, batch: ForwardBatch, shared: int | None = None) -> bool:
        """`shared`: several ranks, the largest replica's rows (rank-shared; routes then none anywhere)."""
        t = batch.input_ids.shape[0] if shared is None else shared
        return 0 < t <= self.buckets[-1] and batch.routes is None and bool(self.pieces)

    def bucket(self, t: int) -> int:
        return next(b for b in self.buckets if b >= t)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, shared: int | None = None) -> torch.Tensor:
        """The model's forward of `batch` (fits() holds) on the current stream: fp32 logits of its
        sampled rows. The buffers are reused by the next forward once this one's kernels ran.
        `shared`: several ranks, the largest replica's rows (this rank may have none)."""
        t = batch.input_ids.shape[0]
        b = self.bucket(t if shared is None else shared)
        if self.col is not None:   # eager pieces (CPU) read it; replays hold what capture saw
            ctx = self.col.ctx["p"]
            self._begin(b, ctx.step, ctx.boundary)
        self.input_ids[:t].copy_(batch.input_ids)
        self.positions[:t].copy_(batch.positions)
        self.slot_mapping[:t].copy_(batch.slot_mapping)
        if t < b:   # the last forward's slots: padding must not write real K/V
            self.slot_mapping[t:b].fill_(self.kv.null_slot)
        self.live[:t].fill_(1)   # read by pieces captured with SKIP_P_PADDING_ROUTES on
        self.live[t:b].zero_()
        pieces = self.pieces[b]
        pieces[0]()
        for i, layer in enumerate(self.layers):
            self.o[:t].copy_(layer.self_attn.attend(self.q[:t], self.kv.k[i], self.kv.v[i], batch))
            pieces[i + 1]()
        self.replays += 1
        return self.model.logits(self.x[:t], batch)
