"""The HTTP calls slime, AReaL and verl make to an SGLang rollout server, in the order of one RL step, with
the response fields each reads and the type it expects. Bodies and fields as read from their public sources
(the file is named above each framework); `{prompt}`, `{model}`, `{partial}` are filled in by the replay test
(tests/server/test_framework_replay.py). A step `TRAINER` pushes weights through a weights update group from a
real trainer process (tests/rl_trainer.py) with that framework's init body; a step `TENSORS` pushes them with
POST /update_weights_from_tensor per bucket from a real trainer process (tests/rl_tensor_trainer.py) in the
format the body names."""
from __future__ import annotations

GEN_READS = {"text": str, "output_ids": list, "meta_info.finish_reason.type": str, "meta_info.prompt_tokens": int,
             "meta_info.completion_tokens": int, "meta_info.cached_tokens": int, "meta_info.weight_version": str,
             "meta_info.output_token_logprobs": list}
SERVER_ARGS = {"enable_memory_saver": bool, "enable_return_routed_experts": bool, "tp_size": int, "dp_size": int,
               "ep_size": int, "model_path": str}
# slime's external-engine check (slime/backends/sglang_utils/sglang_engine.py, _compute_server_args and
# _sanity_check_server_args): the fields of its expected server args not in _EXTERNAL_ENGINE_SKIP_CHECK_FIELDS,
# by slime flag, with the value slime asserts /server_info reports. --fp16 adds dtype "float16" (this
# engine serves bf16 checkpoints: not replayed).
SLIME_SERVER_CHECK = {
    "default": {"enable_memory_saver": False},                        # enable_memory_saver = args.offload_rollout
    "--offload-rollout": {"enable_memory_saver": True},
    "--use-rollout-routing-replay": {"enable_memory_saver": False, "enable_return_routed_experts": True},
}
# Calls a framework makes that this engine refuses: (framework, method, path, body, status, words in the message).
REFUSED = [
    # slime: rollout/sglang_rollout.py GenerateState (top_p != 1), sglang_engine.py check_weights / post_process_weights
    # / pull_weights
    ("slime", "POST", "/generate", {"input_ids": [3, 5], "sampling_params": {
        "top_p": 0.9, "max_new_tokens": 2, "custom_params": {"return_top_p_token_ids": True}}}, 400,
     "custom_params.return_top_p_token_ids is not supported"),
    ("slime", "POST", "/weights_checker", {"action": "snapshot"}, 501, "/weights_checker is not supported"),
    ("slime", "POST", "/post_process_weights", {"restore_weights_before_load": True, "post_process_quantization": False},
     501, "/post_process_weights is not supported"),
    ("slime", "POST", "/pull_weights", {"local_checkpoint_dir": "/c", "source_dir": "/s", "target_version": 1}, 501,
     "/pull_weights is not supported"),
    # AReaL: areal/engine/sglang_remote.py build_disk_weight_update_requests with use_lora
    ("areal", "POST", "/load_lora_adapter", {"lora_name": "lora-v1", "lora_path": "/ckpt"}, 501, "LoRA adapters"),
    ("areal", "POST", "/unload_lora_adapter", {"lora_name": "lora-v0"}, 501, "LoRA adapters"),
    # verl: sglang_rollout.py update_weights with a served LoRA adapter; SGLang's include sections
    ("verl", "POST", "/load_lora_adapter_from_tensors", {"lora_name": "l", "config_dict": {},
                                                         "serialized_named_tensors": []}, 501, "LoRA adapters"),
    ("slime", "GET", "/v1/loads?include=memory", None, 400, "include=memory is not reported"),
    # SkyRL 01dc9de: skyrl_train/inference_engines/remote_inference_engine.py (vLLM's sleep API sent to SGLang too)
    ("skyrl", "POST", "/sleep", {"level": 1}, 501, "vLLM's sleep mode"),
    ("skyrl", "POST", "/wake_up", {"tags": 1}, 501, "vLLM's sleep mode"),
]
TRAINER = "TRAINER"
TENSORS = "TENSORS"   # a trainer process pushes the new checkpoint with /update_weights_from_tensor

CALLS = {
    # slime: slime/rollout/sglang_rollout.py (GenerateState.sampling_params, generate(), abort()),
    # slime/backends/sglang_utils/sglang_engine.py (health, server info, pause/flush/continue, memory, weights).
    "slime": [
        ("GET", "/health_generate", None, {"status": str}),
        ("GET", "/get_server_info", None, SERVER_ARGS),
        ("GET", "/get_model_info", None, {"model_path": str}),
        ("POST", "/generate", {"input_ids": "{prompt}", "return_logprob": True, "sampling_params": {
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6, "stop": None, "stop_token_ids": None,
            "skip_special_tokens": True, "no_stop_trim": True, "spaces_between_special_tokens": False}}, GEN_READS),
        ("POST", "/generate", {"input_ids": "{prompt}", "return_logprob": True, "return_routed_experts": True,
                               "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6,
                                                   "no_stop_trim": True, "sampling_seed": 7}},
         {**GEN_READS, "meta_info.routed_experts": str}),
        # partial rollout: the aborted sample's prompt + response re-sent, max_new_tokens less what it has
        ("POST", "/generate", {"input_ids": "{partial}", "return_logprob": True,
                               "sampling_params": {"temperature": 1.0, "max_new_tokens": 3, "no_stop_trim": True}},
         GEN_READS),
        # slime/rollout/sglang_streaming_rollout.py: the same body streamed, cumulative chunks read per
        # line; with router_policy consistent_hashing the session goes in X-SMG-Routing-Key
        ("POST", "/generate", {"input_ids": "{prompt}", "return_logprob": True, "stream": True, "sampling_params": {
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6, "stop": None, "stop_token_ids": None,
            "skip_special_tokens": True, "no_stop_trim": True, "spaces_between_special_tokens": False}}, GEN_READS,
         {"X-SMG-Routing-Key": "session-7"}),
        ("POST", "/abort_request", {"abort_all": True}, {"success": bool}),
        # slime/backends/sglang_utils/server_control.py: abort until idle, counting running + waiting
        ("GET", "/v1/loads?include=core", None, {"loads": list}),
        ("GET", "/v1/loads", None, {"loads": list, "dp_rank_count": int}),
        ("POST", "/pause_generation", {"mode": "abort"}, {"success": bool}),
        ("GET", "/flush_cache", None, {"success": bool}),
        (TRAINER, "/init_weights_update_group", {}, None),
        ("POST", "/continue_generation", {}, {"success": bool}),
        ("POST", "/update_weights_from_disk", {"model_path": "{model}", "weight_version": "slime-disk"},
         {"success": bool, "message": str}),
        ("POST", "/release_memory_occupation", {"tags": ["kv_cache", "weights"]}, None),
        ("POST", "/resume_memory_occupation", {"tags": ["weights"]}, None),
        ("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}, None),
        ("GET", "/get_weight_version", None, {"weight_version": str}),
    ],
    # AReaL: areal/engine/sglang_remote.py (RemoteSGLangEngine: generate, pause/continue, update from disk,
    # the NCCL update group with master_port sent as a string).
    "areal": [
        ("GET", "/health", None, {"status": str}),
        ("POST", "/generate", {"input_ids": "{prompt}", "return_logprob": True, "stream": False, "sampling_params": {
            "top_p": 1.0, "top_k": 100000000, "max_new_tokens": 6, "temperature": 1.0, "stop_token_ids": [1],
            "frequency_penalty": 0.0}}, GEN_READS),
        ("POST", "/generate", {"input_ids": "{partial}", "return_logprob": True, "stream": False, "sampling_params": {
            "top_p": 1.0, "max_new_tokens": 3, "temperature": 1.0, "stop_token_ids": [1]}}, GEN_READS),
        ("POST", "/pause_generation", {}, {"success": bool}),
        (TRAINER, "/init_weights_update_group", {"master_port": "str", "pp_rank": 0}, None),
        ("POST", "/update_weights_from_disk", {"model_path": "{model}", "abort_all_requests": True},
         {"success": bool}),
        ("POST", "/continue_generation", {}, {"success": bool}),
        ("POST", "/abort_request", {"abort_all": True}, {"success": bool}),
    ],
    # verl: verl/workers/rollout/sglang_rollout/http_server_engine.py (HttpServerAdapter: generate with
    # streaming, flush, release/resume by tags, abort all; update_weights: per bucket a POST
    # /update_weights_from_tensor with serialized_named_tensors (one entry per TP rank), load_format,
    # flush_cache, then GET /flush_cache: tests/server/data/verl_0.9.1_sglang_calls.json).
    "verl": [
        ("GET", "/health_generate", None, {"status": str}),
        ("POST", "/generate", {"input_ids": "{prompt}", "return_logprob": True, "stream": True, "sampling_params": {
            "n": 1, "max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": False,
            "repetition_penalty": 1.0, "skip_special_tokens": True, "spaces_between_special_tokens": True}},
         GEN_READS),
        ("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}, None),
        ("POST", "/release_memory_occupation", {"tags": ["weights"]}, None),
        ("POST", "/resume_memory_occupation", {"tags": ["weights"]}, None),
        (TENSORS, "/update_weights_from_tensor", {"format": "flattened_bucket", "entries": "per-rank"}, None),
        ("GET", "/flush_cache", None, {"success": bool}),
        ("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}, None),
        ("POST", "/flush_cache", {}, {"success": bool}),
        ("POST", "/abort_request", {"abort_all": True}, {"success": bool}),
    ],
}
