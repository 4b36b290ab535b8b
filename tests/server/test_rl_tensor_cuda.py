"""Issue 49, Must-show 3 on one GPU: /update_weights_from_tensor from a trainer process on the
server's GPU, the tensors sent as CUDA IPC handles (torch's multiprocessing pickle, SGLang's
MultiprocessingSerializer): the greedy tokens after the update are a fresh CUDA engine's on the new
checkpoint, in the flattened-bucket and the plain format, with torch's reductions and SGLang's
patched ones (the device as its UUID); the verl adapter does the same from this process. GPU machine only (`gpu` marker)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_common import ENGINE, checkpoint
from serverproc import ServerProcess

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
TENSOR_TRAINER = str(Path(__file__).resolve().parent.parent / "rl_tensor_trainer.py")
PROMPTS = [[3, 5, 7, 9, 11], list(range(20, 38)), [401, 17, 99]]
SP = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
CUDA = ["--device", "cuda", "--engine-config", ENGINE]


def greedy(s: ServerProcess) -> list[list[int]]:
    r = s.http.post("/generate", json={"input_ids": PROMPTS, "sampling_params": SP})
    assert r.status_code == 200, r.text
    return [b["output_ids"] for b in r.json()]


def push_ipc(url: str, model: str, fmt: str, version: str, *extra: str) -> None:
    r = subprocess.run([sys.executable, TENSOR_TRAINER, "--url", url, "--model", model, "--format", fmt,
                        "--sharing", "cuda", "--version", version, *extra], capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines[-1] == {"done": True}
    assert all(x["update"]["status"] == 200 and x["update"]["body"]["success"] for x in lines[:-1]), lines


def test_update_from_cuda_ipc_tensors_equals_a_fresh_engine(tmp_path):
    assert torch.cuda.is_available()
    s0, s1 = checkpoint(tmp_path / "s0", 0), checkpoint(tmp_path / "s1", 1)
    fresh = ServerProcess(s1, *CUDA)
    try:
        ref1 = greedy(fresh)
    finally:
        assert fresh.stop() == 0, fresh.log[-3000:]
    s = ServerProcess(s0, *CUDA)
    try:
        ref0 = greedy(s)
        assert ref0 != ref1
        push_ipc(s.url, s1, "flattened_bucket", "ipc-1")   # slime's colocated path
        assert greedy(s) == ref1
        push_ipc(s.url, s0, "direct", "ipc-0")
        assert greedy(s) == ref0
        # as SGLang's patched reductions write them (slime and verl call monkey_patch_torch_reductions)
        push_ipc(s.url, s1, "flattened_bucket", "ipc-uuid", "--sglang-reductions")
        assert greedy(s) == ref1
        push_ipc(s.url, s0, "direct", "ipc-0")
        assert greedy(s) == ref0
        assert s.http.get("/get_weight_version").json() == {"weight_version": "ipc-0"}

        # verl's hybrid worker: this process holds the actor's weights on the GPU
        from pdrollout.engine.server.verl_rollout import PdrolloutRollout
        rollout = PdrolloutRollout(s.url, bucket_megabytes=0.25)
        weights = [(n, t.cuda()) for n, t in load_file(f"{s1}/model.safetensors").items()]
        asyncio.run(rollout.update_weights(iter(weights), global_steps=7))
        assert greedy(s) == ref1
        assert s.http.get("/get_weight_version").json() == {"weight_version": "7"}
    finally:
        assert s.stop() == 0, s.log[-3000:]
