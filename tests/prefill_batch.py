"""Prefill batches for the tests of P's forward: segments whose context sits in consecutive KV slots."""
from __future__ import annotations

import torch

from pdrollout.engine.model.qwen3_moe import ForwardBatch, SeqSlice


def batch_of(segments, device="cpu") -> ForwardBatch:
    """Prefill segments (tokens, start, first slot): each one's context in consecutive slots."""
    ids, pos, slots, seqs, logit_rows, t = [], [], [], [], [], 0
    for tokens, start, base in segments:
        n = len(tokens)
        ids += tokens
        pos += range(start, start + n)
        slots += range(base + start, base + start + n)
        seqs.append(SeqSlice(t, n, start + n, torch.arange(base, base + start + n, device=device)))
        t += n
        logit_rows.append(t - 1)
    long = lambda xs: torch.tensor(list(xs), dtype=torch.long, device=device)
    return ForwardBatch(long(ids), long(pos), long(slots), seqs, long(logit_rows))
