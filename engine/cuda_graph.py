"""CUDA graphs for decode steps, captured once per batch-size bucket.

The graphs read only phase-owned static inputs (ids, positions, slots, block tables, lengths), so a
replay is valid whether or not prefill work is active elsewhere; padding rows have length 0 and
write their K/V into a reserved null slot.
"""
from __future__ import annotations

import torch

from .model import ForwardBatch


def buckets(max_batch: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return sorted(set(small + list(range(16, max_batch, 16)) + [max_batch]))


class DecodeGraphs:
    def __init__(self, model, kv, block_size: int, max_batch: int, max_blocks: int, null_slot: int):
        dev = kv.k[0].device
        self.model, self.kv, self.block_size = model, kv, block_size
        self.null_slot = null_slot
        self.buckets = buckets(max_batch)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), null_slot, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(self.input_ids[:b], self.positions[:b], self.slot_mapping[:b], [], self.rows[:b],
                            phase="decode", num_decode=b, block_tables=self.block_tables[:b],
                            seq_lens=self.seq_lens[:b], block_size=self.block_size)

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in reversed(self.buckets):       # largest first: later graphs reuse its pool
                self.model(self._batch(b), self.kv)  # warm-up (Triton compile, cuBLAS handles)
        torch.cuda.current_stream().wait_stream(side)
        for b in reversed(self.buckets):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self.model(self._batch(b), self.kv)
            self.graphs[b] = (g, out)
        torch.cuda.synchronize()

    def fits(self, n: int) -> bool:
        return 0 < n <= self.buckets[-1]

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]) -> torch.Tensor:
        n = len(ids)
        b = next(x for x in self.buckets if x >= n)
        width = max(len(t) for t in tables)
        host_tables = torch.zeros(n, width, dtype=torch.int32)
        for i, t in enumerate(tables):
            host_tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        self.input_ids[:n].copy_(torch.tensor(ids), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.tensor(slots), non_blocking=True)
        self.seq_lens[:n].copy_(torch.tensor([p + 1 for p in positions], dtype=torch.int32), non_blocking=True)
        self.block_tables[:n, :width].copy_(host_tables, non_blocking=True)
        if b > n:
            self.slot_mapping[n:b].fill_(self.null_slot)
            self.seq_lens[n:b].zero_()
        g, out = self.graphs[b]
        g.replay()
        return out[:n]
