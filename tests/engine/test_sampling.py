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
    sp = SamplingParams.from_dict({"top_p": 0.9, "temperature": 1.0, "custom_params": {"other": 1}})
    assert sp.top_p == 0.9
    # slime's top_p != 1 rollouts read meta_info.top_p_token_ids, which this engine does not report
    with pytest.raises(RequestError, match="return_top_p_token_ids is not supported"):
        SamplingParams.from_dict({"top_p": 0.9, "custom_params": {"return_top_p_token_ids": True}})
    with pytest.raises(RequestError, match="custom_params must be an object"):
        SamplingParams.from_dict({"custom_params": 3})


def test_tiny_temperatures_sample_the_argmax_and_bad_numbers_are_refused():
    """row / T overflowed fp32 for a tiny positive T (and T below fp32's range became 0): NaN
    probabilities failed the whole engine step. Non-finite numbers from JSON are refused."""
    import pytest
    from pdrollout.engine.scheduler.request import RequestError
    from pdrollout.engine.runtime.sampler import sample
    rows, gen = torch.randn(4, 512, generator=torch.Generator().manual_seed(1)), torch.Generator().manual_seed(0)
    for t in (1e-5, 1e-40, 1e-300, 5e-324):
        for extra in ({}, {"top_k": 3}, {"top_p": 0.5}):
            params = [SamplingParams(temperature=t, **extra)] * 4
            assert sample(rows, params, [gen] * 4, False)[0] == rows.argmax(dim=-1).tolist()
    for bad in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": float("nan")},
                {"seed": 2 ** 64}, {"seed": -2 ** 63 - 1}):
        with pytest.raises(RequestError, match="finite|seed"):
            SamplingParams.from_dict({"max_new_tokens": 2, **bad})
    assert SamplingParams.from_dict({"seed": 2 ** 64 - 1}).seed == 2 ** 64 - 1


def _reference_probs(row, t, top_k, top_p):
    """Temperature, top-k, top-p in float64, by their definitions (independent of the sampler)."""
    p = torch.softmax(row.double() / t, dim=-1)
    keep = torch.ones_like(p, dtype=torch.bool)
    if top_k:
        keep &= row >= torch.topk(row, top_k).values[-1]
    p = torch.where(keep, p, 0.0)
    p = p / p.sum()
    order = torch.argsort(p, descending=True)
    mass, kept = 0.0, torch.zeros_like(keep)
    for i in order.tolist():   # the smallest prefix whose mass reaches top_p
        if mass >= top_p:
            break
        kept[i], mass = True, mass + float(p[i])
    p = torch.where(kept, p, 0.0)
    return p / p.sum()


def test_batched_sampling_draws_each_row_from_its_own_distribution():
    """The exponential race over a batch of rows with different temperature / top-k / top-p, each with
    its own generator: every row's draws follow its distribution, and no masked token is drawn.

    N = 20000 batches, chi-square per row at alpha = 1e-3 over categories with expected count >= 5.
    Power: a row sampled with another row's settings, or its mask ignored, moves >= 0.05 of total
    variation here: noncentrality >= N * 4 * 0.05^2 = 200 on <= 11 degrees of freedom, power ~1."""
    from pdrollout.engine.runtime.sampler import sample
    from stats import chi2_sf
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(4)) * 1.5
    settings = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in settings]
    gens = [torch.Generator().manual_seed(10 + i) for i in range(3)]
    n = 20000
    counts = torch.zeros(3, 12)
    for _ in range(n):
        toks, _ = sample(logits, params, gens, False)
        counts[torch.arange(3), torch.tensor(toks)] += 1
    for i, (t, k, p) in enumerate(settings):
        expected = _reference_probs(logits[i], t, k, p) * n
        assert not counts[i][expected == 0].any(), (i, counts[i], expected)   # masked: never drawn
        keep = expected >= 5
        stat = float(((counts[i][keep] - expected[keep]) ** 2 / expected[keep]).sum())
        assert chi2_sf(stat, int(keep.sum()) - 1) > 1e-3, (i, counts[i], expected)


def test_a_rows_token_depends_on_its_seed_and_logits_not_on_its_batch():
    """The same request samples the same token alone or beside others (any order, greedy rows mixed
    in): what lets its seed decide its tokens in every mode and on every rank layout."""
    from pdrollout.engine.runtime.sampler import sample
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.9, top_p=0.7), SamplingParams(temperature=1.2, top_k=8)]
    gen = lambda i: torch.Generator().manual_seed(100 + i)
    for _ in range(5):
        alone = [sample(logits[i:i + 1], [params[i]], [gen(i)], False)[0][0] for i in range(4)]
        order = [2, 0, 3, 1]
        mixed, _ = sample(logits[order], [params[i] for i in order], [gen(i) for i in order], False)
        assert [mixed[order.index(i)] for i in range(4)] == alone
        logits = torch.randn(4, 50)
