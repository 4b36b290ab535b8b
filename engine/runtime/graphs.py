"""CUDA graphs of the decode forward, captured once per batch-size bucket, on one rank or many.

The graphs read only static, phase-owned inputs (ids, positions, slots, block tables, lengths),
so a replay is valid whether or not prefill work is active elsewhere; padding rows have length 0
and write their K/V into the reserved null slot.

On several ranks the D path's collectives (ATP all-reduce, DP all-gather and reduce-scatter, the
fixed-slot expert all-to-alls, ATP all-gather) are captured *inside* the graph: NCCL collectives of
fixed shape are capturable, every rank captures the same buckets in the same order, and a replay is
then one enqueue of the whole D iteration — the unit the turnstile orders between its two
rendezvous. Splitting the graph around each collective would cost a host round trip per
collective (dozens per step) and give the turnstile dozens of enqueues to order instead of one.
Each replica pads its rows to the bucket; `forward(batch, bucket)` tells the collectives that every
replica has `bucket` rows, so the shapes are fixed and rank-shared.

A graph row is one token read through a block table, so a speculative verify step replays the same
graphs: each verify row's k + 1 positions become k + 1 one-token rows with the row's table and
lengths start + 1 .. start + k + 1 (causal by length; every layer writes all new K/V before its
attention reads). The logits come back one per position, in the batch builder's order.
"""
from __future__ import annotations

import itertools
from typing import Callable

import numpy as np
import torch

from ..model.qwen3_moe import ForwardBatch
from ..protocol.plan import Phase, RowSpec
from .batch import forward_order, padded_blocks


def buckets(max_batch: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return sorted(set(small + list(range(16, max_batch, 16)) + [max_batch]))


def graph_inputs(rows: list[RowSpec], bucket: int, block_size: int, null_slot: int,
                 host: torch.Tensor) -> tuple[int, int]:
    """A replay's inputs into the int64 host buffer, one graph row per token of `rows` (in order):
    [ids | positions | slots | lengths] of `bucket` each, then the block tables [bucket, width].
    Padding rows: length 0, the null slot. Returns (tokens, width). Whole-array numpy over all rows
    (the host's work of every D step: a slice per row cost ~1.2 ms a step at batch 64, ctx 2k)."""
    b, bs = bucket, block_size
    width = max((len(r.blocks) for r in rows), default=1)
    a = host[:4 * b + b * width].numpy()
    a[:] = 0
    ids, pos, slots, lens = a[:b], a[b:2 * b], a[2 * b:3 * b], a[3 * b:4 * b]
    tables = a[4 * b:].reshape(b, width)
    if rows:
        k = np.fromiter((r.length for r in rows), np.int64, len(rows))
        n = int(k.sum())
        row_tables = padded_blocks(rows, width)
        of = np.repeat(np.arange(len(rows)), k)                # the row of each token
        first = np.cumsum(k) - k
        p = np.repeat(np.fromiter((r.start for r in rows), np.int64, len(rows)) - first, k) + np.arange(n)
        ids[:n] = np.fromiter(itertools.chain.from_iterable(r.tokens for r in rows), np.int64, n)
        pos[:n] = p
        lens[:n] = p + 1
        slots[:n] = row_tables[of, p // bs] * bs + p % bs
        tables[:n] = row_tables[of]
    else:
        n = 0
    slots[n:] = null_slot
    return n, width


class DecodeGraphs:
    def __init__(self, forward: Callable[[ForwardBatch, int], torch.Tensor], device: torch.device,
                 block_size: int, max_batch: int, max_blocks: int, null_slot: int, keep_hidden: bool = False):
        """`keep_hidden`: the graphs output the rows' final hidden states too (`last_hidden` after a
        replay: the MTP proposer's input)."""
        self.forward, self.block_size, self.null_slot = forward, block_size, null_slot
        self.keep_hidden = keep_hidden
        self.last_hidden: torch.Tensor | None = None
        self.buckets = buckets(max_batch)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), null_slot, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, device=device)
        self._host = torch.zeros(4 * n + n * max_blocks, dtype=torch.int64, pin_memory=True)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.max_blocks = max_blocks

    def _batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(self.input_ids[:b], self.positions[:b], self.slot_mapping[:b], [], self.rows[:b],
                            phase=Phase.DECODE, num_decode=b, block_tables=self.block_tables[:b],
                            seq_lens=self.seq_lens[:b], block_size=self.block_size, want_hidden=self.keep_hidden,
                            live=self.seq_lens[:b])   # padding rows: length 0

    def capture(self) -> None:
        """Every bucket, largest first (later graphs reuse its memory pool); on several ranks this
        is collective: every rank captures the same buckets in the same order."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in reversed(self.buckets):
                self.forward(self._batch(b), b)   # warm-up (Triton compile, cuBLAS handles, NCCL)
            torch.cuda.synchronize()
            for b in reversed(self.buckets):
                g = torch.cuda.CUDAGraph()
                # thread_local: the watchdog's thread queries events and streams while we capture
                batch = self._batch(b)
                with torch.cuda.graph(g, pool=pool, stream=side, capture_error_mode="thread_local"):
                    out = self.forward(batch, b)
                self.graphs[b] = (g, out, batch.hidden)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def fits(self, n: int) -> bool:
        return 0 < n <= self.buckets[-1]

    def bucket(self, n: int) -> int:
        return next(x for x in self.buckets if x >= n)

    def replay(self, rows: list[RowSpec], bucket: int) -> torch.Tensor:
        """Logits of `rows` (decode and verify rows of this rank's replica, at most `bucket` tokens),
        one per token in forward_order; the replay is enqueued on the current stream. Inputs go up
        in one copy from a pinned buffer, reused only after the step synchronized (its logits were
        sampled)."""
        b = bucket
        n, width = graph_inputs(forward_order(rows), b, self.block_size, self.null_slot, self._host)
        flat = self._host[:4 * b + b * width].to(self.input_ids.device, non_blocking=True)
        self.input_ids[:b].copy_(flat[:b])
        self.positions[:b].copy_(flat[b:2 * b])
        self.slot_mapping[:b].copy_(flat[2 * b:3 * b])
        self.seq_lens[:b].copy_(flat[3 * b:4 * b])
        self.block_tables[:b, :width].copy_(flat[4 * b:].view(b, width))
        g, out, hidden = self.graphs[b]
        g.replay()
        self.last_hidden = hidden[:n] if hidden is not None else None
        return out[:n]
