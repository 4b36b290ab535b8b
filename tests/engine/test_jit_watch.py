"""The Triton compile watch (runtime/jit_watch.py) and the warm-up's MoE regimes. The compiles
themselves happen only on CUDA: tests/engine/test_kernels.py and test_cuda_reference.py check that
none happens past the warm-up there."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdrollout.engine.model import fused_moe
from pdrollout.engine.model.backends import fused_regime_tokens, fused_tiles
from pdrollout.engine.runtime import jit_watch


def _regime(tokens: int, top_k: int, weight_bytes: int) -> tuple:
    pairs = tokens * top_k
    layout = "direct" if pairs <= fused_moe.DIRECT_MAX_PAIRS else \
        "fused" if pairs <= fused_moe.ALIGN_KERNEL_MAX_PAIRS else "spread"
    return tuple(sorted(fused_tiles(pairs, weight_bytes).items())), layout


@pytest.mark.parametrize("weight_bytes", [1, 2, 4])
@pytest.mark.parametrize("top_k", [1, 2, 6, 8])
def test_the_warm_up_sizes_meet_every_moe_regime_once(top_k, weight_bytes):
    """Each (tile tier, pair layout) of AutoExperts is its own compile; the warm-up's sizes must meet
    every regime a step of up to 64k tokens can, for FP8, bf16 and fp32 weights."""
    sizes = fused_regime_tokens(top_k)
    seen = {_regime(t, top_k, weight_bytes) for t in range(1, 65536)}
    assert sorted(map(str, {_regime(t, top_k, weight_bytes) for t in sizes})) == sorted(map(str, seen))
    if weight_bytes == 2:   # the tiers the other weights share are a subset: some sizes repeat one
        assert len({_regime(t, top_k, 2) for t in sizes}) == len(sizes)


def test_the_watch_counts_compiles_by_kernel_and_keeps_an_earlier_hook(monkeypatch):
    from triton import knobs   # a dependency: the kernels run under its interpreter on CPU
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw["fn"].name))
    monkeypatch.setattr(jit_watch, "_WATCH", None)
    watch = jit_watch.install()
    assert watch is not None and jit_watch.install() is watch and jit_watch.compile_watch(True) is watch
    hook = knobs.runtime.jit_post_compile_hook
    for name in ("_kernels.<locals>.gate_up", "_kernels.<locals>.down", "_kernels.<locals>.gate_up"):
        hook(fn=SimpleNamespace(name=name), key="k", repr="r", compile={}, is_manual_warmup=False,
             already_compiled=False)
    assert watch.take() == ("gate_up", "down", "gate_up") and watch.take() == ()
    assert watch.total == 3 and len(seen) == 3   # the earlier hook still ran each time
    # off CUDA nothing is installed: the watch there sees nothing
    monkeypatch.setattr(jit_watch, "_WATCH", None)
    inert = jit_watch.compile_watch(False)
    assert inert is not watch and inert.take() == () and jit_watch._WATCH is None


def test_the_prefill_warm_up_runs_each_regime_a_fused_step_can_reach(tiny_model):
    """Past the budget too: a fused step carries the budget's P plus up to max_running D rows."""
    from pdrollout.engine.protocol.config import ControlSettings, EngineConfig
    from pdrollout.engine.runtime.engine import Engine
    engine = Engine(EngineConfig(model=str(tiny_model), mode="mixed", block_size=4, num_blocks=1024,
                                 prefill_warmup=True, max_running=64, mixed_chunk_tokens=16,
                                 control=ControlSettings(prefill_budget_tokens=1000)))
    steps, exchange = [], engine._exchange
    engine._exchange = lambda plan: (steps.append(sum(r.length for r in plan.replicas[0].prefill)), exchange(plan))[1]
    assert engine.warm_prefill() == 9
    # the tiny model routes top-2: 9 tokens are the first pairs laid out (up to 8 each pair is its
    # own block); 513 the first laid out by three launches; 1,024 are 2,048 pairs (the 32-row
    # tiles), past the budget of 1,000 but within it plus 64 D rows; 2,048 and 4,096 (64- and
    # 128-row tiles) are not; last the continuation
    assert fused_regime_tokens(2) == (1, 9, 513, 1024, 2048, 4096)
    assert steps == [1, 9, 37, 256, 513, 999, 1000, 1024, 128]
    assert engine.stats()["kv_blocks_used"] == 0
