"""The batch builder (runtime/batch.py) on CPU: every field of a ForwardBatch against a row-by-row
layout, for decode, verify and prefill rows, with and without block tables."""
from __future__ import annotations

import pytest
import torch

from pdrollout.engine.protocol.plan import Phase, RowSpec
from pdrollout.engine.runtime.batch import BatchBuilder

BS = 4
ROWS = [RowSpec("p", Phase.PREFILL, 5, (9, 8, 7), (6, 2, 9), True),                    # continuation
        RowSpec("d", Phase.DECODE, 9, (7,), (3, 5, 8), True),                           # decode
        RowSpec("v", Phase.DECODE, 6, (1, 2, 3), (11, 4, 2), True, draft=2),            # verify
        RowSpec("f", Phase.PREFILL, 0, (4, 4, 4, 4, 4), (1, 12), False),                # a chunk: no sample
        RowSpec("e", Phase.DECODE, 0, (5,), (10,), True)]


def slot(blocks, p):
    return blocks[p // BS] * BS + p % BS


@pytest.mark.parametrize("tables", [False, True])
def test_a_batch_lays_out_each_row_as_its_tokens_say(tables):
    b = BatchBuilder(BS, torch.device("cpu"), tables).build(ROWS, Phase.MIXED)
    order = ["d", "e", "v", "p", "f"]            # plain decode rows, verify rows, then prefill
    rows = sorted(ROWS, key=lambda r: order.index(r.rid))
    ids, pos, slots, seqs, logits, t = [], [], [], [], [], 0
    for r in rows:
        ids += r.tokens
        pos += range(r.start, r.start + len(r.tokens))
        slots += [slot(r.blocks, p) for p in range(r.start, r.start + len(r.tokens))]
        seqs.append((t, len(r.tokens), r.start + len(r.tokens)))
        if r.samples:
            logits += range(t + len(r.tokens) - r.logit_rows, t + len(r.tokens))
        t += len(r.tokens)
    assert b.input_ids.tolist() == ids and b.positions.tolist() == pos
    assert b.slot_mapping.tolist() == slots and b.logits_indices.tolist() == logits
    assert [(q.q_start, q.q_len, q.ctx_len) for q in b.seqs] == seqs
    assert b.num_decode == 2 and b.input_ids.dtype == torch.long
    for q, r in zip(b.seqs, rows):
        if tables and r.rid in ("d", "e"):   # read through the tables: no slot list
            assert q.slots is None
        else:
            assert q.slots.tolist() == [slot(r.blocks, p) for p in range(q.ctx_len)]
    if tables:
        assert b.block_tables.tolist() == [[3, 5, 8], [10, 0, 0]] and b.block_tables.dtype == torch.int32
        assert b.seq_lens.tolist() == [10, 1]
    else:
        assert b.block_tables is None


def test_an_empty_batch_has_no_rows():
    b = BatchBuilder(BS, torch.device("cpu"), True).build([], Phase.DECODE)
    assert b.input_ids.numel() == 0 and b.seqs == [] and b.block_tables.shape == (0, 1)
