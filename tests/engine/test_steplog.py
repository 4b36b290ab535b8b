"""The step log's lines on one rank (CPU): which rows each step ran and the keys they attend."""
from __future__ import annotations

import json

from hf_reference import PROMPTS, run_all
from pdrollout.engine.protocol.config import EngineConfig
from pdrollout.engine.protocol.topology import Topology
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.runtime.options import RankOptions
from pdrollout.engine.runtime.steplog import rows_digest
from pdrollout.engine.runtime.worker import Worker


class _Row:
    def __init__(self, rid):
        self.rid = rid


def test_rows_digest_names_the_set_of_rows_not_their_order():
    assert rows_digest([_Row("a"), _Row("b")]) == rows_digest([_Row("b"), _Row("a")])
    assert rows_digest([_Row("a"), _Row("b")]) != rows_digest([_Row("a"), _Row("c")])
    assert rows_digest([_Row("ab")]) != rows_digest([_Row("a"), _Row("b")])


def test_each_d_step_logs_its_rows_and_the_keys_they_attend(tiny_model, tmp_path):
    cfg = EngineConfig(model=str(tiny_model), mode="mixed", block_size=4, num_blocks=256, mixed_chunk_tokens=20)
    engine = Engine(cfg, Worker(cfg, Topology(1), 0, options=RankOptions(step_log=str(tmp_path))))
    run_all(engine, PROMPTS, max_new=6, ignore_eos=True)
    steps = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    d_only = [s for s in steps if s["decode_rows"] and not s["prefill_tokens"]]
    assert d_only and all(s["decode_ctx_tokens"] >= s["decode_rows"] for s in steps if s["decode_rows"])
    assert all(s["decode_ctx_tokens"] == 0 for s in steps if not s["decode_rows"])
    # the same rows one step later attend one key more each
    pairs = [(a, b) for a, b in zip(d_only, d_only[1:]) if a["decode_set"] == b["decode_set"] and b["step"] == a["step"] + 1]
    assert pairs and all(b["decode_ctx_tokens"] - a["decode_ctx_tokens"] == a["decode_rows"] for a, b in pairs), pairs
    # sets of different sizes never share a digest
    by_set = {}
    for s in steps:
        if s["decode_rows"]:
            by_set.setdefault(s["decode_set"], set()).add(s["decode_rows"])
    assert len(by_set) > 1 and all(len(sizes) == 1 for sizes in by_set.values()), by_set
