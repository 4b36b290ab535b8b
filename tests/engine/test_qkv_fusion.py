"""q, k and v as one GEMM (Attention.fuse_qkv): the parameters stay the checkpoint's, as views of one
weight, so whatever writes them in place reaches the fused GEMM, and whatever gives them storage
of their own falls back to three GEMMs until the model fuses again."""
from __future__ import annotations

import torch

from conftest import tiny_config
from pdrollout.engine.model.loader import load_model
from pdrollout.engine.protocol.config import EngineConfig
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.scheduler.request import SamplingParams


def attentions(model):
    return [layer.self_attn for layer in model.model.layers]


def forward(model):
    from pdrollout.engine.model.kv_cache import KVCache
    from pdrollout.engine.runtime.batch import ForwardBatch, SeqSlice
    cfg = model.cfg
    prompt = torch.tensor([(i * 37) % (cfg.vocab_size - 2) + 2 for i in range(11)])
    n = prompt.numel()
    kv = KVCache(cfg.num_hidden_layers, 1, n, attentions(model)[0].kv_heads, cfg.head_dim, torch.float32, "cpu")
    slots = torch.arange(n)
    return model(ForwardBatch(input_ids=prompt, positions=torch.arange(n), slot_mapping=slots,
                              seqs=[SeqSlice(0, n, n, slots)], logits_indices=torch.arange(n)), kv)


def unfuse(model):
    for a in attentions(model):
        for m in (a.q_proj, a.k_proj, a.v_proj):
            m.weight.data = m.weight.data.clone()


def test_a_loaded_model_runs_one_qkv_gemm_with_the_same_logits(tiny_model):
    model = load_model(tiny_model, dtype=torch.float32)
    calls = []
    orig = torch.nn.functional.linear
    try:
        torch.nn.functional.linear = lambda x, w, b=None: calls.append(w.shape[0]) or orig(x, w, b)
        fused = forward(model)
    finally:
        torch.nn.functional.linear = orig
    a = attentions(model)[0]
    rows = (a.heads + 2 * a.kv_heads) * a.head_dim
    assert all(x._qkv_weight() is not None for x in attentions(model))
    assert calls.count(rows) == model.cfg.num_hidden_layers   # one GEMM a layer for q, k and v
    unfuse(model)
    assert all(x._qkv_weight() is None for x in attentions(model))
    torch.testing.assert_close(forward(model), fused, rtol=1e-5, atol=1e-5)


def test_in_place_writes_reach_the_fused_weight(tiny_model):
    model = load_model(tiny_model, dtype=torch.float32)
    a = attentions(model)[1]
    new = torch.randn_like(a.k_proj.weight)
    a.k_proj.weight.copy_(new)   # how loads and RL weight updates write (weights.py)
    w = a._qkv_weight()
    q_rows = a.heads * a.head_dim
    assert torch.equal(w[q_rows:q_rows + new.shape[0]], new)
    fused = forward(model)
    unfuse(model)
    torch.testing.assert_close(forward(model), fused, rtol=1e-5, atol=1e-5)
    assert model.fuse_projections() == model.cfg.num_hidden_layers
    torch.testing.assert_close(forward(model), fused, rtol=1e-5, atol=1e-5)


def test_memory_release_and_resume_fuse_again_with_equal_outputs(tiny_model):
    engine = Engine(EngineConfig(model=str(tiny_model), dtype="float32"))
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)

    def run(rid):
        engine.submit(rid, [5, 9, 13, 2, 7], greedy)
        tokens = []
        while engine.has_unfinished():
            tokens += [t for o in engine.step() if o.rid == rid for t in o.new_token_ids]
        return tokens
    before = run("a")
    engine.release_memory(["weights"])
    assert all(x._qkv_weight() is None for x in attentions(engine.worker.model))   # nothing holds the old storage
    engine.resume_memory(["weights"])
    assert all(x._qkv_weight() is not None for x in attentions(engine.worker.model))
    assert run("b") == before
    engine.shutdown()


def test_a_model_with_attention_bias_keeps_three_projections(tmp_path):
    from pdrollout.engine.model.checkpoint import write_checkpoint
    d = write_checkpoint(tiny_config(attention_bias=True), tmp_path / "bias", seed=0)
    model = load_model(d, dtype=torch.float32)
    assert model.fuse_projections() == 0 and all(x._qkv_weight() is None for x in attentions(model))
