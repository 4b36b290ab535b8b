"""Speculative decoding on 4 ranks through the real CLI: the verify rows are D rows of the
rank-shared plan, so every rank runs them in the same D iteration (the turnstile orders one D
step); greedy outputs equal one rank's without speculation in every mode. The MTP head runs on
rank 0 from every replica leader's hidden states: every request gets drafts. Bad speculation
flags fail before any rank starts."""
from __future__ import annotations

import json

import pytest

from conftest import tiny_config
from pdrollout.engine.cli import main
from pdrollout.engine.model.checkpoint import write_checkpoint
from tests.distributed.test_mp_engine import BUDGET, ENGINE, FINE, _outputs, _run

pytestmark = pytest.mark.timeout(600)
VOCAB = 24   # a random model of this vocabulary loops within a few tokens: drafts are often right
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [(i * 7) % VOCAB for i in range(11)] * 2, [3, 1, 4, 1, 5, 9, 2, 6],
           [7, 7, 7, 7, 7, 7]]


@pytest.fixture(scope="session")   # per worker: each test a unit of its own (tests/lanes.py)
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    model = write_checkpoint(tiny_config(vocab_size=VOCAB), d / "loopy", seed=0)
    reqs = d / "reqs.jsonl"
    reqs.write_text("".join(json.dumps({"rid": f"r{i}", "input_ids": p, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}) + "\n" for i, p in enumerate(PROMPTS)))
    draft = write_checkpoint(tiny_config(vocab_size=VOCAB, num_hidden_layers=1), d / "draft", seed=5)
    mtp = write_checkpoint(tiny_config(vocab_size=VOCAB, num_nextn_predict_layers=1), d / "mtp", seed=0)
    return str(model), str(reqs), str(draft), str(mtp)


def _generate(setup, mode, control, extra=(), timeout=240, model=None):
    _, reqs, *_ = setup
    model = model or setup[0]
    return _run(["generate", "--model", model, "--requests", reqs, "--mode", mode, "--engine-config",
                 json.dumps(ENGINE), "--control", json.dumps({**BUDGET, **control}), *extra], timeout)


CASES = [("ngram", "pd", FINE, 3, ["--nproc", "4", "--adp", "2", "--ep", "4", "--slots", "1"]),   # crossed ATP2/ADP2
         ("ngram", "normal", {}, 4, ["--nproc", "4", "--adp", "2", "--ep", "4"]),
         ("ngram", "mixed", {}, 1, ["--nproc", "4", "--adp", "4", "--ep", "4"]),
         ("draft", "pd", {"ordering": "fine-grained", "span": "auto"}, 2, ["--nproc", "4", "--adp", "2", "--ep", "4"]),
         ("mtp", "pd", FINE, 3, ["--nproc", "4", "--adp", "2", "--ep", "4", "--slots", "1"]),   # crossed ATP2/ADP2
         ("mtp", "normal", {}, 2, ["--nproc", "4", "--adp", "2", "--ep", "4"]),
         ("mtp", "mixed", {}, 2, ["--nproc", "4", "--adp", "4", "--ep", "4"]),
         ("ngram", "pd", FINE, 3, ["--nproc", "4", "--adp", "4", "--ep", "4"]),   # uncrossed ATP1
         ("mtp", "pd", FINE, 2, ["--nproc", "2", "--adp", "2", "--ep", "2"])]       # uncrossed ATP1


@pytest.mark.parametrize("proposer,mode,control,k,ranks", CASES,
                         ids=[f"{c[0]}-{c[1]}-k{c[3]}-adp{c[4][3]}" for c in CASES])
def test_greedy_with_speculation_on_4_ranks_equals_one_rank_without(setup, proposer, mode, control, k, ranks):
    model = setup[3] if proposer == "mtp" else setup[0]
    res = _generate(setup, mode, control, model=model)
    ref = _outputs(res)
    draft = ["--draft-model", setup[2]] if proposer == "draft" else []
    got_res = _generate(setup, mode, control, ["--speculative", proposer, "--speculative-k", str(k), *draft, *ranks],
                        model=model)
    assert _outputs(got_res) == ref
    metas = [json.loads(line)["meta_info"] for line in got_res.stdout.splitlines()]
    if proposer == "mtp":   # a random head's drafts are seldom right: every request gets drafts, and the
        # same ones as on one rank (rank 0's unsharded head reads the leaders' hidden states)
        assert all(m["spec_proposed_drafts"] > 0 for m in metas), metas
        one = _generate(setup, mode, control, ["--speculative", proposer, "--speculative-k", str(k)], model=model)
        spec = lambda ms: [{key: v for key, v in m.items() if key.startswith("spec_")} for m in ms]
        assert spec(metas) == spec(json.loads(line)["meta_info"] for line in one.stdout.splitlines())
    else:
        assert sum(m["spec_accepted_drafts"] for m in metas) > 0
    assert all(m["spec_verify_ct"] + m["spec_accepted_drafts"] == 11 for m in metas)   # first token: P
    assert all("spec_verify_ct" not in json.loads(line)["meta_info"] for line in res.stdout.splitlines())


@pytest.mark.parametrize("flags,message", [
    (["--speculative", "draft"], "--speculative draft needs --draft-model DIR"),
    (["--speculative", "ngram", "--draft-model", "x"], "--draft-model is only used by --speculative draft"),
    (["--speculative-k", "2"], "--speculative-k and --draft-model need --speculative"),
    (["--speculative", "ngram", "--speculative-k", "9"], "speculative_k must be in 1..8"),
    (["--speculative", "mtp"], "declares no num_nextn_predict_layers")])
def test_bad_speculation_flags_are_a_clear_error_before_any_rank(setup, capsys, flags, message):
    """In process: the flags are checked before a rank (or the model) is touched."""
    model, reqs, *_ = setup
    rc = main(["generate", "--model", model, "--requests", reqs, *flags, "--nproc", "4", "--adp", "2", "--ep", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
