"""Speculative decoding inside D (n-gram proposer): greedy outputs equal those without speculation in
every mode and for k = 1..4, stops and max_new_tokens hold mid-acceptance, the KV pool accounts
exactly after rollbacks, and with temperature > 0 the emitted tokens follow the target's
distribution (the acceptance rule alone, and end to end through the engine)."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_config
from stats import chi2_sf
from pdrollout.engine.model.checkpoint import write_checkpoint
from pdrollout.engine.protocol.config import ControlSettings, EngineConfig
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.runtime.sampler import _probs, verify
from pdrollout.engine.scheduler.request import SamplingParams
from pdrollout.engine.scheduler.spec import propose_ngram

MODES = ["normal", "mixed", "pd"]
VOCAB = 24
# Repetitive prompts (as tool output and code are), so the prompt-lookup proposer has drafts.
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [(i * 7) % VOCAB for i in range(11)] * 2, [3, 1, 4, 1, 5, 9, 2, 6],
           [7, 7, 7, 7, 7, 7]]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The tiny preset with a 24-token vocabulary: a random model's greedy output falls into loops
    within a few tokens, so n-gram drafts are accepted often (30-70 %) and rejected often, and both
    branches of verification and rollback run in every test."""
    return write_checkpoint(tiny_config(vocab_size=VOCAB), tmp_path_factory.mktemp("loopy"), seed=0)


def engine_for(model_dir, mode, spec_k=0, **kw) -> Engine:
    control = ControlSettings(prefill_budget_tokens=24, span="auto")
    spec = {"speculative": kw.pop("speculative", "ngram"), "speculative_k": spec_k} if spec_k else {}
    return Engine(EngineConfig(model=str(model_dir), mode=mode, block_size=4, num_blocks=kw.pop("num_blocks", 256),
                               mixed_chunk_tokens=20, control=control, **spec, **kw))


def run_all(engine: Engine, prompts, check=None, **sp) -> tuple[dict, dict]:
    """Every prompt to the end; `check(engine)` after every step."""
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, SamplingParams(**{"temperature": 0.0, **sp}))
    out: dict[str, list[int]] = {}
    last: dict = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
            last[o.rid] = o
        if check:
            check(engine)
    return out, last


def run_logprobs(engine: Engine, prompts, **sp) -> tuple[dict, dict]:
    """Every prompt to the end with return_logprob: each request's tokens and their logprobs."""
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, SamplingParams(**{"temperature": 0.0, **sp}), return_logprob=True)
    toks: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            toks.setdefault(o.rid, []).extend(o.new_token_ids)
            lps.setdefault(o.rid, []).extend(o.new_logprobs)
    return toks, lps


def assert_pool_idle(engine: Engine) -> None:
    """Every block is free or only cached; no reservation lives or drains."""
    for s in engine.schedulers:
        assert s.pool.num_used() == 0 and all(c == 0 for c in s.pool.ref)
        assert not s.reservations.live and not s.reservations.draining


def test_ngram_proposer():
    assert propose_ngram([1, 2, 3, 1, 2], 2) == [3, 1]          # suffix [1, 2] recurs: what followed it
    assert propose_ngram([4, 1, 2, 9, 1, 2], 3) == [9, 1, 2]    # the latest earlier occurrence
    assert propose_ngram([1, 2, 3], 4) == []                    # nothing recurs
    assert propose_ngram([8, 8], 4) == [8]                      # capped by what follows
    assert propose_ngram([1, 2, 1, 2], 0) == []
    far = [4, 5] + list(range(10, 20)) + [4]
    assert propose_ngram(far, 1) == [5] and propose_ngram(far, 1, window=5) == []   # the lookback bound


_BASE: dict[str, dict] = {}


@pytest.mark.parametrize("mode", MODES)
def test_greedy_identical_with_ngram_speculation(tiny_model, mode):
    if mode not in _BASE:
        _BASE[mode] = run_all(engine_for(tiny_model, mode), PROMPTS, max_new_tokens=14, ignore_eos=True)[0]
    base = _BASE[mode]
    accepted = 0
    for k in (1, 2, 3, 4):
        eng = engine_for(tiny_model, mode, spec_k=k)
        out, last = run_all(eng, PROMPTS, max_new_tokens=14, ignore_eos=True)
        assert out == base, f"{mode} k={k}"
        assert_pool_idle(eng)
        recs = [r for r in eng.records if r.spec_verify]
        assert sum(r.spec_proposed for r in recs) > 0, f"{mode} k={k}: no drafts were proposed"
        accepted += sum(r.spec_accepted for r in recs)
        for o in last.values():
            verify_ct, proposed, acc = o.spec
            assert o.completion_tokens == 14 and verify_ct + acc == 13   # the first token came from P
    assert accepted > 0, f"{mode}: no draft was ever accepted"


@pytest.mark.parametrize("mode", MODES)
def test_stop_and_length_hold_mid_acceptance(tiny_model, mode):
    """A stop token or max_new_tokens inside an accepted run ends the output right there."""
    base = _BASE.get(mode) or run_all(engine_for(tiny_model, mode), PROMPTS, max_new_tokens=14, ignore_eos=True)[0]
    stop = base["r3"][5]                       # a token the output reaches mid-way
    want, _ = run_all(engine_for(tiny_model, mode), PROMPTS, max_new_tokens=14, ignore_eos=True,
                      stop_token_ids=[stop])
    assert len(want["r3"]) == base["r3"].index(stop) + 1
    for k in (2, 4):
        eng = engine_for(tiny_model, mode, spec_k=k)
        got, last = run_all(eng, PROMPTS, max_new_tokens=14, ignore_eos=True, stop_token_ids=[stop])
        assert got == want and last["r3"].finish_reason["matched"] == stop
        assert_pool_idle(eng)
        eng = engine_for(tiny_model, mode, spec_k=k)
        short, _ = run_all(eng, PROMPTS, max_new_tokens=3, ignore_eos=True)
        assert short == {rid: ids[:3] for rid, ids in base.items()}
        assert_pool_idle(eng)


def test_kv_rollback_under_a_tight_pool(tiny_model):
    """Drafts take only blocks the plan left free and give the rejected ones back: with a pool
    that barely holds the requests, outputs still match and every block returns."""
    base, _ = run_all(engine_for(tiny_model, "pd", num_blocks=24), PROMPTS, max_new_tokens=14, ignore_eos=True)
    eng = engine_for(tiny_model, "pd", spec_k=4, num_blocks=24)
    for i, p in enumerate(PROMPTS):
        eng.submit(f"r{i}", p, SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True))
    got: dict[str, list[int]] = {}
    sched, rolled = eng.schedulers[0], 0
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.rid, []).extend(o.new_token_ids)
        rec = eng.records[-1]
        rolled += rec.spec_proposed - rec.spec_accepted
        # after every step a decode row holds exactly the blocks of its valid KV: rejected drafts'
        # blocks went back (else the planner's one-block-per-row decode need would be wrong)
        for r in sched.reqs.values():
            if r.status.value == "decode":
                assert len(r.reservation.blocks) == sched.pool.blocks_for(r.computed), r.rid
                assert r.computed == len(r.tokens) - 1
    assert got == base and rolled > 0
    assert_pool_idle(eng)


def test_bad_speculation_config_is_a_clear_error(tiny_model):
    for k in (0, 9):
        with pytest.raises(ValueError, match="speculative_k must be in 1..8"):
            EngineConfig(model=str(tiny_model), speculative="ngram", speculative_k=k)
    with pytest.raises(ValueError, match="config.json declares no num_nextn_predict_layers"):
        EngineConfig(model=str(tiny_model), speculative="mtp")   # no MTP head (tests/engine/test_mtp.py)


# --- temperature > 0 ---------------------------------------------------------------------------

def test_rejection_sampling_matches_the_target_distribution():
    """The acceptance rule alone, with a point-mass draft: the first emitted token is distributed as
    p0, and the pair (first, second) given the first draft accepted as p0(d0) * p1.

    N = 20000 draws, chi-square at alpha = 1e-3 over the categories with expected count >= 5.
    Power: a rule that always accepted the draft (or never did) moves ~0.2 of mass, a chi-square
    of thousands, rejected with power ~1; a shift of total variation 0.03 on these ~10 categories
    gives a noncentrality >= N * 4 * 0.03^2 / 1 = 72, power > 0.99 at alpha = 1e-3."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 12, generator=g) * 1.5
    sp = SamplingParams(temperature=1.0)
    p0, p1 = _probs(logits[0], sp), _probs(logits[1], sp)
    drafts = [int(torch.argsort(p0)[-2]), int(torch.argmax(p1))]   # a likely, not the likeliest, draft
    gen = torch.Generator().manual_seed(1)
    n = 20000
    first = torch.zeros(12)
    pair = torch.zeros(12)
    for _ in range(n):
        out = verify(logits, drafts, sp, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            pair[out[1]] += 1
    for counts, expected in ((first, p0 * n), (pair, p0[drafts[0]] * p1 * n)):
        keep = expected >= 5
        stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
        assert chi2_sf(stat, int(keep.sum()) - 1) > 1e-3, (counts, expected)
    # The rule does accept: the draft's rate is p0(d0) (3 sigma of a binomial)
    rate = first[drafts[0]] / n
    assert abs(rate - p0[drafts[0]]) < 3 * math.sqrt(p0[drafts[0]] * (1 - p0[drafts[0]]) / n)


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    """tiny_model's target with a random one-layer MTP head (`mtp.*`)."""
    return write_checkpoint(tiny_config(vocab_size=VOCAB, num_nextn_predict_layers=1),
                            tmp_path_factory.mktemp("mtp-target"), seed=0)


@pytest.mark.parametrize("proposer", ["ngram", "draft", "mtp"])
def test_sampled_outputs_follow_the_target_end_to_end(tiny_model, mtp_target, proposer):
    """Through the engine with top-k 2 at temperature 0.8, on a prompt that ends in the model's own
    greedy loop (so n-gram drafts are often right and often wrong): the pair of tokens after the
    first (both emitted by verify rows) over N = 300 seeded requests per arm has the same
    distribution with and without speculation. Two-sample chi-square (homogeneity) at alpha = 1e-3
    over the <= 4 pairs. Power: a shift of 0.15 in one pair's probability (around 0.5) gives a
    noncentrality ~ 300/2 * 0.15^2 / 0.25 * 2 = 27 on <= 3 degrees of freedom, power > 0.9; the
    acceptance rule alone is checked with power > 0.99 above. The draft proposer runs the target
    as its own draft: its greedy drafts are accepted with probability p(argmax) < 1. The MTP head is
    random: its drafts are right less often, but every one goes through the same rule."""
    model = mtp_target if proposer == "mtp" else tiny_model
    head = [5, 9, 13, 5, 9, 13, 5, 9]
    loop, _ = run_all(engine_for(model, "pd"), [head], max_new_tokens=16, ignore_eos=True)
    prompt = head + loop["r0"]
    n = 300
    pairs = {}
    for k in (0, 3):
        draft = {"speculative": "draft", "draft_model": str(tiny_model)} if proposer == "draft" else \
            {"speculative": proposer}
        eng = engine_for(model, "pd", spec_k=k, max_running=n, num_blocks=8 * n, **(draft if k else {}))
        eng.set_control(ControlSettings(prefill_budget_tokens=1 << 14))
        for i in range(n):
            eng.submit(f"s{i}", prompt, SamplingParams(max_new_tokens=3, temperature=0.8, top_k=2,
                                                      ignore_eos=True, seed=1000 * k + i))
        out: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for o in eng.step():
                out.setdefault(o.rid, []).extend(o.new_token_ids)
        if k:
            recs = [r for r in eng.records if r.spec_verify]
            proposed, accepted = sum(r.spec_proposed for r in recs), sum(r.spec_accepted for r in recs)
            assert 0 < accepted < proposed, (accepted, proposed)   # both branches of the rule ran
        assert_pool_idle(eng)
        pairs[k] = [tuple(v[1:3]) for v in out.values()]
    cats = sorted(set(pairs[0]) | set(pairs[3]))
    table = [[x.count(c) for c in cats] for x in (pairs[0], pairs[3])]
    stat = sum((table[x][c] - (table[0][c] + table[1][c]) / 2) ** 2 / ((table[0][c] + table[1][c]) / 2)
               for c in range(len(cats)) for x in (0, 1))
    assert len(cats) > 1 and chi2_sf(stat, len(cats) - 1) > 1e-3, (cats, table)


# --- the draft-model proposer --------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A one-layer random checkpoint with the target's vocabulary (what `pdrollout checkpoint` writes)."""
    return write_checkpoint(tiny_config(vocab_size=VOCAB, num_hidden_layers=1), tmp_path_factory.mktemp("draft"),
                            seed=5)


@pytest.mark.parametrize("mode", MODES)
def test_greedy_identical_with_a_draft_model(tiny_model, small_draft, mode):
    if mode not in _BASE:
        _BASE[mode] = run_all(engine_for(tiny_model, mode), PROMPTS, max_new_tokens=14, ignore_eos=True)[0]
    for k in (1, 2, 3, 4):
        eng = engine_for(tiny_model, mode, spec_k=k, speculative="draft", draft_model=str(small_draft))
        out, last = run_all(eng, PROMPTS, max_new_tokens=14, ignore_eos=True)
        assert out == _BASE[mode], f"{mode} k={k}"
        assert_pool_idle(eng)
        assert all(o.spec[1] > 0 for o in last.values())    # a draft model always proposes
    # The target as its own draft: every greedy draft is the target's token, so all are accepted;
    # this checks the draft's KV (fed only what the target accepted) stays right across steps.
    eng = engine_for(tiny_model, mode, spec_k=3, speculative="draft", draft_model=str(tiny_model))
    out, last = run_all(eng, PROMPTS, max_new_tokens=14, ignore_eos=True)
    assert out == _BASE[mode]
    for o in last.values():
        verify_ct, proposed, accepted = o.spec
        assert accepted == proposed > 0 and verify_ct + accepted == 13


def test_draft_model_with_another_vocabulary_is_a_clear_error(tiny_model, tmp_path):
    other = write_checkpoint(tiny_config(vocab_size=VOCAB + 1, num_hidden_layers=1), tmp_path / "d", seed=0)
    with pytest.raises(ValueError, match="a vocabulary of 25 tokens, the target's has 24"):
        EngineConfig(model=str(tiny_model), speculative="draft", draft_model=str(other))
    with pytest.raises(ValueError, match="needs draft_model"):
        EngineConfig(model=str(tiny_model), speculative="draft")


def test_logprobs_of_verified_tokens_match_without_speculation(tiny_model):
    """return_logprob: each token a verify row emits carries the target's logprob at its position."""
    runs = []
    for k in (0, 3):
        eng = engine_for(tiny_model, "pd", spec_k=k)
        toks, lps = run_logprobs(eng, PROMPTS, max_new_tokens=10, ignore_eos=True)
        if k:
            assert sum(r.spec_accepted for r in eng.records) > 0
        runs.append((toks, lps))
    assert runs[0][0] == runs[1][0]
    for rid in runs[0][1]:
        assert runs[1][1][rid] == pytest.approx(runs[0][1][rid], abs=1e-4)


# --- the proposers' caches inside the KV budget ----------------------------------------------------

@pytest.mark.parametrize("proposer", ["draft", "draft-bf16", "mtp"])
def test_proposer_caches_come_out_of_the_kv_budget(tiny_model, mtp_target, small_draft, tmp_path, proposer):
    """Rank 0 holds the target's cache and one proposer cache (num_blocks + spare blocks) per replica:
    together inside kv_cache_bytes, and no block left over that would still have fit. A bf16 draft
    beside an fp32 target costs half an fp32 draft's block (its dtype is known before it loads)."""
    from pdrollout.engine.model.kv_cache import KVCache
    from pdrollout.engine.runtime.kv_budget import spare_blocks
    budget, k = 3 << 20, 3
    target = mtp_target if proposer == "mtp" else tiny_model
    extra = {}
    if proposer == "draft":
        extra = {"draft_model": str(small_draft)}
    elif proposer == "draft-bf16":
        extra = {"draft_model": str(write_checkpoint(tiny_config(vocab_size=VOCAB, num_hidden_layers=1), tmp_path,
                                                     seed=5, dtype="bfloat16"))}
    config = EngineConfig(model=str(target), block_size=4, kv_cache_bytes=budget, max_running=8,
                          speculative=proposer.split("-")[0], speculative_k=k, **extra)
    eng = Engine(config)
    caches = [p.kv for p in eng.proposer_memory.proposers]
    w = eng.worker
    per = KVCache.bytes_per_block(w.cfg.num_hidden_layers, 4, w.cfg.num_key_value_heads, w.cfg.head_dim, w.dtype)
    one = [c.nbytes() // (c.shape[0] // 4) for c in caches]            # a proposer cache's bytes per block
    held = w.num_blocks * per + sum((w.num_blocks + spare_blocks(config)) * b for b in one)
    assert held <= budget < held + per + sum(one)
    assert all(c.shape[0] // 4 == w.num_blocks + spare_blocks(config) + 1 for c in caches)   # + the null block
    plain = Engine(EngineConfig(model=str(target), block_size=4, kv_cache_bytes=budget, max_running=8))
    assert w.num_blocks < plain.worker.num_blocks == budget // per
    draft_dtype = caches[0].k[0].dtype
    assert draft_dtype == (torch.bfloat16 if proposer == "draft-bf16" else w.dtype)
    out, _ = run_all(eng, [[1, 2, 3, 4, 5]], max_new_tokens=6)    # and it serves
    assert len(out["r0"]) == 6
    with pytest.raises(ValueError, match="holds no block beside the 1 .* proposer cache"):
        Engine(EngineConfig(model=str(target), block_size=4, kv_cache_bytes=per, max_running=8,
                            speculative=proposer.split("-")[0], speculative_k=k, **extra))


def test_greedy_acceptance_stops_at_the_first_mismatch_with_the_targets_token():
    """accept_greedy (the worker's batched path: one argmax for every verify row) emits what
    verify's greedy path does: the drafts up to the first mismatch, then the target's token there
    (or after the last draft)."""
    from pdrollout.engine.runtime.sampler import accept_greedy
    target = [4, 7, 1, 9]
    assert accept_greedy(target, [4, 7, 1]) == [4, 7, 1, 9]     # all accepted + the bonus token
    assert accept_greedy(target, [4, 2, 1]) == [4, 7]           # rejected at 1: the target's 7
    assert accept_greedy(target, [5, 7, 1]) == [4]
    assert accept_greedy(target[:1], []) == [4]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 10, generator=g)
    greedy = SamplingParams(temperature=0.0)
    for drafts in ([int(logits[0].argmax()), 3, 5], [int(logits[0].argmax()), int(logits[1].argmax()), 0], [1, 2, 3]):
        assert verify(logits, drafts, greedy, g) == accept_greedy(logits.argmax(-1).tolist(), drafts)
