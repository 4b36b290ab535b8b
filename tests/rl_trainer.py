"""A trainer process for the tests (run as a script): it holds a checkpoint's tensors and pushes them
into a running pdrollout server the way an RL framework does with SGLang (slime's distributed
update): form a weights update group as its rank 0 (with torch's own group helper, as SGLang's
clients do, while the server's ranks join through /init_weights_update_group), then per bucket
POST /update_weights_from_distributed with the names/dtypes/shapes while broadcasting the tensors.

    python tests/rl_trainer.py --url URL --model DIR --engine-ranks N [--version V] [--keep-group]
Prints one JSON line per HTTP answer, then {"done": true}."""
from __future__ import annotations

import argparse
import datetime
import json
import socket
import threading

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import rl_common


SOURCE: list = []   # --source: the address this trainer's HTTP calls come from (an --admin-peers entry)


def post(url: str, body: dict) -> dict:
    return rl_common.post(url, body, source=SOURCE[0] if SOURCE else None)


def in_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn()))
    t.start()
    return t, box


def form_group(master: str, port: int, world: int, name: str):
    """Rank 0 of the update group: the store's host, then torch's group helper (what SGLang's
    init_custom_process_group-style clients call)."""
    from torch.distributed.distributed_c10d import _new_process_group_helper
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore(master, port, world, is_master=True, timeout=timeout)
    pg, _ = _new_process_group_helper(world, 0, [], "gloo", store, group_name=name, timeout=timeout)
    return pg


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--url", required=True)
    a.add_argument("--model", required=True)
    a.add_argument("--engine-ranks", type=int, required=True)
    a.add_argument("--version", default=None)
    a.add_argument("--group", default="trainer-group")
    a.add_argument("--bucket-bytes", type=int, default=1 << 20)
    a.add_argument("--flush-cache", default="true")
    a.add_argument("--steps", default="init,update,destroy")
    a.add_argument("--port", type=int, default=0)
    a.add_argument("--source", default=None, help="bind the HTTP calls to this local address")
    a.add_argument("--init-extra", default="{}", help="JSON merged into the init body; "
                   '"master_port": "str" sends the port as a string (AReaL)')
    args = a.parse_args()
    if args.source:
        SOURCE.append(args.source)
    extra = json.loads(args.init_extra)
    tensors = load_file(f"{args.model}/model.safetensors")
    world = 1 + args.engine_ranks
    port = args.port
    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    steps = args.steps.split(",")
    if "init" in steps:
        t, box = in_thread(lambda: post(args.url + "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world,
            "group_name": args.group, "backend": "gloo",
            **{k: (str(port) if v == "str" and k == "master_port" else v) for k, v in extra.items()}}))
        pg = form_group("127.0.0.1", port, world, args.group)
        t.join()
        print(json.dumps({"init": box["r"]}), flush=True)
    if "wait" in steps:   # the caller says when (a line on stdin): the group stays formed meanwhile
        print(json.dumps({"waiting": True}), flush=True)
        input()
    if "update" in steps:
        buckets, cur, size = [], [], 0
        for name, t in tensors.items():
            if cur and size + t.numel() * t.element_size() > args.bucket_bytes:
                buckets.append(cur)
                cur, size = [], 0
            cur.append((name, t))
            size += t.numel() * t.element_size()
        buckets.append(cur)
        for i, bucket in enumerate(buckets):
            body = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket], "group_name": args.group,
                    "flush_cache": args.flush_cache == "true"}
            if args.version is not None and i == len(buckets) - 1:   # the version lands with the last bucket
                body["weight_version"] = args.version
            th, box = in_thread(lambda body=body: post(args.url + "/update_weights_from_distributed", body))
            for _, t in bucket:
                pg.broadcast(t.contiguous(), 0).wait()
            th.join()
            print(json.dumps({"update": box["r"], "bucket": i, "tensors": len(bucket)}), flush=True)
    if "destroy" in steps:
        print(json.dumps({"destroy": post(args.url + "/destroy_weights_update_group", {"group_name": args.group})}),
              flush=True)
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    main()
