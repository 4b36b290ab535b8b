"""A trainer process for the tests, run under the RL clients' python (tests/rl_clients.py): it holds a
checkpoint's tensors and pushes them into a running pdrollout server as slime's distributed update does
(slime 624b824, slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py and
slime/backends/sglang_utils/sglang_engine.py). The weights update group is formed by SGLang's own
`sglang.srt.utils.init_custom_process_group` (the helper slime's and AReaL's copies are of), imported
from the released package, as the group's rank 0, while the server's ranks join through
/init_weights_update_group; the tensors go by `torch.distributed.broadcast` on that group.

slime's bodies and order, as data read from its source: init `{master_address, master_port,
rank_offset, world_size, group_name, backend}` (group "slime-pp_0"); buckets of the non-expert
tensors, then of the expert ones, each closed before the tensor that would take it past
--bucket-bytes (slime's --update-weight-buffer-size); per bucket POST /update_weights_from_distributed
`{names, dtypes (str without "torch."), shapes, group_name, flush_cache, weight_version}` with
`weight_version` on every bucket, fired before the bucket's broadcasts, which run asynchronously and
are all waited on before the answer is read.

    python tests/rl_trainer.py --url URL --model DIR --engine-ranks N [--version V] [--steps ...]
Prints one JSON line per HTTP answer, then {"done": true}."""
from __future__ import annotations

import argparse
import datetime
import json
import socket
import threading

import torch.distributed as dist
from safetensors.torch import load_file
from sglang.srt.utils import init_custom_process_group

import rl_common

SOURCE: list = []   # --source: the address this trainer's HTTP calls come from (an --admin-peers entry)


def post(url: str, body: dict) -> dict:
    return rl_common.post(url, body, source=SOURCE[0] if SOURCE else None)


def in_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn()))
    t.start()
    return t, box


def slime_buckets(tensors: dict, limit: int) -> list[list]:
    """slime's order and cut: non-expert tensors, then expert tensors (".experts." in the name)."""
    out = []
    for expert in (False, True):
        cur, size = [], 0
        for name, t in tensors.items():
            if (".experts." in name) != expert:
                continue
            nbytes = t.numel() * t.element_size()
            if cur and size + nbytes > limit:
                out.append(cur)
                cur, size = [], 0
            cur.append((name, t))
            size += nbytes
        if cur:
            out.append(cur)
    return out


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--url", required=True)
    a.add_argument("--model", required=True)
    a.add_argument("--engine-ranks", type=int, required=True)
    a.add_argument("--version", default=None)
    a.add_argument("--group", default="slime-pp_0")
    a.add_argument("--backend", default="gloo")
    a.add_argument("--bucket-bytes", type=int, default=1 << 20)
    a.add_argument("--flush-cache", default="true")
    a.add_argument("--steps", default="init,update,destroy")
    a.add_argument("--port", type=int, default=0)
    a.add_argument("--source", default=None, help="bind the HTTP calls to this local address")
    a.add_argument("--skyrl", action="store_true", help="SkyRL 01dc9de's bodies (remote_inference_engine.py): "
                   "one tensor a request as {name, dtype, shape}, destroy with no body")
    a.add_argument("--init-extra", default="{}", help="JSON merged into the init body; "
                   '"master_port": "str" sends the port as a string (AReaL)')
    args = a.parse_args()
    if args.source:
        SOURCE.append(args.source)
    extra = json.loads(args.init_extra)
    tensors = load_file(f"{args.model}/model.safetensors")
    if args.backend == "nccl":
        tensors = {n: t.cuda() for n, t in tensors.items()}
    world = 1 + args.engine_ranks
    port = args.port
    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    steps = args.steps.split(",")
    pg = None
    if "init" in steps:
        t, box = in_thread(lambda: post(args.url + "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world,
            "group_name": args.group, "backend": args.backend,
            **{k: (str(port) if v == "str" and k == "master_port" else v) for k, v in extra.items()}}))
        pg = init_custom_process_group(backend=args.backend, init_method=f"tcp://127.0.0.1:{port}",
                                       world_size=world, rank=0, group_name=args.group,
                                       timeout=datetime.timedelta(seconds=120))
        t.join()
        print(json.dumps({"init": box["r"]}), flush=True)
    if "wait" in steps:   # the caller says when (a line on stdin): the group stays formed meanwhile
        print(json.dumps({"waiting": True}), flush=True)
        input()
    if "update" in steps and args.skyrl:
        for i, (name, t) in enumerate(tensors.items()):
            body = {"name": name, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}
            th, box = in_thread(lambda body=body: post(args.url + "/update_weights_from_distributed", body))
            dist.broadcast(t.data, 0, group=pg)
            th.join()
            print(json.dumps({"update": box["r"], "bucket": i, "tensors": 1}), flush=True)
    elif "update" in steps:
        for i, bucket in enumerate(slime_buckets(tensors, args.bucket_bytes)):
            body = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket], "group_name": args.group,
                    "flush_cache": args.flush_cache == "true"}
            if args.version is not None:
                body["weight_version"] = args.version
            th, box = in_thread(lambda body=body: post(args.url + "/update_weights_from_distributed", body))
            handles = [dist.broadcast(t.data, 0, group=pg, async_op=True) for _, t in bucket]
            for h in handles:
                h.wait()
            th.join()
            print(json.dumps({"update": box["r"], "bucket": i, "tensors": len(bucket)}), flush=True)
    if "destroy" in steps:
        body = {} if args.skyrl else {"group_name": args.group}
        print(json.dumps({"destroy": post(args.url + "/destroy_weights_update_group", body)}), flush=True)
        if pg is not None:
            dist.destroy_process_group(pg)
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    main()
