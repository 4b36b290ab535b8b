"""Triton compiles in this process, by kernel: the step that pays for one waits on it.

Triton compiles a kernel once per specialization: its constexprs, and by default whether each int
argument is 1 or a multiple of 16 and each pointer 16-byte aligned. A compile of a large-tile MoE
kernel takes a large fraction of a second, so a step that meets a new specialization mid-run stalls
(a burst step several times slower than in a process that had compiled its kernels: docs/PERF.md).
The kernels leave their per-step sizes unspecialized and the warm-up runs each tile regime once, so
past warm-up none should happen; this counts what still does, for the step log (`jit_compiles`)
and /metrics (`pdrollout:jit_compiles_total`).

A kernel found in Triton's on-disk cache still counts: loading it is a compile in this process.
"""
from __future__ import annotations

import threading


class CompileWatch:
    """Kernel names compiled since the last `take()` (any thread: P epochs issue on their own)."""

    def __init__(self) -> None:
        self.total = 0
        self._since: list[str] = []
        self._lock = threading.Lock()
        self._chained = None   # a hook someone installed before us still runs

    def hook(self, *, fn=None, **kw):
        name = getattr(fn, "name", None) or "?"
        with self._lock:
            self.total += 1
            self._since.append(name.rsplit(".", 1)[-1])
        if self._chained is not None:
            return self._chained(fn=fn, **kw)
        return None

    def take(self) -> tuple[str, ...]:
        with self._lock:
            out, self._since = tuple(self._since), []
        return out


_WATCH: CompileWatch | None = None


def compile_watch(cuda: bool) -> CompileWatch:
    """The process's watch on CUDA; elsewhere (or on a Triton without the hook) one that sees nothing."""
    return (install() if cuda else None) or CompileWatch()


def install() -> CompileWatch | None:
    """The process's watch (one: Triton's hook is global); None where Triton has no post-compile
    hook (an older Triton, or none installed)."""
    global _WATCH
    if _WATCH is not None:
        return _WATCH
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return None
    watch = CompileWatch()
    watch._chained = runtime.jit_post_compile_hook
    runtime.jit_post_compile_hook = watch.hook
    _WATCH = watch
    return watch
