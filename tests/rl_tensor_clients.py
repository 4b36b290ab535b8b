"""/update_weights_from_tensor as verl 0.9.1 and slime send it, from their released code where it imports (run
under the RL clients' python, tests/rl_clients.py), with CPU tensors on the server's host:

* verl: its bucketing (`verl.workers.rollout.sglang_rollout.utils.get_named_tensor_buckets`), then what
  SGLang's `sglang.srt.weight_sync.utils.update_weights` builds as verl's ServerAdapter.update_weights calls
  it (device_mesh_key "infer_tp"), with SGLang's own `LocalSerializedTensor`, `UpdateWeightsFromTensorReqInput`
  and serializer: per tensor a LocalSerializedTensor of ForkingPickler pickles, the list pickled once per
  TP rank, `load_format` null (update_weights itself cannot take CPU tensors: see `verl`). verl's
  AsyncHttpServerAdapter does not construct on sglang 0.5.23 (rl_clients.NOT_IMPORTED), so its
  update_weights_from_tensor body is replayed as data: every entry base64, POST `{serialized_named_tensors,
  load_format, flush_cache}`; then verl's GET /flush_cache.
* slime (not on PyPI; slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py,
  _send_to_colocated_engine, and sglang_engine.py): per bucket SGLang's `FlattenedTensorBucket`, its dict
  `{flattened_tensor, metadata}` through SGLang's `MultiprocessingSerializer.serialize(output_str=True)`,
  one entry per engine rank, POST `{serialized_named_tensors, load_format: "flattened_bucket", flush_cache:
  false, weight_version}`.

--sharing picks torch's CPU sharing strategy in this process: file_system (a name the server's host opens)
or file_descriptor (torch's default: the server refuses it, naming why and what to do).

    python tests/rl_tensor_clients.py --url URL --model DIR --client verl|slime --sharing S [--ranks N]
Prints one JSON line per HTTP answer, then {"done": true}."""
from __future__ import annotations

import argparse
import asyncio
import base64
import json

import httpx
import torch
import torch.multiprocessing
from safetensors.torch import load_file
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
from verl.workers.rollout.sglang_rollout.utils import get_named_tensor_buckets

import rl_common

BUCKET = 256 << 10


def verl(url: str, tensors: dict, ranks: int) -> None:
    """SGLang's update_weights itself cannot take CPU tensors: its monkey_patch_torch_reductions indexes the
    CUDA device slot of every tensor's reduction (IndexError on a CPU tensor's, before any request). Its
    body, with SGLang's own classes and serializer: per tensor a LocalSerializedTensor of one pickle per
    TP rank, the list pickled once per rank, load_format null; then verl's adapter's POST and GET /flush_cache."""
    for batch in asyncio.run(_buckets(tensors)):
        named = [(name, LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(t.detach())] * ranks))
                 for name, t in batch]
        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(named) for _ in range(ranks)],
            load_format=None)
        answer = rl_common.post(url + "/update_weights_from_tensor", {
            "serialized_named_tensors": [base64.b64encode(x).decode("utf-8") for x in req.serialized_named_tensors],
            "load_format": req.load_format, "flush_cache": req.flush_cache})
        print(json.dumps({"update": answer}), flush=True)
    print(json.dumps({"flush": httpx.get(url + "/flush_cache", timeout=60).status_code}), flush=True)


async def _buckets(tensors: dict) -> list:
    return [b async for b in get_named_tensor_buckets(iter(tensors.items()), BUCKET)]


def slime(url: str, tensors: dict, ranks: int) -> None:
    cur, size, buckets = [], 0, []
    for name, t in tensors.items():
        if cur and size + t.numel() * t.element_size() > BUCKET:
            buckets.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += t.numel() * t.element_size()
    buckets.append(cur)
    for bucket in buckets:
        flat = FlattenedTensorBucket(named_tensors=bucket)
        data = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
        entry = MultiprocessingSerializer.serialize(data, output_str=True)
        answer = rl_common.post(url + "/update_weights_from_tensor", {
            "serialized_named_tensors": [entry] * ranks, "load_format": "flattened_bucket", "flush_cache": False,
            "weight_version": "1"})
        print(json.dumps({"update": answer}), flush=True)
        del data   # kept until the answer came (slime's long_live_tensors)


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--url", required=True)
    a.add_argument("--model", required=True)
    a.add_argument("--client", choices=["verl", "slime"], required=True)
    a.add_argument("--sharing", choices=["file_system", "file_descriptor"], required=True)
    a.add_argument("--ranks", type=int, default=1)
    args = a.parse_args()
    torch.multiprocessing.set_sharing_strategy(args.sharing)
    tensors = load_file(f"{args.model}/model.safetensors")
    if args.client == "verl":
        verl(args.url, tensors, args.ranks)
    else:
        slime(args.url, tensors, args.ranks)
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    main()
