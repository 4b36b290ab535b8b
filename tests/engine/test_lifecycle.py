"""Abort, lifetimes, eviction under memory pressure, bad input: the engine keeps serving."""
from __future__ import annotations

import pytest

from hf_reference import assert_matches_reference, drain, hf_greedy
from pdrollout.engine.protocol.config import ControlSettings, EngineConfig
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.scheduler.request import RequestError, SamplingParams


def make(model, mode="pd", num_blocks=64, **kw):
    return Engine(EngineConfig(model=str(model), mode=mode, block_size=4, num_blocks=num_blocks,
                               control=ControlSettings(prefill_budget_tokens=16), **kw))


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def test_abort_in_flight_discards_result_and_frees_after_drain(tiny_model):
    e = make(tiny_model)
    e.submit("a", list(range(2, 30)), greedy(5))
    pool, reservations = e.schedulers[0].pool, e.schedulers[0].reservations   # one rank: one replica
    launched = e.launch()                          # a's first prefill segment is submitted
    held = pool.num_used()
    assert held > 0
    assert e.abort("a")
    assert pool.num_used() == held                 # still in flight: KV not reusable
    e.submit("a", [9, 8, 7], greedy(3))            # the client retries with the same rid
    outs = e.finish(launched)
    assert [o.finish_reason["type"] for o in outs if o.rid == "a"] == ["abort"]
    assert all(not o.new_token_ids for o in outs)  # the old lifetime's result was discarded
    assert reservations.draining == []
    out, fin = drain(e)
    ref, m = hf_greedy(tiny_model, [9, 8, 7], 3)
    assert_matches_reference(out["a"], ref, m, "retried request")
    assert all(ref == 0 for ref in pool.ref)        # nothing leaked across the two lifetimes


def test_abort_waiting_and_running(tiny_model):
    e = make(tiny_model, mode="normal")
    e.submit("run", list(range(2, 10)), greedy(50))
    e.submit("wait", list(range(2, 200)), greedy(4))
    e.step()
    assert e.abort("run") and e.abort("wait")
    assert not e.abort("nope")
    outs = e.step()
    assert {o.rid: o.finish_reason["type"] for o in outs} == {"run": "abort", "wait": "abort"}
    assert not e.has_unfinished()
    assert e.schedulers[0].pool.num_used() == 0


def test_memory_pressure_retracts_without_corrupting(tiny_model):
    prompts = [[(i * 31 + k * 7) % 500 + 2 for i in range(12)] for k in range(6)]
    roomy, tight = make(tiny_model, num_blocks=256), make(tiny_model, num_blocks=14, max_running=6)
    for e in (roomy, tight):
        for k, p in enumerate(prompts):
            e.submit(f"r{k}", p, greedy(20))
    a, _ = drain(roomy)
    b, fin = drain(tight)
    assert all(f["type"] == "length" for f in fin.values())
    assert a == b
    for k, p in enumerate(prompts):
        ref, m = hf_greedy(tiny_model, p, 20)
        assert_matches_reference(b[f"r{k}"], ref, m, f"tight KV r{k}")


@pytest.mark.parametrize("ids,sp,match", [
    ([], {}, "non-empty list"),
    ([1, 2, 10_000], {}, "outside the vocabulary"),
    ([1, -1], {}, "outside the vocabulary"),
    ([1, "2"], {}, "outside the vocabulary"),
    ([1, 2], {"max_new_tokens": 0}, "max_new_tokens must be >"),
    ([1, 2], {"max_new_tokens": -3}, "max_new_tokens must be >"),
    ([1, 2], {"max_new_tokens": 5000}, "exceeds the context length"),
    ([1, 2], {"max_new_tokens": 1000}, "exceeds the KV cache capacity"),
    ([1, 2], {"temperature": "hot"}, "temperature must be a number"),
    ([1, 2], {"top_p": 1.5}, "top_p must be <= 1"),
    ([1, 2], {"top_k": 0}, "top_k must be -1"),
    ([1, 2], {"stop_token_ids": [1, "x"]}, "list of integers"),
    ([1, 2], {"bogus": 1}, "unknown sampling_params key"),
    ([1, 2], {"frequency_penalty": 0.5}, "not supported"),
])
def test_bad_input_is_rejected_and_engine_keeps_serving(tiny_model, ids, sp, match):
    e = make(tiny_model, num_blocks=64)
    e.submit("ok", [5, 6, 7], greedy(4))
    with pytest.raises(RequestError, match=match):
        e.submit("bad", ids, SamplingParams.from_dict(sp))
    out, fin = drain(e)
    assert list(out) == ["ok"] and len(out["ok"]) == 4


def test_duplicate_rid_rejected(tiny_model):
    e = make(tiny_model)
    e.submit("x", [1, 2], greedy(2))
    with pytest.raises(RequestError, match="already running"):
        e.submit("x", [1, 2], greedy(2))


def test_control_change_applies_at_next_step(tiny_model):
    e = make(tiny_model)
    e.set_control(e.control.updated({"span": 2, "activation": "off"}))
    assert e.control.span == "auto"                # not yet: only at a step boundary
    e.submit("x", list(range(2, 40)), greedy(2))
    e.step()
    assert e.control.span == 2 and e.control.activation == "off"
