"""Rows of the rank-shared plan → one flat `ForwardBatch`: the one place that computes positions,
slot mappings, per-sequence context slots, block tables and the upload to the device.

Decode rows come first (one token each), prefill segments after them. On a device other than the
CPU everything goes up in one non-blocking copy from a pinned staging buffer owned by the phase: a
pageable copy blocks the host while the other path's collective spins on the GPU (seen on H200s),
and a staging buffer is reused only after its phase's stream synchronized.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from ..model.qwen3_moe import ForwardBatch, SeqSlice
from ..protocol.plan import Phase, RowSpec


def forward_order(rows: list[RowSpec]) -> list[RowSpec]:
    """The batch's row order (and so the logits' order): one-token decode rows (read through block
    tables on a GPU), then verify rows (k + 1 positions over the paged KV, the prefill path's
    attention), then prefill segments."""
    plain = [r for r in rows if r.kind == Phase.DECODE and not r.draft]
    verify = [r for r in rows if r.kind == Phase.DECODE and r.draft]
    return plain + verify + [r for r in rows if r.kind != Phase.DECODE]


def slots_of(blocks, start: int, end: int, block_size: int) -> np.ndarray:
    """Cache slot of each context position start..end-1 of a sequence with block table `blocks`."""
    pos = np.arange(start, end)
    return np.asarray(blocks, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


def padded_blocks(rows: list[RowSpec], width: int) -> np.ndarray:
    """Each row's block table, zero-padded to `width`: int64 [rows, width] (no per-row Python loop)."""
    nb = np.fromiter((len(r.blocks) for r in rows), np.int64, len(rows))
    table = np.zeros((len(rows), width), np.int64)
    table[np.arange(width) < nb[:, None]] = np.fromiter(
        itertools.chain.from_iterable(r.blocks for r in rows), np.int64, int(nb.sum()))
    return table


class BatchBuilder:
    def __init__(self, block_size: int, device: torch.device, block_tables: bool) -> None:
        self.block_size, self.device = block_size, device
        self.block_tables = block_tables          # the attention backend reads decode rows' tables
        self._stage: dict[tuple[Phase, int], torch.Tensor] = {}

    def build(self, rows: list[RowSpec], phase: Phase, stage: int = 0) -> ForwardBatch:
        """Whole-array numpy over the rows (torch.tensor of Python lists cost ~2 ms of a fused P1
        step's ~3 ms here: the decode rows' block tables alone are ~13k ints at batch 64)."""
        rows = forward_order(rows)
        nd = sum(1 for r in rows if r.kind == Phase.DECODE and not r.draft)
        bs = self.block_size
        # With block tables the attention backend reads decode rows' context through the tables:
        # their new token's slot is all they need (computed here, not gathered per row).
        tabled = nd if self.block_tables else 0
        k = np.fromiter((len(r.tokens) for r in rows), np.int64, len(rows))
        starts = np.fromiter((r.start for r in rows), np.int64, len(rows))
        q_start = np.cumsum(k) - k
        t = int(k.sum())
        ids = np.fromiter(itertools.chain.from_iterable(r.tokens for r in rows), np.int64, t)
        pos = np.repeat(starts - q_start, k) + np.arange(t)
        ctx_slots = [slots_of(r.blocks, 0, r.start + len(r.tokens), bs) for r in rows[tabled:]]
        slot_map = np.concatenate(
            [np.fromiter((r.blocks[r.start // bs] * bs + r.start % bs for r in rows[:tabled]), np.int64, tabled)]
            + [c[r.start:] for c, r in zip(ctx_slots, rows[tabled:])])
        logit_rows = np.fromiter(itertools.chain.from_iterable(
            range(q + n - r.logit_rows, q + n) for r, q, n in zip(rows, q_start.tolist(), k.tolist()) if r.samples),
            np.int64)
        host = [ids, pos, slot_map, logit_rows, *ctx_slots]
        width = max((len(r.blocks) for r in rows[:nd]), default=1)
        if self.block_tables:   # one flat table, padded per row: one tensor, not one per row
            host += [padded_blocks(rows[:nd], width).reshape(-1), starts[:nd] + k[:nd]]
        arrays = self._upload(phase, host, stage) if self.device.type != "cpu" else [torch.from_numpy(a) for a in host]
        ctx_lens = (starts + k).tolist()
        seqs = [SeqSlice(q, n, c, None) for q, n, c in zip(q_start[:tabled].tolist(), k[:tabled].tolist(), ctx_lens)]
        seqs += [SeqSlice(q, n, c, sl) for q, n, c, sl in
                 zip(q_start[tabled:].tolist(), k[tabled:].tolist(), ctx_lens[tabled:], arrays[4:4 + len(ctx_slots)])]
        batch = ForwardBatch(arrays[0], arrays[1], arrays[2], seqs, arrays[3], phase=phase, num_decode=nd,
                             block_size=bs)
        if self.block_tables:
            table, lens = arrays[4 + len(ctx_slots):]
            batch.block_tables = table.view(nd, width).to(torch.int32)
            batch.seq_lens = lens.to(torch.int32)
        return batch

    def _upload(self, phase: Phase, arrays: list[np.ndarray], stage: int = 0) -> list[torch.Tensor]:
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        buf = self.staging(phase, total, stage)
        if total:
            np.concatenate(arrays, out=buf[:total].numpy())
        flat = buf[:total].to(self.device, non_blocking=True)
        return list(torch.split(flat, sizes))

    def staging(self, phase: Phase, total: int, stage: int = 0) -> torch.Tensor:
        """The phase's pinned buffer of at least `total` elements (allocated at start, or rarely).
        `stage`: one of several buffers of the phase, for batches built before its stream syncs
        (a proposer's chained draft steps)."""
        key = (phase, stage)
        buf = self._stage.get(key)
        if buf is None or buf.numel() < total:
            buf = self._stage[key] = torch.empty(max(total, 1 << 20), dtype=torch.long, pin_memory=True)
        return buf
