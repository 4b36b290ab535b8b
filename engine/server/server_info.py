"""What `GET /get_server_info` says about the server: an allow-list of public settings, never a dump.

SGLang's route returns its whole `ServerArgs`; RL clients read a few of those names (slime's external
engine mode asserts `enable_memory_saver` equals its --offload-rollout and, with routing replay,
`enable_return_routed_experts` true; it sizes its weight-update group from `tp_size`/`dp_size`/`ep_size`).
We answer with the same names and this engine's values as configured.
Settings are named here one by one, so a secret added to `ServerSettings` later stays out by default.
"""
from __future__ import annotations

# ServerSettings fields a client may read; anything else (the admin token above all) is never returned.
PUBLIC_SETTINGS = ("model", "served_model_name", "host", "port", "mode", "device", "max_body_bytes",
                   "drain_timeout_s", "rollout_idle_s", "incremental_streaming_output",
                   "health_generate_timeout_s", "tool_call_parser")


def public_settings(settings) -> dict:
    return {name: getattr(settings, name) for name in PUBLIC_SETTINGS}


def engine_facts(engine) -> dict:
    """Read on the engine thread: what SGLang's server args say, in this engine's terms."""
    info, cfg = engine.model_info(), engine.config
    return {**info, "max_running": cfg.max_running, "block_size": cfg.block_size,
            "chunk_tokens": cfg.mixed_chunk_tokens, "seed": cfg.seed,
            "kv_blocks_total": engine.stats()["kv_blocks_total"], **engine.worker.kv_sizing.facts()}


def sglang_server_args(settings, facts: dict, tokenizer_path) -> dict:
    """SGLang's `ServerArgs` names with this engine's values. With DP attention SGLang counts
    `tp_size` as all GPUs of the engine, `dp_size` the attention replicas, `ep_size` the expert
    ranks; that is world, ADP and EP here (attention TP = tp_size / dp_size = ATP)."""
    world = facts["nproc"]
    spec = facts.get("speculative")
    return {
        "model_path": facts["model_path"], "tokenizer_path": tokenizer_path,
        "served_model_name": settings.model_name, "dtype": facts["dtype"],
        "tp_size": world, "dp_size": facts["adp"], "ep_size": facts["ep"], "pp_size": 1,
        "enable_dp_attention": facts["adp"] > 1,
        "num_gpus": world if settings.device.startswith("cuda") else 0,
        "context_length": facts["max_context_len"], "max_running_requests": facts["max_running"],
        "page_size": facts["block_size"], "chunked_prefill_size": facts["chunk_tokens"],
        "max_total_num_tokens": facts["kv_blocks_total"] * facts["block_size"],
        "random_seed": facts["seed"],
        # this engine's own: how rank 0's KV cache was sized (kv_mem_fraction None: a size was given)
        "kv_cache_bytes": facts["kv_cache_bytes"], "kv_mem_fraction": facts["kv_mem_fraction"],
        "kv_free_bytes": facts["kv_free_bytes"],
        # as configured (--enable-memory-saver: release/resume_memory_occupation are served, by tags;
        # slime's external-engine check compares it with its --offload-rollout); /generate returns routed experts
        "enable_memory_saver": settings.enable_memory_saver, "enable_return_routed_experts": True,
        "speculative_algorithm": {"ngram": "NGRAM", "draft": "STANDALONE", "mtp": "EAGLE"}.get(spec) if spec else None,
        "speculative_num_draft_tokens": facts.get("speculative_k") or None,
        "skip_tokenizer_init": tokenizer_path is None,
    }
