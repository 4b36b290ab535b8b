"""The KV cache sized for its GPU (SGLang's `mem_fraction_static` idea, measured rather than guessed).

On one CUDA rank with neither `kv_cache_bytes` nor `num_blocks` given, the worker starts on a probe
cache just large enough for the largest step, captures its graphs, and runs that step once eagerly:
the prefill budget (or `mixed`'s chunk, the larger) in prompt-sized rows beside `max_running` decode
rows, every row sampling. What the device then reports free, plus the probe cache's own bytes, is
the memory left after the weights, the graphs and the activations; the cache takes
`kv_mem_fraction` of it. The probe cache and the graphs that read it are dropped and the real cache
allocated in place of the probe's (the same KVCache object: every holder keeps its reference), then
the graphs are captured again: sizing costs one extra capture at start.

Measured, not bounded: activations of this engine's step (fused MoE buffers, the logits, the
piecewise graphs' pools, cuBLAS/Triton workspaces) depend on kernels picked per shape, and a bound
computed from the budget and `max_running` is either loose (GiB of cache lost) or wrong. What the
probe does not run (sampling, NCCL buffers, a later raise of the live `prefill_budget_tokens`
above the start's) comes out of the `1 - kv_mem_fraction` margin.

Several ranks keep `DEFAULT_KV_CACHE_BYTES`: every rank must hold the same block count, and ranks
measure different free memory (an agreement across the group is not built yet); give them
`kv_cache_bytes`. CPU keeps the default too.
"""
from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..protocol.config import DEFAULT_KV_CACHE_BYTES, ConfigError, EngineConfig
from ..protocol.plan import Phase, RowSpec
from .kv_budget import kv_blocks, target_block_bytes

PROBE_ROW = 2048   # a probe row's tokens at most: prompts are split into rows like this (engine.WARM_ROW)
GiB = 1 << 30


def fraction_sized(config: EngineConfig, device_type: str, multi: bool) -> bool:
    """Whether this worker sizes its cache from measured free memory."""
    return device_type == "cuda" and not multi and config.kv_cache_bytes is None and config.num_blocks is None


def probe_tokens(config: EngineConfig) -> int:
    """New tokens of the largest step the engine plans: the prefill budget (or the chunk) fused with
    one token of every running row."""
    return max(config.control.prefill_budget_tokens, config.mixed_chunk_tokens) + config.max_running


def probe_rows(config: EngineConfig) -> list[RowSpec]:
    """The largest step's rows over blocks 0.. of the probe cache: `max_running` decode rows of one
    block each, then the prefill in rows of at most PROBE_ROW tokens; every row samples."""
    bs = config.block_size
    rows = [RowSpec(f"probe-d{i}", Phase.DECODE, 0, (0,), (i,), samples=True) for i in range(config.max_running)]
    block, left = config.max_running, probe_tokens(config) - config.max_running
    while left > 0:
        n = min(left, PROBE_ROW)
        need = -(-n // bs)
        rows.append(RowSpec(f"probe-p{len(rows)}", Phase.PREFILL, 0, (0,) * n, tuple(range(block, block + need)),
                            samples=True))
        block, left = block + need, left - n
    return rows


def probe_blocks(config: EngineConfig) -> int:
    return sum(len(r.blocks) for r in probe_rows(config))


def pending_bytes(config: EngineConfig) -> int:
    """Weights that load after the worker (a draft model, in the engine): their checkpoint's size."""
    if config.speculative != "draft":
        return 0
    return sum(p.stat().st_size for p in Path(config.draft_model).glob("*.safetensors"))


def fit_blocks(config: EngineConfig, cfg, topo, dtype: torch.dtype, free_bytes: int) -> int:
    """The blocks `kv_mem_fraction` of `free_bytes` holds (a proposer's caches included); a clear
    error when not one block fits."""
    budget = int(config.kv_mem_fraction * free_bytes)
    per = target_block_bytes(config, cfg, topo, dtype)
    if budget < per:
        raise ConfigError(f"kv_mem_fraction {config.kv_mem_fraction} of the {free_bytes / GiB:.2f} GiB free after "
                          f"weights, graphs and the largest step ({probe_tokens(config)} tokens) is "
                          f"{budget} bytes, less than one KV block ({per} bytes): lower "
                          f"control.prefill_budget_tokens or max_running, or use a larger device")
    return kv_blocks(config, cfg, topo, dtype, budget)


@dataclass(frozen=True)
class KVSizing:
    """How the cache got its size, for the start's log line and /server_info."""

    blocks: int
    block_size: int
    kv_bytes: int
    fraction: float | None = None     # None: kv_cache_bytes, num_blocks or the default decided
    free_bytes: int | None = None     # measured free memory the fraction applied to
    probe_tokens: int | None = None

    def line(self) -> str:
        head = (f"KV cache: {self.blocks} blocks of {self.block_size} tokens ({self.blocks * self.block_size} "
                f"tokens), {self.kv_bytes / GiB:.2f} GiB")
        if self.fraction is None:
            return head + f" [kv_cache_bytes={self.kv_bytes}]"
        return (head + f" = kv_mem_fraction {self.fraction} of {self.free_bytes / GiB:.2f} GiB free after weights, "
                f"graphs and the largest step ({self.probe_tokens} tokens) "
                f"[kv_cache_bytes={self.kv_bytes} free_bytes={self.free_bytes}]")

    def facts(self) -> dict:
        return {"kv_cache_bytes": self.kv_bytes, "kv_mem_fraction": self.fraction, "kv_free_bytes": self.free_bytes}


def given(worker) -> KVSizing:
    return KVSizing(worker.num_blocks, worker.config.block_size, worker.kv.nbytes())


def run_probe(worker) -> None:
    """The largest step, once, eagerly, into the probe cache (its K/V are thrown away with it)."""
    batch = worker.batches.build(probe_rows(worker.config), Phase.MIXED)
    with torch.no_grad():
        worker.model(batch, worker.kv)
    if worker.cuda:
        torch.cuda.synchronize(worker.device)


def resize(worker, blocks: int) -> None:
    """The cache at `blocks` in place of the probe's: the graphs that read the old one dropped first,
    the memory both held handed back, then the graphs captured again over the new one."""
    graphs = worker.graphs is not None or worker.p_graphs is not None
    worker.graphs = None
    if worker.p_graphs is not None:
        worker.p_graphs.drop()
    worker.kv.release()
    if worker.cuda:   # the old graphs' pools and cache back to the device before the new cache
        gc.collect()
        torch.cuda.empty_cache()
    worker.kv.resize(blocks)
    worker.num_blocks = blocks
    if graphs:
        worker.recapture()


def device_free(worker) -> int:
    """Bytes the device has free now (the allocator's cache counts as used: it holds the probe's activations)."""
    return torch.cuda.mem_get_info(worker.device)[0]


def size_from_free(worker, measure=device_free) -> KVSizing:
    """Probe, measure, resize (the module's docstring); `measure`: the device's free bytes."""
    config = worker.config
    run_probe(worker)
    # the probe's cache is given back (resize): it counts as free
    free = measure(worker) + worker.kv.nbytes() - pending_bytes(config)
    blocks = fit_blocks(config, worker.cfg, worker.topo, worker.dtype, free)
    resize(worker, blocks)
    return KVSizing(blocks, config.block_size, worker.kv.nbytes(), config.kv_mem_fraction, free,
                    probe_tokens(config))


def start_blocks(config: EngineConfig, cfg, topo, dtype: torch.dtype, device_type: str,
                 multi: bool) -> tuple[int, bool]:
    """The cache a worker starts on, and whether it is the probe's (sized from free memory later)."""
    if fraction_sized(config, device_type, multi):
        return probe_blocks(config), True
    return kv_blocks(config, cfg, topo, dtype), False


def settle(worker, sized: bool) -> KVSizing:
    """Once the graphs are captured: the probe measured and the cache resized (`sized`), or the
    given size; either way the start's log line."""
    sizing = size_from_free(worker) if sized else given(worker)
    config = worker.config
    note = "" if sized or not worker.cuda or config.kv_cache_bytes or config.num_blocks else \
        f" (the default {DEFAULT_KV_CACHE_BYTES >> 20} MiB: several ranks size from kv_cache_bytes only)"
    print(f"[rank {worker.rank}] {sizing.line()}{note}", file=sys.stderr, flush=True)
    return sizing
