"""A trainer process for the tests (run as a script): it holds a checkpoint's tensors and pushes them
into a running pdrollout server with POST /update_weights_from_tensor, as slime's colocated path and
verl do with SGLang: per bucket, `serialized_named_tensors` (base64 of torch's multiprocessing
pickle), the tensors kept alive until the answer is back.

    python tests/rl_tensor_trainer.py --url URL --model DIR --format flattened_bucket|direct
        [--sharing value|cuda] [--sglang-reductions] [--entries N] [--version V] [--token T] [--source ADDR]
--sharing value: CPU tensors, a plain pickle with the data inline; cuda: the tensors on the
current CUDA device, sent as IPC handles (torch's multiprocessing pickle); with --sglang-reductions
as SGLang's patched reductions write them (the device as its UUID, SGLang's rebuild function). --entries: how many entries (SGLang's one per TP rank; 1: one for all).
Prints one JSON line per HTTP answer, then {"done": true}."""
from __future__ import annotations

import argparse
import json

import torch
from safetensors.torch import load_file

from rl_common import post

from pdrollout.engine.runtime.tensor_payload import flattened_bucket, serialize, serialize_by_value


def sglang_reductions() -> None:
    """What SGLang's monkey_patch_torch_reductions makes of a CUDA tensor's pickle: the device slot
    as the GPU's UUID and SGLang's rebuild function by name (sglang is not installed here, so its
    module is a stand-in that only names the function: the server never imports it)."""
    import sys
    import types
    from multiprocessing.reduction import ForkingPickler
    from torch.multiprocessing import reductions
    path = "sglang.srt.utils.patch_torch"
    for i in range(path.count(".") + 1):
        name = ".".join(path.split(".")[:i + 1])
        sys.modules.setdefault(name, types.ModuleType(name))

    def _rebuild_cuda_tensor_modified(*args):
        raise RuntimeError("rebuilt by the server only")
    _rebuild_cuda_tensor_modified.__module__ = path
    _rebuild_cuda_tensor_modified.__qualname__ = "_rebuild_cuda_tensor_modified"
    sys.modules[path]._rebuild_cuda_tensor_modified = _rebuild_cuda_tensor_modified

    def reduce(t):
        fn, args = reductions.reduce_tensor(t)
        if fn is reductions.rebuild_cuda_tensor:
            args = list(args)
            args[6] = str(torch.cuda.get_device_properties(args[6]).uuid)
            fn, args = _rebuild_cuda_tensor_modified, tuple(args)
        return fn, args
    for cls in (torch.Tensor, torch.nn.Parameter):
        ForkingPickler.register(cls, reduce)


def buckets(named: list, limit: int) -> list[list]:
    out, cur, size = [], [], 0
    for name, t in named:
        if cur and size + t.numel() * t.element_size() > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += t.numel() * t.element_size()
    return out + [cur]


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--url", required=True)
    a.add_argument("--model", required=True)
    a.add_argument("--format", choices=["direct", "flattened_bucket"], required=True)
    a.add_argument("--sharing", choices=["value", "cuda"], default="value")
    a.add_argument("--sglang-reductions", action="store_true")
    a.add_argument("--entries", type=int, default=1)
    a.add_argument("--version", default=None)
    a.add_argument("--bucket-bytes", type=int, default=256 << 10)
    a.add_argument("--token", default=None)
    a.add_argument("--source", default=None, help="bind the HTTP calls to this local address")
    args = a.parse_args()
    named = list(load_file(f"{args.model}/model.safetensors").items())
    if args.sharing == "cuda":
        named = [(n, t.cuda()) for n, t in named]
    if args.sglang_reductions:
        sglang_reductions()
    groups = buckets(named, args.bucket_bytes)
    for i, bucket in enumerate(groups):
        payload = flattened_bucket(bucket) if args.format == "flattened_bucket" else bucket
        entry = serialize_by_value(payload) if args.sharing == "value" else serialize(payload)
        body = {"serialized_named_tensors": [entry] * args.entries,
                "load_format": None if args.format == "direct" else args.format, "flush_cache": True}
        if args.version is not None and i == len(groups) - 1:   # the version lands with the last bucket
            body["weight_version"] = args.version
        answer = post(args.url + "/update_weights_from_tensor", body, args.token, args.source)
        del payload   # the server has copied the bucket in: the trainer may free it now
        print(json.dumps({"update": answer, "bucket": i, "tensors": len(bucket)}), flush=True)
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    main()
