"""Block-FP8 checkpoints (the Hugging Face layout of Qwen3/DeepSeek FP8 releases).

The twin of an FP8 checkpoint holds each weight's dequantized value, formed in fp32 as the
engine's FP8 path forms it (fp8.dequantize) and cast to the twin's dtype. The FP8 model then runs
the very same matmuls on the very same values, so its logits equal the twin's bit for bit
(tolerance 0); transformers on the float32 twin is the independent reference (logits within
1e-4, greedy tokens equal under the top-2 margin rule)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_config
from hf_reference import assert_matches_reference, hf_greedy, hf_model
from pdrollout.engine.cli import main as cli_main
from pdrollout.engine.model import fp8
from pdrollout.engine.model.checkpoint import write_checkpoint, write_dequantized
from pdrollout.engine.model.kv_cache import KVCache
from pdrollout.engine.model.loader import CheckpointError, load_model
from pdrollout.engine.model.qwen3_moe import ForwardBatch, SeqSlice
from pdrollout.engine.protocol.config import ConfigError, EngineConfig, ModelConfig
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.scheduler.request import SamplingParams

PROMPTS = [[7, 3, 9, 27, 81], [(i * 37) % 300 + 2 for i in range(19)]]
RELEASE_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                 "weight_block_size": [128, 128]}
HF_LOGIT_TOL = 1e-4


def prompt_logits(model, prompt: list[int]) -> torch.Tensor:
    """Our model's fp32 logits at every prompt position (one prefill, no engine around it)."""
    n, cfg = len(prompt), model.cfg
    kv = KVCache(cfg.num_hidden_layers, 1, n, model.model.layers[0].self_attn.kv_heads, cfg.head_dim,
                 model.model.embed_tokens.weight.dtype, "cpu")
    slots = torch.arange(n)
    batch = ForwardBatch(input_ids=torch.tensor(prompt), positions=torch.arange(n), slot_mapping=slots,
                         seqs=[SeqSlice(0, n, n, slots)], logits_indices=torch.arange(n))
    return model(batch, kv)


def greedy(model_dir, dtype="auto", max_new=8) -> dict[str, list[int]]:
    eng = Engine(EngineConfig(model=str(model_dir), dtype=dtype, block_size=4, num_blocks=64))
    for i, p in enumerate(PROMPTS):
        eng.submit(f"r{i}", p, SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
    return out


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    """A random FP8 tiny model with a dense layer (so dense FP8 linears run too), its float32 and
    bfloat16 twins, written by the CLI."""
    root = tmp_path_factory.mktemp("fp8")
    cfg = root / "cfg.json"
    cfg.write_text(json.dumps(tiny_config(mlp_only_layers=[1])))
    assert cli_main(["checkpoint", "--config", str(cfg), "--out", str(root / "fp8"), "--dtype", "fp8", "--seed", "3",
                     "--dequantized-twin", str(root / "twin32")]) == 0
    write_dequantized(root / "fp8", root / "twin16", dtype="bfloat16")
    return root / "fp8", root / "twin32", root / "twin16"


def test_random_fp8_checkpoint_has_the_release_layout(fp8_pair):
    src = fp8_pair[0]
    config = json.loads((src / "config.json").read_text())
    assert config["quantization_config"] == RELEASE_QUANT and config["torch_dtype"] == "bfloat16"
    t = load_file(str(src / "model.safetensors"))
    q = t["model.layers.0.mlp.experts.5.up_proj.weight"]
    assert q.dtype == torch.float8_e4m3fn and t["model.layers.0.mlp.experts.5.up_proj.weight_scale_inv"].shape == (1, 1)
    assert t["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn    # the dense layer
    for plain in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                  "model.layers.0.mlp.gate.weight", "model.layers.0.input_layernorm.weight"):
        assert t[plain].dtype == torch.bfloat16 and plain + "_scale_inv" not in t, plain


@pytest.mark.parametrize("twin, dtype", [(1, "float32"), (2, "auto")])
def test_fp8_logits_equal_dequantized_twin(fp8_pair, twin, dtype):
    src, twin_dir = fp8_pair[0], fp8_pair[twin]
    wdtype = torch.float32 if dtype == "float32" else None    # auto: bf16, the checkpoint's
    ours, ref = load_model(src, dtype=wdtype), load_model(twin_dir, dtype=wdtype)
    assert ours.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    for p in PROMPTS:
        a, b = prompt_logits(ours, p), prompt_logits(ref, p)
        assert torch.equal(a, b), f"max |diff| {float((a - b).abs().max())}"
    assert greedy(src, dtype) == greedy(twin_dir, dtype)


def test_fp8_matches_transformers_on_twin(fp8_pair):
    """transformers reads the float32 twin as an ordinary checkpoint: the independent reference."""
    src, twin = fp8_pair[0], fp8_pair[1]
    ours = load_model(src, dtype=torch.float32)
    hf = hf_model(str(twin))
    for p in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        diff = float((prompt_logits(ours, p) - ref).abs().max())
        assert diff < HF_LOGIT_TOL, diff
    out = greedy(src, "float32")
    for i, p in enumerate(PROMPTS):
        ref, margins = hf_greedy(twin, p, 8)
        assert_matches_reference(out[f"r{i}"], ref, margins, f"fp8 prompt {i}")


# ---- a checkpoint shaped like a published release ---------------------------------------------
# Qwen3-30B-A3B-FP8's key names, quantization_config and scale tensors, at a tiny size: head_dim
# 128 as released, hidden 256 (two scale blocks), moe_intermediate 192 (a partial second block:
# the ceil in every scale shape).
RELEASE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 384,
           "hidden_size": 256, "intermediate_size": 384, "moe_intermediate_size": 192, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "num_experts": 8,
           "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
           "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "bos_token_id": 0,
           "eos_token_id": 1, "torch_dtype": "bfloat16", "quantization_config": RELEASE_QUANT}


def write_release_like(out, scale_dtype=torch.float32):
    """Written here by hand (not by our checkpoint module): random e4m3 values and random
    per-block scales under the release's key names."""
    g = torch.Generator().manual_seed(11)
    c = RELEASE
    h, d, inter = c["hidden_size"], c["head_dim"], c["moe_intermediate_size"]
    t = {}

    def plain(key, *shape, std=None):
        t[key] = (1.0 + 0.1 * torch.randn(*shape, generator=g) if std is None
                  else torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    def quantized(key, rows, cols):
        t[key] = torch.randn(rows, cols, generator=g).clamp(-8, 8).to(torch.float8_e4m3fn)
        blocks = (math.ceil(rows / 128), math.ceil(cols / 128))
        t[key + "_scale_inv"] = (cols ** -0.5 * (0.5 + torch.rand(*blocks, generator=g))).to(scale_dtype)

    plain("model.embed_tokens.weight", c["vocab_size"], h, std=1.0)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        plain(p + "input_layernorm.weight", h)
        plain(p + "post_attention_layernorm.weight", h)
        plain(p + "self_attn.q_norm.weight", d)
        plain(p + "self_attn.k_norm.weight", d)
        quantized(p + "self_attn.q_proj.weight", c["num_attention_heads"] * d, h)
        quantized(p + "self_attn.k_proj.weight", c["num_key_value_heads"] * d, h)
        quantized(p + "self_attn.v_proj.weight", c["num_key_value_heads"] * d, h)
        quantized(p + "self_attn.o_proj.weight", h, c["num_attention_heads"] * d)
        plain(p + "mlp.gate.weight", c["num_experts"], h, std=2.0 * h ** -0.5)
        for e in range(c["num_experts"]):
            quantized(p + f"mlp.experts.{e}.gate_proj.weight", inter, h)
            quantized(p + f"mlp.experts.{e}.up_proj.weight", inter, h)
            quantized(p + f"mlp.experts.{e}.down_proj.weight", h, inter)
    plain("model.norm.weight", h)
    plain("lm_head.weight", c["vocab_size"], h, std=2.0 * h ** -0.5)
    out.mkdir(parents=True, exist_ok=True)
    # two shards and an index, as releases are split
    keys = sorted(t)
    half = {k: t[k] for k in keys[: len(keys) // 2]}, {k: t[k] for k in keys[len(keys) // 2:]}
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for part, name in zip(half, names):
        save_file(part, str(out / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: names[n] for n, part in enumerate(half) for k in part}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(c))
    return out


def test_release_layout_loads_and_generates(tmp_path):
    src = write_release_like(tmp_path / "release")
    model = load_model(src)
    attn, experts = model.model.layers[1].self_attn, model.model.layers[1].mlp.experts
    assert attn.q_proj.weight_scale_inv.shape == (4, 2) and attn.o_proj.weight_scale_inv.shape == (2, 4)
    assert experts.gate_up_proj_scale_inv.shape == (8, 4, 2)     # gate's 2 block rows, then up's 2
    assert experts.down_proj_scale_inv.shape == (8, 2, 2)
    twin = write_dequantized(src, tmp_path / "twin")
    out = greedy(src, "float32")
    assert all(len(v) == 8 for v in out.values())
    for i, p in enumerate(PROMPTS):
        ref, margins = hf_greedy(twin, p, 8)
        assert_matches_reference(out[f"r{i}"], ref, margins, f"release-like prompt {i}")


def test_release_layout_with_bf16_scales(tmp_path):
    """Scales stored as bf16 are read as float32 (the same values)."""
    src = write_release_like(tmp_path / "release", torch.bfloat16)
    ours, ref = load_model(src, dtype=torch.float32), load_model(write_dequantized(src, tmp_path / "twin"))
    assert ours.model.layers[0].self_attn.q_proj.weight_scale_inv.dtype == torch.float32
    assert torch.equal(prompt_logits(ours, PROMPTS[1]), prompt_logits(ref, PROMPTS[1]))


def test_dequantize_maps_each_128_block_to_its_scale():
    """Element (r, c) is weight[r, c] * scale[r // 128, c // 128], partial last blocks included
    (written out independently of fp8.dequantize's expansion)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, generator=g) + 0.5
    want = w.float() * s[torch.arange(200) // 128][:, torch.arange(300) // 128]
    assert torch.equal(fp8.dequantize(w, s, (128, 128)), want)
    # quantize: e4m3 keeps 3 mantissa bits (relative error <= 2^-4), subnormals an absolute 2^-9 of a scale
    x = torch.randn(200, 300, generator=g) * torch.linspace(0.01, 3, 300)
    q, scale = fp8.quantize(x, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)
    err = (fp8.dequantize(q, scale, (128, 128)) - x).abs()
    bound = x.abs() / 16 + scale[torch.arange(200) // 128][:, torch.arange(300) // 128] * 2 ** -9
    assert bool((err <= bound).all())


def test_fp8_weights_stay_fp8_in_memory(tmp_path):
    """Half the bytes of bf16: every quantized linear is e4m3 in the loaded model."""
    src = write_release_like(tmp_path / "release")
    twin = write_dequantized(src, tmp_path / "twin16", dtype="bfloat16")
    ours, ref = dict(load_model(src).named_parameters()), dict(load_model(twin).named_parameters())
    quantized = [n for n, p in ours.items() if p.dtype == torch.float8_e4m3fn]
    # 2 layers x (q, k, v, o, experts' gate_up, down)
    assert len(quantized) == 12
    for n in quantized:
        assert ours[n].nbytes * 2 == ref[n].nbytes and ref[n].dtype == torch.bfloat16, n
        assert ours[n + "_scale_inv"].dtype == torch.float32, n    # q_proj.weight_scale_inv, gate_up_proj_scale_inv
    total = sum(p.nbytes for p in ours.values())
    assert total < 0.6 * sum(p.nbytes for p in ref.values()), total


# ---- what is refused -----------------------------------------------------------------------
@pytest.mark.parametrize("change, field", [
    ({"quant_method": "gptq"}, "quantization_config.quant_method"),
    ({"fmt": "e5m2"}, "quantization_config.fmt"),
    ({"activation_scheme": "static"}, "quantization_config.activation_scheme"),
    ({"weight_block_size": [64, 64]}, "quantization_config.weight_block_size"),
    ({"weight_block_size": None}, "quantization_config.weight_block_size"),
])
def test_unsupported_quantization_config_names_the_field(tmp_path, change, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ModelConfig.from_dict({**RELEASE, "quantization_config": {**RELEASE_QUANT, **change}})
    # and the same on load from disk
    src = write_release_like(tmp_path / "r")
    (src / "config.json").write_text(json.dumps({**RELEASE, "quantization_config": {**RELEASE_QUANT, **change}}))
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_model(src)


def test_fp8_checkpoint_mismatches_are_named(tmp_path, fp8_pair):
    # scales present but no quantization_config
    src = write_release_like(tmp_path / "r")
    (src / "config.json").write_text(json.dumps({k: v for k, v in RELEASE.items() if k != "quantization_config"}))
    with pytest.raises(CheckpointError, match=r"weight_scale_inv.*declares no quantization_config"):
        load_model(src)
    # the config declares FP8, a quantized linear is stored in bf16
    t = load_file(str(fp8_pair[0] / "model.safetensors"))
    key = "model.layers.2.self_attn.k_proj.weight"
    t[key] = fp8.dequantize(t[key], t[key + "_scale_inv"], (128, 128), torch.bfloat16)
    bad = tmp_path / "bf16_in_fp8"
    bad.mkdir()
    save_file(t, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((fp8_pair[0] / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.self_attn\.k_proj\.weight' is torch\.bfloat16"):
        load_model(bad)
    # a missing expert scale
    t = load_file(str(fp8_pair[0] / "model.safetensors"))
    del t["model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"]
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing model\.layers\.0\.mlp\.experts\.3\.down_proj\.weight_scale_inv"):
        load_model(bad)


def test_weight_updates_into_fp8_model_are_refused(fp8_pair):
    eng = Engine(EngineConfig(model=str(fp8_pair[0]), block_size=4, num_blocks=16))
    from pdrollout.engine.runtime.engine_ops import OpError
    with pytest.raises(OpError, match="FP8 model"):
        eng.update_weights_from_disk(str(fp8_pair[0]))


def test_fp8_head_slices_must_fill_scale_blocks(fp8_pair):
    """tiny's head_dim 16: two attention-TP ranks would split a 128-row scale block."""
    from pdrollout.engine.model.qwen3_moe import Shard
    with pytest.raises(CheckpointError, match=r"q_proj\.weight_scale_inv.*slice \[32, 64\) is not aligned"):
        load_model(fp8_pair[0], shard=Shard(atp_rank=1, atp_size=2))


def test_fp8_on_two_ranks_equals_one(tmp_path):
    """The release-shaped checkpoint on ATP2 x EP2 rank processes (head slices and expert shards
    of the FP8 weights and their scales) generates one rank's tokens."""
    import subprocess
    import sys
    src = write_release_like(tmp_path / "release")
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("".join(json.dumps({"input_ids": p, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}) + "\n" for p in PROMPTS))
    p = subprocess.run([sys.executable, "-m", "pdrollout.engine.cli", "generate", "--model", str(src), "--requests",
                        str(reqs), "--nproc", "2", "--ep", "2"], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    two = [json.loads(line)["output_ids"] for line in p.stdout.splitlines()]
    one = greedy(src)
    assert two == [one["r0"], one["r1"]]


def test_random_fp8_model_for_benchmarks():
    """random_weights on an FP8 config (a benchmark shape, no checkpoint): e4m3 weights of unit
    scale times the fan-in std, finite logits."""
    from pdrollout.engine.model.checkpoint import random_model
    cfg = ModelConfig.from_dict(RELEASE)
    model = random_model(cfg, torch.device("cpu"), torch.bfloat16, seed=2)
    experts = model.model.layers[0].mlp.experts
    assert experts.down_proj.dtype == torch.float8_e4m3fn
    assert torch.all(experts.down_proj_scale_inv == torch.tensor(192 ** -0.5))
    w = fp8.dequantize(experts.down_proj[0], experts.down_proj_scale_inv[0], (128, 128))
    assert 0.5 < float(w.std() * 192 ** 0.5) < 1.5
    assert torch.isfinite(prompt_logits(model, PROMPTS[1])).all()


def test_all_experts_dequantized_at_once_equal_per_expert(tmp_path):
    """CUDA's FP8 experts (the layer's experts dequantized together for the grouped GEMM, no host
    read) use the same weights as the per-expert CPU loop: checked here on CPU, through the
    reference expert op."""
    from pdrollout.engine.model import ops
    model = load_model(write_release_like(tmp_path / "release"), dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 256, generator=g)
    ids = torch.randint(0, 8, (6, 2), generator=g)
    w = torch.rand(6, 2, generator=g)
    gate_up, down = fp8.expert_weights(experts, slice(None), torch.float32)
    assert gate_up.shape == (8, 384, 256) and down.shape == (8, 256, 192)
    assert torch.equal(fp8.experts_forward(x, ids, w, experts), ops.experts_reference(x, ids, w, gate_up, down))
