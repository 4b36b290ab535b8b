"""Speculative decoding with the target's own MTP head (`--speculative mtp`, runtime/mtp.py):
greedy outputs equal those without speculation in every mode and for k = 1..4 (Engine and CLI),
the proposer's drafts equal a reference MTP computation written here (full sequence, no cache,
transformers for the target's hidden states), a head built to predict the target exactly gets
every draft accepted, the head's KV and hidden-state buffers keep their invariants after every
step, and the checkpoint layout (Qwen3-Next's `mtp.*`) loads or fails clearly."""
from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import tiny_config
from pdrollout.engine.cli import main
from pdrollout.engine.model.checkpoint import random_model, write_checkpoint
from pdrollout.engine.model.loader import CheckpointError, load_model
from pdrollout.engine.protocol.config import ControlSettings, EngineConfig, ModelConfig
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.runtime.launcher import check_device
from tests.engine.test_speculative import run_all as spec_run_all

MODES = ["normal", "mixed", "pd"]
VOCAB = 24
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [(i * 7) % VOCAB for i in range(11)] * 2, [3, 1, 4, 1, 5, 9, 2, 6],
           [7, 7, 7, 7, 7, 7]]
NEW = 14


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """The 24-token tiny model with a one-layer MTP head (random, the same init scales)."""
    return write_checkpoint(tiny_config(vocab_size=VOCAB, num_nextn_predict_layers=1),
                            tmp_path_factory.mktemp("mtp"), seed=0)


def engine_for(model_dir, mode, k=0, **kw) -> Engine:
    control = ControlSettings(prefill_budget_tokens=24, span="auto")
    spec = {"speculative": "mtp", "speculative_k": k} if k else {}
    return Engine(EngineConfig(model=str(model_dir), mode=mode, block_size=4, num_blocks=kw.pop("num_blocks", 256),
                               mixed_chunk_tokens=20, control=control, **spec, **kw))


def run_all(engine: Engine, prompts, check=None, **sp) -> tuple[dict, dict]:
    return spec_run_all(engine, prompts, check, **{"max_new_tokens": NEW, "ignore_eos": True, **sp})


def check_invariants(engine: Engine) -> None:
    """After every step: a decode row holds exactly the target blocks of its valid KV (rejected
    drafts rolled back); the head's valid entries are the shifted accepted tokens, its blocks
    cover them (plus the chain; with the kept entries, every block it uses), and its buffer of
    target hidden states starts at its last valid entry and holds at most the positions of one
    verify row after it (or, for entries adopted from an earlier turn, every state since the
    target's prefix hit)."""
    s, m = engine.schedulers[0], engine.mtps[0]
    k = engine.config.speculative_k
    for r in s.reqs.values():
        if r.status.value != "decode":
            continue
        assert len(r.reservation.blocks) == s.pool.blocks_for(r.computed) and r.computed == len(r.tokens) - 1
        seen = m.seen.get(r.rid)
        if seen:
            assert seen == r.tokens[1:len(seen) + 1], r.rid
            assert len(m.blocks[r.rid]) >= m.pool.blocks_for(len(seen))
            base, h = m.hidden[r.rid]
            assert base <= len(seen) - 1 and base + len(h) >= r.computed, (r.rid, base, len(h), len(seen))
            # after a propose the buffer starts at the last valid entry and holds one verify row past
            # it; entries adopted at admission, none proposed from yet: every state since the hit
            assert len(h) <= k + 2 or base + len(h) == r.computed, (r.rid, len(h))
    held = sum(len(b) for b in m.blocks.values()) + sum(len(e[2]) for e in m.kept.values())
    assert m.pool.num_used() == held


def assert_idle(engine: Engine) -> None:
    for s in engine.schedulers:
        assert s.pool.num_used() == 0 and not s.reservations.live and not s.reservations.draining
    m = engine.mtps[0]
    m.forget(set())   # what the next propose does for finished requests: their entries are kept
    assert m.pool.num_used() == sum(len(e[2]) for e in m.kept.values()) and not m.hidden and not m.blocks
    m.clear()
    assert m.pool.num_used() == 0 and not m.kept


_BASE: dict[str, dict] = {}


def base(model, mode):
    if (model, mode) not in _BASE:
        _BASE[model, mode] = run_all(engine_for(model, mode), PROMPTS)[0]
    return _BASE[model, mode]


@pytest.mark.parametrize("mode", MODES)
def test_greedy_identical_with_mtp_speculation(mtp_model, mode):
    want = base(mtp_model, mode)
    for k in (1, 2, 3, 4):
        eng = engine_for(mtp_model, mode, k)
        out, last = run_all(eng, PROMPTS, check=check_invariants)
        assert out == want, f"{mode} k={k}"
        assert_idle(eng)
        recs = [r for r in eng.records if r.spec_verify]
        assert sum(r.spec_proposed for r in recs) == sum(o.spec[1] for o in last.values())
        for o in last.values():
            verify_ct, proposed, accepted = o.spec
            assert proposed > 0 and o.completion_tokens == NEW and verify_ct + accepted == NEW - 1


def test_mtp_with_p_epochs_beside_d_and_a_tight_pool(mtp_model):
    """pd with solo_overlap (P on a thread of its own: its hidden states arrive steps later), a
    pool that barely holds the requests (drafts shrink to the free blocks), and P through its
    piecewise forward (the hidden states from its final norm): outputs unchanged."""
    for mode, kw, k in (("pd", {"solo_overlap": True}, 3), ("mixed", {"num_blocks": 24}, 2),
                        ("pd", {"solo_overlap": True, "prefill_graph_tokens": 16}, 2)):
        want = run_all(engine_for(mtp_model, mode, **kw), PROMPTS)[0]
        eng = engine_for(mtp_model, mode, k, **kw)
        assert run_all(eng, PROMPTS, check=check_invariants)[0] == want, mode
        assert_idle(eng)
        if "prefill_graph_tokens" in kw:   # P's pieces ran (eagerly on CPU) and fed the head
            assert eng.worker.p_graphs.replays > 0



def two_turns(engine: Engine, check=None) -> tuple[dict, dict]:
    """Every prompt, then each conversation's next turn (the same rid): its first turn's tokens and
    five new ones. Returns the second turns' (tokens, last outputs)."""
    first = run_all(engine, PROMPTS, check)[0]
    turns = [p + first[f"r{i}"] + [(5 * i + j) % VOCAB for j in range(5)] for i, p in enumerate(PROMPTS)]
    return run_all(engine, turns, check)


@pytest.mark.parametrize("mode,kw", [("normal", {}), ("mixed", {"num_blocks": 40}), ("pd", {"solo_overlap": True})])
def test_agent_turns_keep_the_prefix_cache_under_mtp(mtp_model, mode, kw):
    """An agent's next turn adopts its first turn's head entries, and the target reuses its prefix up
    to them (before, MTP turned the prefix cache off): outputs equal those without speculation, with
    a pool tight enough that kept entries make room (mixed), and beside P epochs (pd)."""
    want_out, want_last = two_turns(engine_for(mtp_model, mode, **kw))
    eng = engine_for(mtp_model, mode, 2, **kw)
    out, last = two_turns(eng, check_invariants)
    assert out == want_out
    hits = [o.cached_tokens for o in last.values()]
    assert sum(hits) > 0 and all(h <= w.cached_tokens for h, w in zip(hits, want_last.values())), hits
    assert all(o.spec[1] > 0 for o in last.values())
    eng.mtps[0].forget(set())
    assert eng.mtps[0].kept and eng.flush_cache() and not eng.mtps[0].kept   # kept entries go with the cache
    assert_idle(eng)


# --- the drafts against a reference computation -------------------------------------------------

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """Half-split rotary embedding of x [T, heads, d] (Qwen3's convention)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None].float(), torch.cat([ang.sin()] * 2, -1)[:, None].float()
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def reference_mtp(w: dict, cfg: ModelConfig, hidden: torch.Tensor, next_tokens: list[int]):
    """The MTP head over a whole sequence, no cache: entry i = (hidden[i], token next_tokens[i]) at
    position i. Returns (logits [T, V], the head's final hidden states [T, H])."""
    eps, p = cfg.rms_norm_eps, "mtp.layers.0."
    e = _rms(w["model.embed_tokens.weight"][next_tokens], w["mtp.pre_fc_norm_embedding.weight"], eps)
    h = _rms(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)
    x = torch.cat([e, h], -1) @ w["mtp.fc.weight"].T
    t, nh, nkv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    a = _rms(x, w[p + "input_layernorm.weight"], eps)
    q = (a @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, d)
    k = (a @ w[p + "self_attn.k_proj.weight"].T).view(t, nkv, d)
    v = (a @ w[p + "self_attn.v_proj.weight"].T).view(t, nkv, d)
    pos = torch.arange(t)
    q = _rope(_rms(q, w[p + "self_attn.q_norm.weight"], eps), pos, cfg.rope_theta)
    k = _rope(_rms(k, w[p + "self_attn.k_norm.weight"], eps), pos, cfg.rope_theta)
    rep = nh // nkv
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    x = x + o.transpose(0, 1).reshape(t, nh * d) @ w[p + "self_attn.o_proj.weight"].T
    a = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
    probs = torch.softmax(a @ w[p + "mlp.gate.weight"].T, -1)
    top, ids = torch.topk(probs, cfg.num_experts_per_tok, -1)
    if cfg.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    moe = torch.zeros_like(x)
    for row in range(t):
        for j in range(cfg.num_experts_per_tok):
            ep = f"{p}mlp.experts.{int(ids[row, j])}."
            y = F.silu(a[row] @ w[ep + "gate_proj.weight"].T) * (a[row] @ w[ep + "up_proj.weight"].T)
            moe[row] += top[row, j] * (y @ w[ep + "down_proj.weight"].T)
    out = _rms(x + moe, w["mtp.norm.weight"], eps)
    return out @ w["lm_head.weight"].T, out


def test_mtp_drafts_equal_a_reference_computation(mtp_model):
    """For every propose call of a run: draft 1 from the target's final hidden states (transformers)
    at positions 0..n-2 paired with tokens 1..n-1; drafts 2..k from the head's own last hidden
    state paired with the previous draft. A wrong offset, concat order or hidden state fails this."""
    from hf_reference import hf_model
    hf = hf_model(str(mtp_model))
    w = load_file(str(mtp_model / "model.safetensors"))
    cfg = ModelConfig.load(mtp_model)
    eng = engine_for(mtp_model, "pd", 3)
    calls = []
    proposer = eng.schedulers[0].proposer
    propose = proposer.propose

    def spy(wants, alive):
        got = propose(wants, alive)
        calls.append(([(rid, list(toks), k) for rid, toks, k in wants], got))
        return got
    proposer.propose = spy
    adopt, adopted = proposer.adopt, []
    proposer.adopt = lambda rid, toks: adopted.append(adopt(rid, toks)) or adopted[-1]
    out = run_all(eng, PROMPTS[:2], max_new_tokens=8)[0]
    # the agents' next turns (the same rids, as a client may reuse them): each adopts its first
    # turn's head entries and the target reuses its prefix up to them, so the drafts below also
    # check entries computed a turn earlier
    turns = [p + out[f"r{i}"] + [(3 * i + j) % VOCAB for j in range(5)] for i, p in enumerate(PROMPTS[:2])]
    last = run_all(eng, turns, max_new_tokens=8)[1]
    assert adopted[:2] == [0, 0] and all(n > len(p) for n, p in zip(adopted[2:], PROMPTS)), adopted
    for i, o in enumerate(last.values()):   # the target's hit: whole blocks up to the head's entries
        assert o.cached_tokens == adopted[2 + i] // 4 * 4 > 0, (o.cached_tokens, adopted)
    checked = 0
    for wants, got in calls:
        for rid, toks, k in wants:
            with torch.no_grad():
                target = hf.model(torch.tensor([toks[:-1]])).last_hidden_state[0]   # after the final norm
                hidden, nxt, drafts = target, list(toks[1:]), []
                for _ in range(k):
                    logits, out = reference_mtp(w, cfg, hidden, nxt)
                    drafts.append(int(logits[-1].argmax()))
                    hidden, nxt = torch.cat([hidden, out[-1:]]), nxt + [drafts[-1]]
            assert got[rid] == drafts, (rid, toks, got[rid], drafts)
            checked += 1
    assert checked >= 6


# --- a head that predicts the target exactly ----------------------------------------------------

@pytest.fixture(scope="module")
def exact_model(tmp_path_factory):
    """A target whose layers add nothing (o_proj and expert down_proj zero: its next token is a
    function of the current one, f(t) = argmax lm_head(norm(embed t))), and an MTP head that
    computes the same f of its input token: fc keeps only the normalized embedding, its layer adds
    nothing, its final norm is the target's. Entry i (token i+1) then predicts f(token i+1) =
    the target's token i+2, so every draft, chained ones included, is accepted."""
    d = write_checkpoint(tiny_config(vocab_size=VOCAB, num_nextn_predict_layers=1),
                         tmp_path_factory.mktemp("exact"), seed=3)
    f = d / "model.safetensors"
    w = load_file(str(f))
    h = w["mtp.fc.weight"].shape[0]
    for key in w:
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            w[key] = torch.zeros_like(w[key])
    w["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
    w["mtp.pre_fc_norm_embedding.weight"] = torch.ones(h)
    w["mtp.norm.weight"] = w["model.norm.weight"].clone()
    save_file(w, str(f), metadata={"format": "pt"})
    return d


def test_a_propose_call_copies_its_drafts_to_the_host_once(mtp_model, monkeypatch):
    """Draft j + 1 takes draft j on the device: however many drafts a row gets, a propose call
    reads the GPU once (a copy per draft step waited for the GPU k times a D iteration)."""
    eng = engine_for(mtp_model, "normal", 4)
    proposer, per_call = eng.schedulers[0].proposer, []
    propose, tolist = proposer.propose, torch.Tensor.tolist
    counting = []

    def counted(self):   # the proposer's own reads (on CPU the reference ops read the host too)
        if counting and sys._getframe(1).f_code.co_filename.endswith(("draft.py", "mtp.py")):
            counting[-1] += 1
        return tolist(self)

    def spy(wants, alive):
        counting.append(0)
        got = propose(wants, alive)
        per_call.append((counting.pop(), max((len(d) for d in got.values()), default=0)))
        return got
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    proposer.propose = spy
    run_all(eng, PROMPTS)
    drafted = [n for n, most in per_call if most]
    assert any(most >= 3 for _, most in per_call), per_call   # chained calls were made
    assert drafted and set(drafted) == {1}, per_call


def test_an_exact_head_gets_every_draft_accepted(exact_model):
    for mode in ("pd", "mixed"):
        eng = engine_for(exact_model, mode, 3)
        out, last = run_all(eng, PROMPTS, check=check_invariants)
        assert out == base(exact_model, mode)
        assert_idle(eng)
        for o in last.values():
            verify_ct, proposed, accepted = o.spec
            assert accepted == proposed > 0 and verify_ct + accepted == NEW - 1, o.spec


# --- the CLI ------------------------------------------------------------------------------------

def test_cli_generate_with_mtp(mtp_model, tmp_path, capsys):
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("".join(json.dumps({"rid": f"r{i}", "input_ids": p, "sampling_params": {
        "max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}) + "\n" for i, p in enumerate(PROMPTS)))
    engine = json.dumps({"block_size": 4, "num_blocks": 256})
    for mode in MODES:
        runs = []
        for flags in ([], ["--speculative", "mtp", "--speculative-k", "2"]):
            assert main(["generate", "--model", str(mtp_model), "--requests", str(reqs), "--mode", mode,
                         "--engine-config", engine, *flags]) == 0
            runs.append([json.loads(line) for line in capsys.readouterr().out.splitlines()])
        assert [r["output_ids"] for r in runs[0]] == [r["output_ids"] for r in runs[1]], mode
        metas = [r["meta_info"] for r in runs[1]]
        assert all(m["spec_proposed_drafts"] > 0 and m["spec_verify_ct"] + m["spec_accepted_drafts"] == 9
                   for m in metas)
        assert all("spec_verify_ct" not in r["meta_info"] for r in runs[0])


def test_bad_mtp_flags_are_a_clear_error(mtp_model, tmp_path, capsys):
    plain = write_checkpoint(tiny_config(vocab_size=VOCAB), tmp_path / "plain", seed=0)
    reqs = tmp_path / "r.jsonl"
    reqs.write_text(json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}) + "\n")
    cases = [([str(plain), "--speculative", "mtp"], "declares no num_nextn_predict_layers"),
             ([str(mtp_model), "--speculative", "mtp", "--draft-model", str(plain)],
              "--draft-model is only used by --speculative draft")]
    for (model, *flags), message in cases:
        assert main(["generate", "--model", model, "--requests", str(reqs), *flags]) == 2
        assert message in capsys.readouterr().err, message
    # several ranks are fine (tests/distributed/test_spec_ranks.py)
    check_device(EngineConfig(model=str(mtp_model), speculative="mtp"), None)


# --- the checkpoint layout ----------------------------------------------------------------------

def test_mtp_layout_loads_and_fails_clearly(mtp_model, tmp_path):
    w = load_file(str(mtp_model / "model.safetensors"))
    keys = {k for k in w if k.startswith("mtp.")}
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.gate.weight",
            "mtp.layers.0.mlp.experts.7.down_proj.weight"} <= keys
    assert tuple(w["mtp.fc.weight"].shape) == (64, 128)
    m = load_model(mtp_model, mtp=True)
    got = dict(m.named_parameters())
    assert torch.equal(got["mtp.fc.weight"], w["mtp.fc.weight"])
    assert torch.equal(got["mtp.layers.0.mlp.experts.gate_up_proj"][3][:32], w["mtp.layers.0.mlp.experts.3.gate_proj.weight"])
    assert load_model(mtp_model).mtp is None            # not --speculative mtp: the head stays on disk
    fused = write_checkpoint(tiny_config(vocab_size=VOCAB, num_nextn_predict_layers=1), tmp_path / "fused",
                             seed=0, layout="fused")
    assert torch.equal(dict(load_model(fused, mtp=True).named_parameters())["mtp.layers.0.mlp.experts.down_proj"],
                       got["mtp.layers.0.mlp.experts.down_proj"])
    # a missing MTP tensor names it and the field that asked for it
    (tmp_path / "missing").mkdir()
    save_file({k: v for k, v in w.items() if k != "mtp.norm.weight"}, str(tmp_path / "missing/model.safetensors"))
    (tmp_path / "missing/config.json").write_text((mtp_model / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"missing tensor 'mtp.norm.weight' .*num_nextn_predict_layers=1"):
        load_model(tmp_path / "missing", mtp=True)
    # MTP tensors with a config that declares no head: an error, not a silent drop
    (tmp_path / "undeclared").mkdir()
    save_file(w, str(tmp_path / "undeclared/model.safetensors"))
    cfg = json.loads((mtp_model / "config.json").read_text())
    del cfg["num_nextn_predict_layers"]
    (tmp_path / "undeclared/config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"'mtp\..*declares no num_nextn_predict_layers"):
        load_model(tmp_path / "undeclared")


def test_weight_updates_know_the_mtp_layout(mtp_model):
    """update_weights_from_disk's checks and writes: the head's keys are known (per-expert keys of
    layer num_hidden_layers + j), and left alone by a model that runs without its head."""
    from pdrollout.engine.model.qwen3_moe import Shard
    from pdrollout.engine.model.weights import WeightMap, checkpoint_shapes
    shapes = checkpoint_shapes(mtp_model)
    cfg = ModelConfig.load(mtp_model)
    with_head = load_model(mtp_model, mtp=True)
    fc = dict(with_head.named_parameters())["mtp.fc.weight"]
    saved = fc.clone()
    fc.zero_()
    wm = WeightMap(with_head, cfg, Shard())
    wm.check(shapes)
    wm.check_complete(shapes)
    assert wm.load_dir(mtp_model) == len(shapes) and torch.equal(fc, saved)
    bare = WeightMap(load_model(mtp_model), cfg, Shard())
    bare.check(shapes)
    assert bare.load_dir(mtp_model) == len([k for k in shapes if not k.startswith("mtp.")])
    with pytest.raises(CheckpointError, match="no such expert"):
        wm.check({"mtp.layers.1.mlp.experts.0.down_proj.weight": (64, 32)})
    head = load_model(mtp_model, mtp=True, head_only=True)   # rank 0's copy on several ranks
    fc = dict(head.named_parameters())["mtp.fc.weight"]
    fc.zero_()
    outside_layers = [k for k in shapes if not k.startswith("model.layers.")]
    assert WeightMap(head, cfg, Shard()).load_dir(mtp_model) == len(outside_layers)
    assert torch.equal(fc, saved)


def test_checkpoint_cli_and_random_weights_get_an_mtp_head(tmp_path):
    assert main(["checkpoint", "--config", "tiny", "--out", str(tmp_path / "c"), "--mtp-layers", "1"]) == 0
    assert json.loads((tmp_path / "c/config.json").read_text())["num_nextn_predict_layers"] == 1
    assert load_model(tmp_path / "c", mtp=True).mtp is not None
    cfg = ModelConfig.from_dict(tiny_config(num_nextn_predict_layers=1))
    m = random_model(cfg, "cpu", torch.float32, mtp=True)
    fc = dict(m.named_parameters())["mtp.fc.weight"]
    assert fc.std().item() == pytest.approx(128 ** -0.5, rel=0.2)   # the fan-in scale of every linear
    assert random_model(cfg, "cpu", torch.float32).mtp is None


def test_head_only_model_equals_the_full_models_head(mtp_model):
    """Rank 0's unsharded head on several ranks (runtime/mtp.py head_model): the `mtp.*` tensors,
    the embedding, the final norm and lm_head, no target layers; loaded or random, its tensors
    equal one rank's full model's, so its drafts do too."""
    cfg = ModelConfig.load(mtp_model)
    for full, head in ((load_model(mtp_model, mtp=True), load_model(mtp_model, mtp=True, head_only=True)),
                       (random_model(cfg, "cpu", torch.float32, 7, mtp=True),
                        random_model(cfg, "cpu", torch.float32, 7, mtp=True, head_only=True))):
        got = dict(head.named_parameters())
        want = {n: p for n, p in full.named_parameters() if not n.startswith("model.layers.")}
        assert got.keys() == want.keys() and len(head.model.layers) == 0
        assert all(torch.equal(got[n], want[n]) for n in want)
    with pytest.raises(ValueError, match="head_only"):
        load_model(mtp_model, head_only=True)


def test_new_weights_reach_rank_0s_head_copy(mtp_model):
    """On several ranks rank 0's unsharded head is a copy beside the worker's model: a disk load
    (and a trainer's update, through the same WeightMap.write) writes it too."""
    from pdrollout.engine.runtime.mtp import head_model
    eng = engine_for(mtp_model, "normal", 2)
    w = eng.worker
    w.multi = True   # what head_model looks at: several ranks load a copy
    head = head_model(eng.config, w)
    w.multi = False
    assert head is not w.model and len(head.model.layers) == 0
    w.weights.add_copy(head)
    fc = dict(head.named_parameters())["mtp.fc.weight"]
    saved = fc.clone()
    fc.zero_()
    eng.update_weights_from_disk(str(mtp_model))
    assert torch.equal(fc, saved)
