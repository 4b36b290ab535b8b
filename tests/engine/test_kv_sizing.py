"""The KV cache sized from free memory (runtime/kv_sizing.py): the arithmetic with given numbers, and
the probe → resize path on a real CPU worker (CUDA measures the free bytes: tests/engine/test_kv_sizing_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from hf_reference import PROMPTS, run_all
from pdrollout.engine.model.kv_cache import KVCache
from pdrollout.engine.protocol.config import (DEFAULT_KV_CACHE_BYTES, KV_MEM_FRACTION, ConfigError,
                                              ControlSettings, EngineConfig, ModelConfig)
from pdrollout.engine.protocol.topology import Topology
from pdrollout.engine.runtime import kv_sizing
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.runtime.kv_budget import kv_blocks
from pdrollout.engine.runtime.worker import Worker

BLOCK = 4


def per_block(cfg: ModelConfig) -> int:
    return KVCache.bytes_per_block(cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads, cfg.head_dim, torch.float32)


def test_who_sizes_from_free_memory(tiny_model):
    c = EngineConfig(model=str(tiny_model))
    assert c.kv_cache_bytes is None and c.kv_mem_fraction == KV_MEM_FRACTION
    assert kv_sizing.fraction_sized(c, "cuda", multi=False)
    assert not kv_sizing.fraction_sized(c, "cpu", multi=False)        # CPU: the default
    assert not kv_sizing.fraction_sized(c, "cuda", multi=True)        # several ranks: the default
    for given in ({"kv_cache_bytes": 1 << 20}, {"num_blocks": 8}):    # a size given wins on CUDA
        assert not kv_sizing.fraction_sized(EngineConfig(model=str(tiny_model), **given), "cuda", multi=False)
    cfg = ModelConfig.load(tiny_model)
    assert kv_blocks(EngineConfig(model=str(tiny_model), block_size=BLOCK), cfg, Topology(1), torch.float32) \
        == DEFAULT_KV_CACHE_BYTES // per_block(cfg)


@pytest.mark.parametrize("bad", [0, -0.5, 1.01])
def test_fraction_out_of_range_names_the_field(tiny_model, bad):
    with pytest.raises(ValueError, match="kv_mem_fraction"):
        EngineConfig(model=str(tiny_model), kv_mem_fraction=bad)


@pytest.mark.parametrize("fraction", [0.5, 0.9, 1.0])
@pytest.mark.parametrize("free_blocks", [3.5, 100.25, 7777.9])
def test_fit_blocks_takes_the_fraction_of_free(tiny_model, fraction, free_blocks):
    cfg = ModelConfig.load(tiny_model)
    per = per_block(cfg)
    free = int(free_blocks * per)
    config = EngineConfig(model=str(tiny_model), block_size=BLOCK, kv_mem_fraction=fraction)
    blocks = kv_sizing.fit_blocks(config, cfg, Topology(1), torch.float32, free)
    assert blocks * per <= fraction * free < (blocks + 1) * per   # the most blocks within the fraction
    # attention TP: a rank holds half the KV heads, so twice the blocks fit in the same bytes
    atp2 = kv_sizing.fit_blocks(config, cfg, Topology(2, adp=1), torch.float32, free)
    assert atp2 * per // 2 <= fraction * free < (atp2 + 1) * per // 2


def test_fit_blocks_refuses_when_not_one_block_fits(tiny_model):
    cfg = ModelConfig.load(tiny_model)
    config = EngineConfig(model=str(tiny_model), block_size=BLOCK, kv_mem_fraction=0.5)
    with pytest.raises(ConfigError, match=r"kv_mem_fraction 0.5 of the .* less than one KV block"):
        kv_sizing.fit_blocks(config, cfg, Topology(1), torch.float32, per_block(cfg) + 1)


def test_probe_rows_are_the_largest_step(tiny_model):
    config = EngineConfig(model=str(tiny_model), block_size=BLOCK, max_running=5, mixed_chunk_tokens=100,
                          control=ControlSettings(prefill_budget_tokens=5000))
    rows = kv_sizing.probe_rows(config)
    decode = [r for r in rows if r.length == 1 and r.kind.name == "DECODE"]
    prefill = [r for r in rows if r.kind.name == "PREFILL"]
    assert len(decode) == 5 and sum(r.length for r in prefill) == 5000   # the budget beside every row
    assert max(r.length for r in prefill) <= kv_sizing.PROBE_ROW
    blocks = [b for r in rows for b in r.blocks]
    assert sorted(blocks) == list(range(len(blocks))) == list(range(kv_sizing.probe_blocks(config)))
    assert all(r.samples for r in rows)
    chunky = config.model_copy(update={"mixed_chunk_tokens": 9000})   # mixed's chunk larger than the budget
    assert kv_sizing.probe_tokens(chunky) == 9000 + 5


def test_probe_then_resize_serves_like_a_fresh_engine(tiny_model):
    """The CUDA path on CPU with a given free figure: the largest step into the probe cache, the
    fraction of free + the probe cache's bytes, the cache resized in place; P's pieces (eager here)
    pad into the new null slot, and the engine's greedy tokens equal those of an engine built at
    that size."""
    config = EngineConfig(model=str(tiny_model), block_size=BLOCK, max_running=4, mixed_chunk_tokens=48,
                          prefill_graph_tokens=32, kv_mem_fraction=0.5,
                          control=ControlSettings(prefill_budget_tokens=48))
    probe = kv_sizing.probe_blocks(config)
    cfg = ModelConfig.load(tiny_model)
    assert kv_sizing.start_blocks(config, cfg, Topology(1), torch.float32, "cuda", False) == (probe, True)
    # a worker as start_blocks starts one on CUDA: on the probe's blocks, its config giving no size
    worker = Worker.single(config.model_copy(update={"num_blocks": probe}))
    worker.config = config
    kv, per = worker.kv, per_block(cfg)
    assert kv.nbytes() == (probe + 1) * per
    seen = []

    def measure(w):   # what the device would say, once the probe's step ran
        seen.append([bool(k.abs().sum()) for k in w.kv.k])
        return 200 * per
    sizing = kv_sizing.size_from_free(worker, measure=measure)
    assert seen and all(seen[0])                    # measured after the probe wrote every layer's K/V
    free = 200 * per + (probe + 1) * per            # the probe's cache goes back: it counts as free
    blocks = int(0.5 * free) // per
    assert (sizing.blocks, sizing.free_bytes, sizing.fraction) == (blocks, free, 0.5)
    assert sizing.kv_bytes == (blocks + 1) * per and sizing.probe_tokens == 48 + 4
    assert worker.kv is kv and worker.num_blocks == blocks
    assert kv.null_slot == blocks * BLOCK and kv.k[0].shape[0] == (blocks + 1) * BLOCK
    assert all(not k.abs().sum() for k in kv.k)   # zeroed: nothing of the probe's step is left
    assert (worker.p_graphs.slot_mapping == kv.null_slot).all()   # padding writes only the null slot
    assert sizing.facts() == {"kv_cache_bytes": sizing.kv_bytes, "kv_mem_fraction": 0.5, "kv_free_bytes": free}
    resized = run_all(Engine(config, worker), PROMPTS, 12)
    fresh = run_all(Engine(config.model_copy(update={"num_blocks": blocks})), PROMPTS, 12)
    assert resized == fresh
