"""The host side of a D graph replay (runtime/graphs.py `graph_inputs`), on CPU: one graph row per
token, decode rows and verify rows (k + 1 tokens, each causal by its length) alike."""
from __future__ import annotations

import torch

from pdrollout.engine.protocol.plan import Phase, RowSpec
from pdrollout.engine.runtime.graphs import graph_inputs


def expected(rows, bucket, bs, null):
    """Token by token, as the graph reads them."""
    ids, pos, slots, lens, tables = [], [], [], [], []
    for r in rows:
        for j, t in enumerate(r.tokens):
            p = r.start + j
            ids.append(t), pos.append(p), lens.append(p + 1)
            slots.append(r.blocks[p // bs] * bs + p % bs)
            tables.append(list(r.blocks))
    pad = bucket - len(ids)
    width = max(len(r.blocks) for r in rows)
    tables = [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad
    return ids + [0] * pad, pos + [0] * pad, slots + [null] * pad, lens + [0] * pad, tables


def test_graph_inputs_lay_out_decode_and_verify_rows_token_by_token():
    bs, null, bucket = 4, 999, 16
    rows = [RowSpec("a", Phase.DECODE, 9, (7,), (3, 5, 8), True),                  # decode: one token
            RowSpec("b", Phase.DECODE, 6, (1, 2, 3), (11, 4, 2), True, draft=2),   # verify: crosses a block
            RowSpec("c", Phase.DECODE, 0, (4,), (6,), True)]
    host = torch.full((4 * bucket + bucket * 8,), -1, dtype=torch.int64)   # stale values must go
    n, width = graph_inputs(rows, bucket, bs, null, host)
    assert (n, width) == (5, 3)
    b = bucket
    got = [host[k * b:(k + 1) * b].tolist() for k in range(4)] + [host[4 * b:4 * b + b * width].view(b, width).tolist()]
    assert got == list(expected(rows, bucket, bs, null))
    assert got[2][:5] == [8 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 2 * 4 + 0, 6 * 4 + 0]   # the slots, by hand
    assert got[3][:6] == [10, 7, 8, 9, 1, 0]                                        # lengths: causal
