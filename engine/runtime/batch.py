"""Rows of the rank-shared plan → one flat `ForwardBatch`: the one place that computes positions,
slot mappings, per-sequence context slots, block tables and the upload to the device.

Decode rows come first (one token each), prefill segments after them. On a device other than the
CPU everything goes up in one non-blocking copy from a pinned staging buffer owned by the phase: a
pageable copy blocks the host while the other path's collective spins on the GPU (seen on H200s),
and a staging buffer is reused only after its phase's stream synchronized.
"""
from __future__ import annotations

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


def slots_of(blocks, start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slot of each context position start..end-1 of a sequence with block table `blocks`."""
    pos = torch.arange(start, end)
    table = torch.tensor(blocks, dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size


class BatchBuilder:
    def __init__(self, block_size: int, device: torch.device, block_tables: bool) -> None:
        self.block_size, self.device = block_size, device
        self.block_tables = block_tables          # the attention backend reads decode rows' tables
        self._stage: dict[Phase, torch.Tensor] = {}

    def build(self, rows: list[RowSpec], phase: Phase) -> ForwardBatch:
        rows = forward_order(rows)
        nd = sum(1 for r in rows if r.kind == Phase.DECODE and not r.draft)
        bs = self.block_size
        # With block tables the attention backend reads decode rows' context through the tables:
        # their new token's slot is all they need (computed here, not gathered per row).
        tabled = nd if self.block_tables else 0
        ids, pos, logit_rows, seqs, t = [], [], [], [], 0
        slot_map: list = [[r.blocks[r.start // bs] * bs + r.start % bs for r in rows[:tabled]]]
        for i, r in enumerate(rows):
            ids.extend(r.tokens)
            pos.extend(range(r.start, r.start + r.length))
            if i >= tabled:
                ctx = slots_of(r.blocks, 0, r.start + r.length, bs)
                slot_map.append(ctx[r.start:])
            else:
                ctx = None
            seqs.append(SeqSlice(t, r.length, r.start + r.length, ctx))
            if r.samples:
                logit_rows.extend(range(t + r.length - r.logit_rows, t + r.length))
            t += r.length
        long = lambda xs: torch.tensor(xs, dtype=torch.long)
        slot_map[0] = long(slot_map[0])
        ctx_slots = [q.slots for q in seqs[tabled:]]
        host = [long(ids), long(pos), torch.cat(slot_map), long(logit_rows), *ctx_slots]
        width = max((len(r.blocks) for r in rows[:nd]), default=1)
        if self.block_tables:   # one flat list, padded per row: one tensor, not one per row
            flat: list[int] = []
            for r in rows[:nd]:
                flat.extend(r.blocks)
                flat.extend([0] * (width - len(r.blocks)))
            host += [long(flat), long([q.ctx_len for q in seqs[:nd]])]
        if self.device.type != "cpu":
            host = self._upload(phase, host)
        slots = host[4:4 + len(ctx_slots)]
        seqs = seqs[:tabled] + [SeqSlice(q.q_start, q.q_len, q.ctx_len, s) for q, s in zip(seqs[tabled:], slots)]
        batch = ForwardBatch(host[0], host[1], host[2], seqs, host[3], phase=phase, num_decode=nd,
                             block_size=bs)
        if self.block_tables:
            table, lens = host[4 + len(ctx_slots):]
            batch.block_tables = table.view(nd, width).to(torch.int32)
            batch.seq_lens = lens.to(torch.int32)
        return batch

    def _upload(self, phase: Phase, arrays: list[torch.Tensor]) -> list[torch.Tensor]:
        sizes = [a.numel() for a in arrays]
        total = sum(sizes)
        stage = self.staging(phase, total)
        if total:
            torch.cat(arrays, out=stage[:total])
        flat = stage[:total].to(self.device, non_blocking=True)
        return list(torch.split(flat, sizes))

    def staging(self, phase: Phase, total: int) -> torch.Tensor:
        """The phase's pinned buffer of at least `total` elements (allocated at start, or rarely)."""
        stage = self._stage.get(phase)
        if stage is None or stage.numel() < total:
            stage = self._stage[phase] = torch.empty(max(total, 1 << 20), dtype=torch.long, pin_memory=True)
        return stage
