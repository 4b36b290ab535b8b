import math

import torch

from pdrollout.engine.protocol.config import EngineConfig
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.scheduler.request import SamplingParams
from hf_reference import hf_model


def run(model, sp, prompt=(4, 5, 6), logprob=False, rid="s"):
    e = Engine(EngineConfig(model=str(model), block_size=4, num_blocks=64))
    e.submit(rid, list(prompt), sp, return_logprob=logprob)
    ids, lps = [], []
    while e.has_unfinished():
        for o in e.step():
            ids += o.new_token_ids
            lps += o.new_logprobs or []
    return ids, lps


def test_seeded_sampling_is_deterministic_and_seed_matters(tiny_model):
    sp = dict(max_new_tokens=12, temperature=1.5, ignore_eos=True)
    a, _ = run(tiny_model, SamplingParams(seed=7, **sp))
    b, _ = run(tiny_model, SamplingParams(seed=7, **sp), rid="other")
    c, _ = run(tiny_model, SamplingParams(seed=8, **sp))
    assert a == b
    assert a != c


def test_top_k_1_and_tiny_top_p_equal_greedy(tiny_model):
    g, _ = run(tiny_model, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    k1, _ = run(tiny_model, SamplingParams(max_new_tokens=8, temperature=2.0, top_k=1, seed=3, ignore_eos=True))
    p0, _ = run(tiny_model, SamplingParams(max_new_tokens=8, temperature=2.0, top_p=1e-6, seed=3, ignore_eos=True))
    assert g == k1 == p0


def test_logprobs_match_transformers(tiny_model):
    prompt = [4, 5, 6, 7]
    ids, lps = run(tiny_model, SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True), prompt, logprob=True)
    m = hf_model(str(tiny_model))
    with torch.no_grad():
        logits = m(torch.tensor([prompt + ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    for i, (t, lp) in enumerate(zip(ids, lps)):
        assert math.isclose(lp, ref[len(prompt) - 1 + i, t].item(), abs_tol=1e-4)


def test_stop_token_ids_and_min_new_tokens(tiny_model):
    free, _ = run(tiny_model, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))
    stop = free[3]
    first = free.index(stop)
    ids, _ = run(tiny_model, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,)))
    assert ids == free[:first + 1]
    later, _ = run(tiny_model, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True,
                                              stop_token_ids=(stop,), min_new_tokens=first + 2))
    assert len(later) > first + 1 and later[:first + 1] == free[:first + 1]


def test_slime_custom_params_accepted_and_checked():
    import pytest
    from pdrollout.engine.scheduler.request import RequestError
    sp = SamplingParams.from_dict({"top_p": 0.9, "temperature": 1.0, "custom_params": {"return_top_p_token_ids": True}})
    assert sp.top_p == 0.9
    with pytest.raises(RequestError, match="custom_params must be an object"):
        SamplingParams.from_dict({"custom_params": 3})


def test_tiny_temperatures_sample_the_argmax_and_bad_numbers_are_refused():
    """row / T overflowed fp32 for a tiny positive T (and T below fp32's range became 0): NaN
    probabilities failed the whole engine step. Non-finite numbers from JSON are refused."""
    import pytest
    from pdrollout.engine.scheduler.request import RequestError
    from pdrollout.engine.runtime.sampler import _sample_row
    row, gen = torch.randn(512, generator=torch.Generator().manual_seed(1)), torch.Generator().manual_seed(0)
    for t in (1e-5, 1e-40, 1e-300, 5e-324):
        for extra in ({}, {"top_k": 3}, {"top_p": 0.5}):
            assert _sample_row(row, SamplingParams(temperature=t, **extra), gen) == int(row.argmax())
    for bad in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": float("nan")},
                {"seed": 2 ** 64}, {"seed": -2 ** 63 - 1}):
        with pytest.raises(RequestError, match="finite|seed"):
            SamplingParams.from_dict({"max_new_tokens": 2, **bad})
    assert SamplingParams.from_dict({"seed": 2 ** 64 - 1}).seed == 2 ** 64 - 1
