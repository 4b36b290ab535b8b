"""The console script as a user runs it, the loader's errors, and the package layout."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from hf_reference import hf_greedy
from pdrollout.engine.model.loader import CheckpointError, load_model


def pdrollout(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "pdrollout.engine.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_checkpoint_and_generate_cli(tmp_path):
    r = pdrollout("checkpoint", "--config", "tiny", "--out", str(tmp_path / "m"), "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m" / "config.json").is_file()
    # Readable by others as umask allows (safetensors alone writes 0600): a container's non-root
    # engine reads an image's checkpoint that root wrote.
    mask = os.umask(0)
    os.umask(mask)
    assert {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "m").iterdir()} == \
        {"config.json": 0o666 & ~mask, "model.safetensors": 0o666 & ~mask}
    lines = [{"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}},
             {"input_ids": [], "sampling_params": {}},
             {"input_ids": [9], "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
              "return_logprob": True}]
    req = tmp_path / "req.jsonl"
    req.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    for mode in ("normal", "mixed", "pd"):
        r = pdrollout("generate", "--model", str(tmp_path / "m"), "--requests", str(req), "--mode", mode)
        assert r.returncode == 0, r.stderr
        out = [json.loads(x) for x in r.stdout.splitlines()]
        assert [o["index"] for o in out] == [0, 1, 2, 3]
        ref, _ = hf_greedy(tmp_path / "m", [5, 6, 7], 4)
        assert out[0]["output_ids"] == ref
        assert out[0]["meta_info"]["finish_reason"]["type"] == "length"
        assert out[0]["meta_info"]["prompt_tokens"] == 3 and out[0]["meta_info"]["completion_tokens"] == 4
        assert out[0]["meta_info"]["cached_tokens"] == 0
        assert "non-empty" in out[1]["error"]
        assert len(out[2]["meta_info"]["output_token_logprobs"]) == 2
        assert "not valid JSON" in out[3]["error"]


def test_unknown_preset_is_a_clear_error(tmp_path):
    r = pdrollout("checkpoint", "--config", "nope", "--out", str(tmp_path))
    assert r.returncode != 0 and "no config file or preset named 'nope'" in r.stderr


def test_loader_names_missing_and_unexpected_keys(tiny_model, tmp_path):
    tensors = load_file(str(tiny_model / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_model / "config.json").read_text())
    missing = dict(tensors)
    del missing["model.layers.1.self_attn.k_norm.weight"]
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm\.weight'"):
        load_model(tmp_path)
    extra = dict(tensors)
    extra["model.layers.0.mlp.shared_expert.weight"] = tensors["model.norm.weight"].clone()
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.shared_expert\.weight'"):
        load_model(tmp_path)
    no_expert = {k: v for k, v in tensors.items() if k != "model.layers.2.mlp.experts.5.up_proj.weight"}
    save_file(no_expert, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(tmp_path)


def test_operator_is_not_a_top_level_import():
    code = ("import operator, pdrollout.operator, pdrollout.engine, sys;"
            "assert operator.__file__.startswith(sys.base_prefix) or 'lib/python' in operator.__file__, operator.__file__;"
            "assert hasattr(operator, 'itemgetter');"
            "import importlib.util; spec = importlib.util.find_spec('operator');"
            "assert 'pdrollout' not in (spec.origin or ''), spec.origin")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr


def test_random_model_shards_agree_on_replicated_tensors():
    """Random weights are seeded per parameter name: on a sharded model every rank builds the same
    replicated tensors (embedding, norms, router, lm_head), its own slice shapes for the rest, and
    a second build is identical (a benchmark's ranks need no checkpoint on disk)."""
    import torch
    from pdrollout.engine.model.checkpoint import random_model
    from pdrollout.engine.protocol.config import ModelConfig, load_preset
    from pdrollout.engine.model.qwen3_moe import Shard
    cfg = ModelConfig.from_dict(load_preset("tiny"))
    a = dict(random_model(cfg, "cpu", torch.float32, seed=3, shard=Shard(0, 2, 0, 2)).named_parameters())
    b = dict(random_model(cfg, "cpu", torch.float32, seed=3, shard=Shard(1, 2, 1, 2)).named_parameters())
    again = dict(random_model(cfg, "cpu", torch.float32, seed=3, shard=Shard(0, 2, 0, 2)).named_parameters())
    other_seed = dict(random_model(cfg, "cpu", torch.float32, seed=4, shard=Shard(0, 2, 0, 2)).named_parameters())
    assert a.keys() == b.keys()
    replicated = [n for n in a if "embed_tokens" in n or "norm" in n or ".gate." in n or "lm_head" in n]
    assert replicated and any("embed_tokens" in n for n in replicated)
    for n in replicated:
        assert torch.equal(a[n], b[n]), n
    q = next(n for n in a if "q_proj.weight" in n)
    assert a[q].shape[0] * 2 == cfg.num_attention_heads * cfg.head_dim and not torch.equal(a[q], b[q])
    assert all(torch.equal(a[n], again[n]) for n in a)
    assert not torch.equal(a[replicated[0]], other_seed[replicated[0]])


def test_gemm_warmup_covers_every_weight_shape_and_row_count():
    # The multi-rank CUDA engine runs these before P and D overlap (issue 8: a first-use cuBLASLt
    # kernel waits for a context-wide sync); on the CPU only the coverage is checked.
    import torch
    from pdrollout.engine.model.checkpoint import random_model
    from pdrollout.engine.protocol.config import ModelConfig, load_preset
    from pdrollout.engine.runtime.warmup import gemm_shapes, warm_gemms, warm_rows
    cfg = ModelConfig.from_dict(load_preset("tiny"))
    model = random_model(cfg, torch.device("cpu"), torch.float32, 0)
    shapes = gemm_shapes(model)
    h, moe, f32 = cfg.hidden_size, cfg.moe_intermediate_size, torch.float32
    assert (cfg.num_experts, h, f32, False) in shapes                                    # router
    assert (2 * moe, h, f32, True) in shapes and (h, moe, f32, True) in shapes           # expert slices
    assert (cfg.num_attention_heads * cfg.head_dim, h, f32, False) in shapes             # q_proj
    assert (cfg.vocab_size, h, f32, False) in shapes                                     # lm_head
    assert len(shapes) == len(set(shapes))
    experts = sum(1 for s in shapes if s[3])
    assert warm_rows(5) == [1, 2, 3, 4, 5]
    ms = warm_rows(9000)
    assert ms[:1024] == list(range(1, 1025)) and 1032 in ms and 1030 not in ms
    assert 8256 in ms and 8200 not in ms and ms[-1] == 9000
    assert warm_gemms(model, 7, 9, torch.device("cpu")) == 7 * (len(shapes) - experts) + 9 * experts


def test_routed_experts_equal_the_per_expert_reference():
    # The routed experts every rank runs on what an all-to-all delivered (D's fixed slots, P's rows;
    # grouped GEMMs on CUDA, no host read) against one F.linear pair per row.
    import torch
    import torch.nn.functional as F
    from pdrollout.engine.model.checkpoint import random_model
    from pdrollout.engine.protocol.config import ModelConfig, load_preset
    cfg = ModelConfig.from_dict(load_preset("tiny"))
    moe = next(m for m in random_model(cfg, torch.device("cpu"), torch.float32, 0).modules()
               if hasattr(m, "experts"))
    gu, dn = moe.experts.gate_up_proj, moe.experts.down_proj
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, cfg.hidden_size, generator=g)
    ids = torch.randint(-1, gu.shape[0], (11,), generator=g)
    ids[3] = -1                                                    # an empty slot
    y = moe.routed_experts(x, ids)
    for r in range(11):
        if ids[r] < 0:
            assert torch.count_nonzero(y[r]) == 0
            continue
        gate, up = F.linear(x[r], gu[ids[r]]).chunk(2)
        assert torch.allclose(y[r], F.linear(F.silu(gate) * up, dn[ids[r]]), atol=1e-5)
