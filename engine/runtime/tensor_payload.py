"""Named tensors as SGLang's `/update_weights_from_tensor` carries them: each entry of
`serialized_named_tensors` is base64 of a pickle written by torch's multiprocessing pickler
(SGLang's MultiprocessingSerializer), so CUDA tensors travel as IPC handles; CPU tensors travel by
value (a plain pickle: the data inline) or, pickled by torch's multiprocessing pickler with the
`file_system` sharing strategy, as a shared-memory name this host's server opens (through the
trainer's torch_shm_manager, while the trainer keeps the tensor). A CPU tensor shared by file
descriptor (torch's default strategy) is refused with that advice: the descriptor comes from the
trainer's multiprocessing resource sharer, which hands it only to a process holding the trainer's
multiprocessing authkey, i.e. its own children (SGLang's server cannot take one either).

Unpickling runs code, so `load_entry` is a restricted unpickler: it admits only torch's tensor and
storage rebuild functions, dtypes, `torch.Size`, `OrderedDict`, and by name SGLang's two record
classes and its patched CUDA rebuild (mapped onto the look-alikes below: SGLang need not be installed). Anything else is refused
before it is called. The route is admin-only besides (docs/SERVER.md).

Formats (`load_format`): None / "direct": a list of `(name, tensor)` pairs, a tensor possibly a
`LocalSerializedTensor` (one pickle per rank, what verl sends); "flattened_bucket": a dict
`{"flattened_tensor", "metadata": [FlattenedTensorMetadata]}` (slime's colocated path)."""
from __future__ import annotations

import base64
import binascii
import io
import math
import pickle
from dataclasses import dataclass

import torch

LOAD_FORMATS = (None, "direct", "flattened_bucket")


class PayloadError(ValueError):
    """An entry that is not the structure the route expects (names what is wrong)."""


@dataclass
class LocalSerializedTensor:
    """SGLang's record of one tensor serialized once per rank: `values[r]` is rank r's pickle."""
    values: list


@dataclass
class FlattenedTensorMetadata:
    """SGLang's record of one tensor inside a flattened bucket."""
    name: str
    shape: tuple
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _load_by_value(data: bytes):
    # torch.storage._load_from_bytes unpickles with weights_only=False; this one refuses code
    return torch.load(io.BytesIO(data), weights_only=True)


_REDUCTIONS = ("rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_empty", "rebuild_typed_storage",
               "rebuild_typed_storage_child", "rebuild_storage_filename")
_CPU_BY_FD = (("torch.multiprocessing.reductions", "rebuild_storage_fd"), ("multiprocessing.resource_sharer", "DupFd"),
              ("multiprocessing.reduction", "DupFd"))
_ALLOWED = {("torch.multiprocessing.reductions", n) for n in _REDUCTIONS} | {
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"),
    ("torch", "Size"), ("torch", "Tensor"), ("torch", "device"), ("torch", "UntypedStorage"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "TypedStorage"),
    ("torch.nn.parameter", "Parameter"), ("collections", "OrderedDict")}
_RECORDS = {"LocalSerializedTensor": LocalSerializedTensor, "FlattenedTensorMetadata": FlattenedTensorMetadata}
_RECORD_MODULES = ("sglang.", "pdrollout.", "engine.")
_DEVICE_ARG = 6   # the device slot of torch's rebuild_cuda_tensor arguments


def _rebuild_cuda_by_uuid(*args):
    """SGLang's patched CUDA rebuild (monkey_patch_torch_reductions): the device travels as its
    UUID, so trainer and server may number their visible GPUs differently."""
    args = list(args)
    if isinstance(args[_DEVICE_ARG], str):
        found = [i for i in range(torch.cuda.device_count())
                 if str(torch.cuda.get_device_properties(i).uuid) == args[_DEVICE_ARG]]
        if not found:
            raise PayloadError(f"no visible CUDA device has the UUID {args[_DEVICE_ARG]} the tensor lives on")
        args[_DEVICE_ARG] = found[0]
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    return rebuild_cuda_tensor(*args)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_by_value
        if (module, name) in _CPU_BY_FD:
            raise PayloadError("a CPU tensor shared by file descriptor (torch's default sharing strategy) can be "
                               "taken only by a child of the trainer's process (its multiprocessing authkey): on "
                               "this host call torch.multiprocessing.set_sharing_strategy('file_system') in the "
                               "trainer before serializing, or send CPU tensors by value (pickle.dumps, base64), "
                               "or CUDA tensors (IPC handles)")
        if name == "_rebuild_cuda_tensor_modified" and module.startswith("sglang."):
            return _rebuild_cuda_by_uuid
        if name in _RECORDS and module.startswith(_RECORD_MODULES):
            return _RECORDS[name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            obj = getattr(__import__(module, fromlist=[name]), name)
            return obj
        raise PayloadError(f"refused to unpickle {module}.{name}: only torch tensors and SGLang's "
                           f"weight-update records may appear in serialized_named_tensors")


def _unpickle(data: bytes, what: str):
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except PayloadError:
        raise
    except Exception as e:   # truncated, not a pickle, a shared-memory name that does not exist...
        raise PayloadError(f"{what} is not a readable tensor pickle: {type(e).__name__}: {e}") from None


def decode(entry, what: str) -> bytes:
    if isinstance(entry, (bytes, bytearray)):
        return bytes(entry)
    if not isinstance(entry, str):
        raise PayloadError(f"{what} must be a base64 string, got {type(entry).__name__}")
    try:
        return base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError):
        raise PayloadError(f"{what} is not valid base64") from None


def load_entry(entry, load_format: str | None, rank: int, what: str) -> list[tuple[str, torch.Tensor]]:
    """One entry of `serialized_named_tensors` as (name, full tensor) pairs."""
    obj = _unpickle(decode(entry, what), what)
    if load_format == "flattened_bucket":
        return _unflatten(obj, what)
    if not isinstance(obj, (list, tuple)):
        raise PayloadError(f"{what}: load_format {load_format!r} needs a list of (name, tensor) pairs, "
                           f"got {type(obj).__name__}")
    out = []
    for i, pair in enumerate(obj):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise PayloadError(f"{what}[{i}] must be a (name, tensor) pair")
        name, t = pair
        if isinstance(t, LocalSerializedTensor):
            if not (isinstance(t.values, (list, tuple)) and rank < len(t.values)):
                raise PayloadError(f"{what}[{i}] ({name}): LocalSerializedTensor has no value for rank {rank}")
            t = _unpickle(decode(t.values[rank], f"{what}[{i}].values[{rank}]"), f"{what}[{i}].values[{rank}]")
        if not isinstance(t, torch.Tensor):
            raise PayloadError(f"{what}[{i}] ({name}): expected a tensor, got {type(t).__name__}")
        out.append((name, t))
    return out


def _unflatten(obj, what: str) -> list[tuple[str, torch.Tensor]]:
    if not (isinstance(obj, dict) and set(obj) == {"flattened_tensor", "metadata"}):
        raise PayloadError(f"{what}: load_format 'flattened_bucket' needs a dict with keys flattened_tensor "
                           f"and metadata")
    flat, metas = obj["flattened_tensor"], obj["metadata"]
    if not (isinstance(flat, torch.Tensor) and flat.dim() == 1):
        raise PayloadError(f"{what}: flattened_tensor must be a 1-D tensor")
    if not isinstance(metas, (list, tuple)):
        raise PayloadError(f"{what}: metadata must be a list of FlattenedTensorMetadata")
    # SGLang's multi-dtype buckets are bytes (offsets in bytes); older ones hold one dtype (offsets in elements)
    as_bytes = flat.dtype == torch.uint8
    out = []
    for i, m in enumerate(metas):
        if not (isinstance(m, FlattenedTensorMetadata) and isinstance(m.name, str)
                and isinstance(m.dtype, torch.dtype)):
            raise PayloadError(f"{what}: metadata[{i}] is not a FlattenedTensorMetadata")
        shape = tuple(m.shape)
        size = math.prod(shape) * (m.dtype.itemsize if as_bytes and m.dtype != torch.uint8 else 1)
        if not (0 <= m.start_idx <= m.end_idx <= flat.numel() and m.end_idx - m.start_idx == size):
            raise PayloadError(f"{what}: metadata[{i}] ({m.name}) range [{m.start_idx}, {m.end_idx}) does not "
                               f"hold shape {list(shape)} of {m.dtype} in a flattened tensor of {flat.numel()}")
        part = flat[m.start_idx:m.end_idx]
        t = part.view(m.dtype).reshape(shape) if as_bytes else part.reshape(shape).to(m.dtype)
        out.append((m.name, t))
    return out


# ---- the trainer's side (tests, the verl adapter) ------------------------------------------------
def serialize(obj) -> str:
    """What SGLang's MultiprocessingSerializer writes with output_str=True: CUDA tensors as IPC
    handles (CPU tensors: use `serialize_by_value`)."""
    from multiprocessing.reduction import ForkingPickler
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def serialize_by_value(obj) -> str:
    """CPU tensors with their data inline (a trainer on another host, or no GPU)."""
    return base64.b64encode(pickle.dumps(obj)).decode()


def flattened_bucket(named: list[tuple[str, torch.Tensor]]) -> dict:
    """SGLang's multi-dtype flattened bucket: one uint8 tensor, byte offsets."""
    parts, metas, at = [], [], 0
    for name, t in named:
        b = t.detach().contiguous().reshape(-1).view(torch.uint8)
        metas.append(FlattenedTensorMetadata(name, tuple(t.shape), t.dtype, at, at + b.numel(), b.numel()))
        parts.append(b)
        at += b.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metas}
