"""The Triton compile watch (runtime/jit_watch.py) and the warm-up's MoE regimes. The compiles
themselves happen only on CUDA: tests/engine/test_kernels.py and test_cuda_reference.py check that
none happens past the warm-up there."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdrollout.engine.model import fused_moe
from pdrollout.engine.model.backends import fused_regime_tokens, fused_tiles
from pdrollout.engine.runtime import jit_watch


def _regime(tokens: int, top_k: int) -> tuple:
    pairs = tokens * top_k
    layout = "fused" if pairs <= fused_moe.ALIGN_KERNEL_MAX_PAIRS else "spread"
    return tuple(sorted(fused_tiles(pairs).items())), layout


@pytest.mark.parametrize("top_k", [1, 2, 6, 8])
def test_the_warm_up_sizes_meet_every_moe_regime_once(top_k):
    """Each (tile tier, pair layout) of AutoExperts is its own compile; the warm-up's sizes must meet
    every regime a step of up to 64k tokens can, each once."""
    sizes = fused_regime_tokens(top_k)
    seen = {_regime(t, top_k) for t in range(1, 65536)}
    assert sorted(map(str, (_regime(t, top_k) for t in sizes))) == sorted(map(str, seen))
    assert len({_regime(t, top_k) for t in sizes}) == len(sizes)


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
