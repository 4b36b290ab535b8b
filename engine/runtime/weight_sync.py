"""One rank's side of the rank-shared engine ops (protocol/plan.EngineOp): new weights from disk,
a weights update group with a trainer (torch.distributed: gloo on CPU, NCCL on GPUs) and the
tensors it broadcasts, tensors handed over in a request (tensor_payload.py), and giving memory
back and taking it again. Rank 0 checks every argument before the op is broadcast, so what
reaches a rank is runnable (a request's tensors: every rank checks its own before any rank
writes); each rank keeps its own ATP/EP shard of what arrives (model/weights.py).

The update group is a process group of its own, formed the way SGLang's engine forms it (its
`init_custom_process_group`, which slime's and AReaL's trainers copy): torch's rendezvous at the
trainer's `tcp://` address (the trainer is rank 0 and hosts the store; this engine's rank r is
`rank_offset + r`), the store wrapped in `PrefixStore(group_name)`, then torch's group helper,
which prefixes the name and the backend's device once more. Only that full key layout meets a
trainer's; the engine's default group is never touched (the helper is called as for a default
group: no ranks of the world, no split from it). The backend is a parameter: gloo on CPU, NCCL on GPUs.
"""
from __future__ import annotations

import datetime
import gc

import torch
import torch.distributed as dist

from ..model.weights import WeightMap, parse_dtype
from ..protocol.plan import EngineOp
from .shard import shard_of
from .tensor_payload import load_entry

TAGS = ("weights", "kv_cache", "cuda_graph")
GROUP_TIMEOUT = datetime.timedelta(seconds=120)


class UpdateGroup:
    def __init__(self, args: dict, rank: int, device: torch.device) -> None:
        from torch.distributed.distributed_c10d import _new_process_group_helper, _world
        self.backend = args["backend"]
        self.rank = args["rank_offset"] + rank
        self.device = device if self.backend == "nccl" else torch.device("cpu")
        size, name = args["world_size"], args["group_name"]
        host = args["master_address"]
        url = f"tcp://{'[' + host + ']' if ':' in host and not host.startswith('[') else host}:{args['master_port']}"
        store, _, _ = next(dist.rendezvous(url, self.rank, size, timeout=GROUP_TIMEOUT))
        store.set_timeout(GROUP_TIMEOUT)
        self.pg, _ = _new_process_group_helper(size, self.rank, [], dist.Backend(self.backend),
                                               dist.PrefixStore(name, store), group_name=name,
                                               timeout=GROUP_TIMEOUT, group_desc=name)
        _world.pg_group_ranks[self.pg] = {i: i for i in range(size)}   # group rank = its own rank
        self.store = store

    def receive(self, shape, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        dist.broadcast(t, 0, group=self.pg)
        return t

    def close(self) -> None:
        dist.destroy_process_group(self.pg)
        self.pg = self.store = None


class RankWeights:
    """The ops on one rank; `run` never raises (the error text goes back in the step report)."""

    def __init__(self, worker) -> None:
        self.w = worker
        self.map = WeightMap(worker.model, worker.cfg, shard_of(worker.topo, worker.rank))
        self.copies: list[WeightMap] = []   # rank 0's unsharded MTP head on several ranks (add_copy)
        self.groups: dict[str, UpdateGroup] = {}
        self.released: set[str] = set()
        self._backup: dict[str, torch.Tensor] = {}
        self._arena: torch.Tensor | None = None   # CUDA: pinned host copy of released weights
        self._had_graphs = False
        self._staged: list | None = None   # /update_weights_from_tensor: read and checked, not yet written

    def run(self, op: EngineOp) -> str | None:
        try:
            getattr(self, "_" + op.kind)(**op.args)
            return None
        except Exception as e:   # reported by rank 0 to the HTTP client
            return f"rank {self.w.rank}: {type(e).__name__}: {e}"

    def add_copy(self, model) -> None:
        """A model beside the worker's that holds some of the same tensors unsharded: new weights
        reach it too (the MTP head; rank 0's engine releases its memory: draft.ProposerMemory)."""
        from ..model.qwen3_moe import Shard
        self.copies.append(WeightMap(model, self.w.cfg, Shard()))

    # ---- weights ------------------------------------------------------------------------
    def _load_disk(self, path: str) -> None:
        for m in [self.map, *self.copies]:
            m.load_dir(path)
        self._synchronize()

    def _group_init(self, **args) -> None:
        name = args["group_name"]
        if name in self.groups:
            raise ValueError(f"weights update group {name!r} already exists")
        self.groups[name] = UpdateGroup(args, self.w.rank, self.w.device)

    def _group_update(self, names, dtypes, shapes, group_name) -> None:
        g = self.groups[group_name]
        params = self.map.params()
        copies = [(m, m.params()) for m in self.copies]
        # every rank receives every tensor (a broadcast needs every member) and keeps its shard
        for name, dtype, shape in zip(names, dtypes, shapes):
            t = g.receive(shape, parse_dtype(dtype))
            self.map.write(name, t, params)
            for m, ps in copies:
                m.write(name, t, ps)
        self._synchronize()

    def _tensor_stage(self, entries, load_format) -> None:
        """Read this rank's entry (its own, or the one for all) and check every name, shape and
        dtype; nothing is written until every rank staged (`_tensor_apply`)."""
        i = self.w.rank if len(entries) > 1 else 0
        named = load_entry(entries[i], load_format, self.w.rank, f"serialized_named_tensors[{i}]")
        self.map.check({n: tuple(t.shape) for n, t in named})
        for n, t in named:
            parse_dtype(str(t.dtype))
        if len({n for n, _ in named}) != len(named):
            raise ValueError(f"serialized_named_tensors[{i}] names a tensor twice")
        self._staged = named

    @property
    def staged(self) -> int:
        """How many tensors `_tensor_stage` holds for the next apply."""
        return len(self._staged or ())

    def _tensor_apply(self) -> None:
        named, self._staged = self._staged, None
        params = self.map.params()
        copies = [(m, m.params()) for m in self.copies]
        for name, t in named:
            self.map.write(name, t, params)
            for m, ps in copies:
                m.write(name, t, ps)
        self._synchronize()   # the trainer may free or reuse its tensors once the answer is back

    def _tensor_drop(self) -> None:
        self._staged = None

    def _group_destroy(self, group_name, missing_ok: bool = False) -> None:
        g = self.groups.pop(group_name, None)
        if g is None and not missing_ok:
            raise ValueError(f"no weights update group {group_name!r} on this rank")
        if g is not None:
            g.close()

    # ---- memory ---------------------------------------------------------------------------
    def _release(self, tags) -> None:
        w = self.w
        if w.graphs is not None or w.p_graphs is not None:   # graphs hold the weights' and the KV cache's addresses
            self._had_graphs = True
            w.graphs = None
            if w.p_graphs is not None:
                w.p_graphs.drop()
        if "weights" in tags and "weights" not in self.released:
            # the copy outlives the release so outputs after resume equal those before
            params = list(w.model.named_parameters())
            self._backup = self._host_copy(params) if w.cuda else {n: p.data for n, p in params}
            for _, p in params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            for m in w.model.modules():   # copies derived from the weights (fp8.Fp8Linear's)
                if hasattr(m, "drop_derived"):
                    m.drop_derived()
        if "kv_cache" in tags and "kv_cache" not in self.released:
            w.kv.release()
        self.released |= set(tags)
        gc.collect()
        if w.cuda:
            torch.cuda.synchronize(w.device)
            torch.cuda.empty_cache()

    def _host_copy(self, params) -> dict[str, torch.Tensor]:
        """The weights into one pinned host arena, allocated at the first release and kept: an RL
        loop releases every step, and pinning tens of GiB per tensor (what `.pin_memory()` per
        parameter did) took minutes for the 30B-A3B shape (docs/PERF.md); one arena and
        asynchronous copies run at the link's rate."""
        align = 64
        sizes = [-(-p.data.numel() * p.data.element_size() // align) * align for _, p in params]
        if self._arena is None or self._arena.numel() < sum(sizes):
            self._arena = None
            self._arena = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
        out, off = {}, 0
        for (name, p), n in zip(params, sizes):
            nbytes = p.data.numel() * p.data.element_size()
            dst = self._arena[off:off + nbytes].view(p.dtype).view(p.data.shape)
            dst.copy_(p.data, non_blocking=True)
            out[name], off = dst, off + n
        torch.cuda.synchronize(self.w.device)
        return out

    def _resume(self, tags) -> None:
        w = self.w
        if "weights" in tags and "weights" in self.released:
            for name, p in w.model.named_parameters():
                p.data = self._backup.pop(name).to(w.device, non_blocking=True)
            w.model.fuse_projections()   # each parameter has storage of its own again
            if w.cuda:   # the arena is written again by the next release
                torch.cuda.synchronize(w.device)
        if "kv_cache" in tags and "kv_cache" in self.released:
            w.kv.resume()
        self.released -= set(tags)
        if self._had_graphs and not self.released:
            w.recapture()   # on several ranks every rank does it in this same op
            self._had_graphs = False

    def memory(self) -> dict:
        """Bytes this rank's weights and KV cache hold on its device now."""
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)
        return {"weights": size(p.data for p in self.w.model.parameters()),
                "kv_cache": self.w.kv.nbytes()}

    def _synchronize(self) -> None:
        if self.w.cuda:
            torch.cuda.synchronize(self.w.device)
