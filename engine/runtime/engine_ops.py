"""The engine's rank-shared ops on rank 0 (a mixin of `Engine`): new weights (from disk, from a
trainer's update group), the weight version, retraction, memory release and resume.

An op runs between two steps: rank 0 checks its arguments (a bad one raises `OpError` and nothing
changes), then broadcasts a StepPlan that carries the op and no rows; every rank runs it at that
plan boundary (runtime/weight_sync.py) and reports, so a change lands at the same step on every
rank, ordered after every step before it (a step is complete on every rank when `step()` returns).
"""
from __future__ import annotations

from ..model.loader import CheckpointError
from ..model.weights import checkpoint_shapes, parse_dtype
from ..protocol.config import ConfigError, ModelConfig
from ..protocol.plan import EngineOp, StepPlan
from .tensor_payload import LOAD_FORMATS
from .weight_sync import TAGS


class OpError(ValueError):
    """An op the engine refuses (bad arguments or state); nothing changed."""


class OpFailed(RuntimeError):
    """An op some rank could not complete (its message names the rank)."""


class EngineOps:
    weight_version: str = "default"

    def _init_ops(self) -> None:
        self.weight_version = "default"
        self.groups: dict[str, dict] = {}         # update groups as rank 0 knows them
        self.released: set[str] = set()
        self.model_path = self.config.model

    def run_op(self, kind: str, **args) -> None:
        self.drain()   # ops run between steps: no P epoch in flight
        plan = StepPlan(self.step_id, self.control.model_dump(), ops=(EngineOp(kind, args),))
        _, reports = self._exchange(plan)
        errors = [r.ops[0] for r in reports if r is not None and r.ops and r.ops[0]]
        if errors:
            raise OpFailed("; ".join(errors))

    def set_weight_version(self, version: str | None) -> None:
        """Tokens emitted from the next step on carry this version (None: unchanged)."""
        if version is None:
            return
        if not isinstance(version, str) or not version:
            raise OpError("weight_version must be a non-empty string")
        self.weight_version = version
        for s in self.schedulers:
            s.weight_version = version

    # ---- weights -----------------------------------------------------------------------
    def update_weights_from_disk(self, path: str, weight_version: str | None = None, flush_cache: bool = True) -> str:
        self._need_weights("update_weights_from_disk")
        try:
            cfg = ModelConfig.load(path)
            if cfg != self.model_config:
                diff = [f for f in ModelConfig.__dataclass_fields__ if f != "raw"
                        and getattr(cfg, f) != getattr(self.model_config, f)]
                raise OpError(f"{path} is a different architecture: {', '.join(diff)} differ")
            shapes = checkpoint_shapes(path)
            wm = self.worker.weights.map
            wm.check(shapes)
            wm.check_complete(shapes)
        except (ConfigError, CheckpointError) as e:
            raise OpError(f"cannot load {path}: {e}") from None
        self.run_op("load_disk", path=str(path))
        self.model_path = str(path)
        self._weights_changed(weight_version, flush_cache)
        return f"Succeeded to update model weights from {path}."

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str) -> str:
        world = self.topo.world
        if group_name in self.groups:
            raise OpError(f"weights update group {group_name!r} already exists (destroy it first)")
        if backend not in ("gloo", "nccl"):
            raise OpError(f"backend must be gloo or nccl, got {backend!r}")
        if backend == "nccl" and not self.worker.cuda:
            raise OpError("backend nccl needs an engine on CUDA devices; this engine runs on CPU: use gloo")
        if not 1 <= rank_offset or rank_offset + world > world_size:
            raise OpError(f"rank_offset {rank_offset} with this engine's {world} rank(s) must fit in "
                          f"[1, world_size {world_size}) (the trainer is rank 0)")
        if not 0 < master_port < 65536:
            raise OpError(f"master_port must be in 1..65535, got {master_port}")
        args = dict(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                    world_size=world_size, group_name=group_name, backend=backend)
        try:
            self.run_op("group_init", **args)
        except OpFailed:   # ranks that did join leave again: no half-formed group stays behind
            self.run_op("group_destroy", group_name=group_name, missing_ok=True)
            raise
        self.groups[group_name] = args
        return f"Succeeded to initialize the weights update group {group_name!r} (ranks {rank_offset}.." \
               f"{rank_offset + world - 1} of {world_size}, {backend})."

    def update_weights_from_distributed(self, names: list, dtypes: list, shapes: list, group_name: str,
                                        weight_version: str | None = None, flush_cache: bool = True) -> str:
        self._need_weights("update_weights_from_distributed")
        if group_name not in self.groups:
            raise OpError(f"no weights update group {group_name!r} (call /init_weights_update_group first)")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise OpError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
        try:
            for d in dtypes:
                parse_dtype(d)
            self.worker.weights.map.check(dict(zip(names, (tuple(s) for s in shapes))))
        except CheckpointError as e:
            raise OpError(str(e)) from None
        if len(set(names)) != len(names):
            raise OpError("names repeat a tensor")
        self.run_op("group_update", names=list(names), dtypes=[str(d) for d in dtypes],
                    shapes=[list(s) for s in shapes], group_name=group_name)
        self._weights_changed(weight_version, flush_cache)
        return f"Succeeded to update {len(names)} parameter(s) online."

    def update_weights_from_tensor(self, entries: list, load_format: str | None = None,
                                   weight_version: str | None = None, flush_cache: bool = True) -> str:
        """SGLang's `serialized_named_tensors`: one entry per rank (rank r takes entry r, as SGLang's
        TP rank r does) or one for all; each rank keeps its shard of the full tensors."""
        self._need_weights("update_weights_from_tensor")
        world = self.topo.world
        if load_format not in LOAD_FORMATS:
            raise OpError(f"load_format={load_format!r} is not supported (one of {LOAD_FORMATS})")
        if len(entries) not in (1, world):
            raise OpError(f"serialized_named_tensors has {len(entries)} entries: give one for all ranks or "
                          f"one per rank ({world})")
        try:   # every rank reads and checks its entry before any rank writes
            self.run_op("tensor_stage", entries=list(entries), load_format=load_format)
        except OpFailed:
            self.run_op("tensor_drop")
            raise
        count = self.worker.weights.staged
        self.run_op("tensor_apply")
        self._weights_changed(weight_version, flush_cache)
        return f"Succeeded to update {count} parameter(s) from tensors."

    def destroy_weights_update_group(self, group_name: str) -> str:
        if group_name not in self.groups:
            raise OpError(f"no weights update group {group_name!r}")
        self.groups.pop(group_name)
        self.run_op("group_destroy", group_name=group_name)
        return f"Succeeded to destroy the weights update group {group_name!r}."

    def _weights_changed(self, weight_version: str | None, flush_cache: bool) -> None:
        self.set_weight_version(weight_version)
        if flush_cache:   # prefix blocks of the old weights; blocks a request holds stay with it
            for s in self.schedulers:
                s.drop_cached()
            if self.proposer_memory is not None:   # the proposers' kept entries came from the old weights
                self.proposer_memory.drop_kept()

    def _need_weights(self, what: str) -> None:
        if "weights" in self.released:
            raise OpError(f"{what}: the weights are released; /resume_memory_occupation with tag weights first")

    # ---- requests and memory -------------------------------------------------------------
    def retract_all(self) -> int:
        return sum(s.retract_all() for s in self.schedulers)

    def holds_kv(self) -> bool:
        return any(s.holds_kv() for s in self.schedulers)

    def release_memory(self, tags: list | None) -> None:
        tags = self._tags(tags)
        if self.holds_kv():
            raise OpError("release_memory_occupation needs an idle engine: requests still hold KV "
                          "(let them finish, or /pause_generation with mode abort or retract first)")
        if "kv_cache" in tags:   # the cache's content is gone: no prefix block may be reused
            for s in self.schedulers:
                s.drop_cached()
        self.run_op("release", tags=tags)
        if self.proposer_memory is not None:
            self.proposer_memory.release(set(tags))
        self.released |= set(tags)

    def resume_memory(self, tags: list | None) -> None:
        tags = self._tags(tags)
        self.run_op("resume", tags=tags)
        if self.proposer_memory is not None:
            self.proposer_memory.resume(set(tags))
        self.released -= set(tags)

    def memory(self) -> dict:
        """Bytes rank 0 holds: the target's shard, plus what speculation keeps beside it."""
        out = self.worker.weights.memory()
        if self.proposer_memory is not None:
            for k, v in self.proposer_memory.bytes().items():
                out[k] += v
        return out

    @staticmethod
    def _tags(tags) -> list:
        if not tags:
            return list(TAGS)
        bad = [t for t in tags if t not in TAGS]
        if bad:
            raise OpError(f"unknown memory tag(s) {bad}: use {', '.join(TAGS)}")
        return list(dict.fromkeys(tags))
