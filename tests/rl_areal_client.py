"""AReaL's released package (areal 1.0.4) driving a pdrollout server through its own HTTP code, unpatched, run
under the RL clients' python (tests/rl_clients.py): `RemoteSGLangEngine` (areal/engine/sglang_remote.py and
areal/infra/remote_inf_engine.py) generates, pauses, forms the weights update group and sends the
distributed update's body, then continues and generates again. AReaL's trainer side (FSDPEngine's
update_weights: CUDA and an FSDP mesh) does not run without a GPU, so its part is replayed: its group is
formed by AReaL's own `areal.engine.core.distributed.init_custom_process_group` as rank 0, and the
tensors named by the ParamSpecs go by `torch.distributed.broadcast` in their order while AReaL's request
is in flight (what FSDPEngine._update_bucket_weights_from_distributed does per bucket).

    python tests/rl_areal_client.py --addr HOST:PORT --model DIR
Prints one JSON line: the greedy tokens before and after, and the server's weight version."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import socket

import torch.distributed as dist
from safetensors.torch import load_file

from areal.api.alloc_mode import ModelAllocation
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.api.io_struct import ModelRequest, ParamSpec, WeightUpdateMeta
from areal.engine.core.distributed import init_custom_process_group
from areal.engine.sglang_remote import RemoteSGLangEngine

PROMPT = [3, 5, 7, 9, 11, 13]


async def generate(engine) -> list[int]:
    req = ModelRequest(input_ids=list(PROMPT), gconfig=GenerationHyperparameters(max_new_tokens=8, greedy=True))
    return list((await engine.agenerate(req)).output_tokens)


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--addr", required=True)
    a.add_argument("--model", required=True)
    args = a.parse_args()
    engine = RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d1", request_timeout=300))
    engine.initialize(addr=args.addr)
    before = asyncio.run(generate(engine))
    engine.pause_generation()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    meta = WeightUpdateMeta.from_fsdp_xccl(ModelAllocation.from_str("sglang:d1"))
    meta.nccl_master_address, meta.nccl_master_port, meta.nccl_group_name = "127.0.0.1", port, "update_weight_group"
    joined = engine.init_weights_update_group(meta)
    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0,
                                   group_name=meta.nccl_group_name, timeout=datetime.timedelta(seconds=120))
    joined.result()
    tensors = load_file(f"{args.model}/model.safetensors")
    specs = [ParamSpec(name=n, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
             for n, t in tensors.items()]
    sent = engine.update_weights_from_distributed(meta, specs)
    for t in tensors.values():
        dist.broadcast(t, 0, group=pg)
    sent.result()
    engine.set_version(1)
    engine.continue_generation()
    after = asyncio.run(generate(engine))
    dist.destroy_process_group(pg)
    engine.destroy()
    print(json.dumps({"before": before, "after": after}), flush=True)


if __name__ == "__main__":
    main()
