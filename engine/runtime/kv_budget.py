"""How many KV blocks a rank's cache gets from its budget (`EngineConfig.kv_cache_bytes`).

Every rank holds the same block count (a block id means the same positions everywhere). Rank 0 also
holds the model proposers' caches under speculation (draft model or MTP head, one per replica,
runtime/draft.py), which come out of its budget: every rank sizes for them, so the others leave
that share unused.
"""
from __future__ import annotations

import torch

from ..model.kv_cache import KVCache
from ..model.loader import resolve_dtype
from ..protocol.config import DEFAULT_KV_CACHE_BYTES, EngineConfig, ModelConfig
from ..protocol.topology import Topology


def spare_blocks(config: EngineConfig) -> int:
    """Blocks a proposer's cache holds beyond the target's count: k draft positions past every row."""
    return config.max_running * -(-config.speculative_k // config.block_size)


def proposer_block_bytes(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype) -> int:
    """What one block costs one model proposer's cache (0: no model proposer), known before anything
    loads: the draft's layers and KV heads in the dtype it loads in (its config's), or the MTP head's
    layers with the target's heads in the target's dtype."""
    if config.speculative == "draft":
        d = ModelConfig.load(config.draft_model)
        return KVCache.bytes_per_block(d.num_hidden_layers, config.block_size, d.num_key_value_heads,
                                       d.head_dim, resolve_dtype("auto", d))
    if config.speculative == "mtp":
        return KVCache.bytes_per_block(cfg.num_nextn_predict_layers, config.block_size, cfg.num_key_value_heads,
                                       cfg.head_dim, dtype)
    return 0


def target_block_bytes(config: EngineConfig, cfg: ModelConfig, topo: Topology, dtype: torch.dtype) -> int:
    """What one block costs a rank's cache: its share of the KV heads."""
    return KVCache.bytes_per_block(cfg.num_hidden_layers, config.block_size,
                                   cfg.num_key_value_heads // topo.atp, cfg.head_dim, dtype)


def kv_blocks(config: EngineConfig, cfg: ModelConfig, topo: Topology, dtype: torch.dtype,
              budget: int | None = None) -> int:
    """The same block count on every rank: each rank's KV budget over its share of the KV heads. A
    model proposer's caches (one per replica, on rank 0) come out of rank 0's budget, so every rank
    sizes for them (the others leave that share unused). `budget`: bytes measured at start
    (kv_sizing.py); None: `kv_cache_bytes`, or its default."""
    if config.num_blocks:
        return config.num_blocks
    if budget is None:
        budget = config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES
    per = target_block_bytes(config, cfg, topo, dtype)
    extra = topo.adp * proposer_block_bytes(config, cfg, dtype)
    left = budget - extra * spare_blocks(config)
    if extra and left < per + extra:
        raise ValueError(f"kv_cache_bytes {budget} holds no block beside the {topo.adp} "
                         f"{config.speculative} proposer cache(s) (each needs {spare_blocks(config)} spare "
                         f"blocks of {extra // topo.adp} bytes): raise it or lower max_running")
    return max(left // (per + extra), 1)
