"""The RL loop's endpoints, SGLang 0.5.23's bodies and answers: new weights (from disk, from a
trainer's weights update group), the weight version, and giving memory back between rollouts.

Weight changes run through `Server.exclusive` (in-flight requests finish under the old weights
first, unless generation is paused) and then as a rank-shared op of the engine (runtime/
engine_ops.py): every rank changes at the same plan boundary. A refused op (bad arguments, wrong
state) answers 400 `{"success": false, "message": ...}` and changes nothing."""
from __future__ import annotations

import logging

from aiohttp import web

from ..runtime.engine_ops import OpError, OpFailed
from .app import admin, json_response, read_json, server_of
from .protocol import (BadRequest, DestroyGroupRequest, InitGroupRequest, MemoryRequest, UpdateFromDiskRequest,
                       UpdateFromDistributedRequest, UpdateFromTensorRequest, UpdateWeightVersionRequest)

log = logging.getLogger("pdrollout.server")


async def _op(request: web.Request, fn, *, abort_all: bool = False, **extra) -> web.Response:
    server = server_of(request)
    try:
        message = await server.exclusive(fn, abort_all=abort_all)
    except (OpError, OpFailed) as e:
        log.warning("%s refused: %s", request.path, e)
        return json_response({"success": False, "message": str(e), **extra}, 400)
    server.weight_version = await server.bridge.call(lambda e: e.weight_version)
    log.info("%s: %s (weight version %s)", request.path, message, server.weight_version)
    return json_response({"success": True, "message": message, **extra})


async def _group_op(request: web.Request, fn) -> web.Response:
    """A weights-update-group op: no exclusive wait (it changes no weight), SGLang's success body."""
    try:
        message = await server_of(request).bridge.call(fn)
    except (OpError, OpFailed) as e:
        return json_response({"success": False, "message": str(e)}, 400)
    return json_response({"success": True, "message": message})


@admin
async def update_weights_from_disk(request: web.Request) -> web.Response:
    req = await read_json(request, UpdateFromDiskRequest)
    return await _op(request, lambda e: e.update_weights_from_disk(req.model_path, req.weight_version,
                                                                   req.flush_cache),
                     abort_all=req.abort_all_requests, num_paused_requests=0)


@admin
async def init_weights_update_group(request: web.Request) -> web.Response:
    req = await read_json(request, InitGroupRequest)
    # no exclusive wait: forming a group changes no weight (the trainer waits for it to form)
    return await _group_op(request, lambda e: e.init_weights_update_group(
        req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name, req.backend))


@admin
async def update_weights_from_distributed(request: web.Request) -> web.Response:
    req = await read_json(request, UpdateFromDistributedRequest)
    return await _op(request, lambda e: e.update_weights_from_distributed(
        req.names, req.dtypes, req.shapes, req.group_name, req.weight_version, req.flush_cache),
        abort_all=req.abort_all_requests)


@admin
async def update_weights_from_tensor(request: web.Request) -> web.Response:
    # admin-only above all: its entries are pickles, and a pickle runs code (tensor_payload.py)
    req = await read_json(request, UpdateFromTensorRequest)
    return await _op(request, lambda e: e.update_weights_from_tensor(
        req.serialized_named_tensors, req.load_format, req.weight_version, req.flush_cache),
        abort_all=req.abort_all_requests)


@admin
async def destroy_weights_update_group(request: web.Request) -> web.Response:
    req = await read_json(request, DestroyGroupRequest, allow_empty=True)
    return await _group_op(request, lambda e: e.destroy_weights_update_group(req.group_name))


@admin
async def update_weight_version(request: web.Request) -> web.Response:
    req = await read_json(request, UpdateWeightVersionRequest)

    def apply(e):
        e.set_weight_version(req.new_version)
        return f"Weight version updated to {req.new_version}"
    resp = await _op(request, apply, abort_all=req.abort_all_requests)
    if resp.status == 200:
        return json_response({"success": True, "message": f"Weight version updated to {req.new_version}",
                              "new_version": req.new_version})
    return resp


async def get_weight_version(request: web.Request) -> web.Response:
    server = server_of(request)
    version = await server.bridge.call(lambda e: e.weight_version)
    return json_response({"weight_version": version})


async def _memory(request: web.Request, release: bool) -> web.Response:
    req = await read_json(request, MemoryRequest, allow_empty=True)
    server = server_of(request)
    if not server.settings.enable_memory_saver:   # SGLang's memory saver off: a release there frees nothing
        raise BadRequest(f"{request.path}: this server was started without --enable-memory-saver "
                         "(/get_server_info: enable_memory_saver false), so it keeps its memory; "
                         "start it with --enable-memory-saver to release and resume by tags")

    def apply(e):
        (e.release_memory if release else e.resume_memory)(req.tags)
    try:
        async with server.update_lock:
            await server.bridge.call(apply)
    except (OpError, OpFailed) as e:
        raise BadRequest(str(e)) from None
    return json_response(None)   # SGLang answers 200 with no content (null)


@admin
async def release_memory_occupation(request: web.Request) -> web.Response:
    return await _memory(request, release=True)


@admin
async def resume_memory_occupation(request: web.Request) -> web.Response:
    return await _memory(request, release=False)


# SGLang routes RL frameworks call that this engine does not serve: refused with what and why,
# never a bare 404 (docs/SERVER.md, "What each framework calls").
UNSUPPORTED = {
    "/weights_checker": "slime's --check-weight-update-equal: no weight snapshot/compare here; compare greedy "
                        "outputs against a fresh server on the same checkpoint instead",
    "/post_process_weights": "slime's quantized (int4/fp4 compressed-tensors) weight post-processing: this engine "
                             "loads bf16/fp8 checkpoints only",
    "/pull_weights": "slime's disk-delta weight pull: push weights with /update_weights_from_disk, "
                     "/update_weights_from_distributed or /update_weights_from_tensor",
    "/load_lora_adapter": "LoRA adapters are not served: sync merged weights",
    "/unload_lora_adapter": "LoRA adapters are not served: sync merged weights",
    "/load_lora_adapter_from_tensors": "LoRA adapters are not served: sync merged weights",
    "/sleep": "vLLM's sleep mode (SkyRL's remote engine calls it): use /release_memory_occupation with tags "
              "(--enable-memory-saver)",
    "/wake_up": "vLLM's sleep mode (SkyRL's remote engine calls it): use /resume_memory_occupation with tags "
                "(--enable-memory-saver)",
    "/update_weights_from_ipc": "SGLang's checkpoint-engine IPC update: use /update_weights_from_tensor",
    "/init_weights_send_group_for_remote_instance": "remote-instance weight loading is not served",
    "/send_weights_to_remote_instance": "remote-instance weight loading is not served",
}


async def unsupported(request: web.Request) -> web.Response:
    why = UNSUPPORTED[request.path]
    log.warning("%s %s refused: not served (%s)", request.method, request.path, why)
    return json_response({"success": False, "message": f"{request.path} is not supported by pdrollout: {why}",
                          "error": {"message": f"{request.path} is not supported by pdrollout: {why}",
                                    "type": "not_implemented", "code": 501}}, 501)


def add_routes(app: web.Application) -> None:
    r = app.router
    for path in UNSUPPORTED:
        r.add_route("*", path, unsupported)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/init_weights_update_group", init_weights_update_group)
    r.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    r.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    r.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    r.add_post("/update_weight_version", update_weight_version)
    r.add_get("/get_weight_version", get_weight_version)
    for path, fn in (("/release_memory_occupation", release_memory_occupation),
                     ("/resume_memory_occupation", resume_memory_occupation)):
        r.add_post(path, fn)
        r.add_get(path, fn)
