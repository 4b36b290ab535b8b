"""Knobs removed after their measurement showed no gain (issue 53). An old config or environment
that still sets one is refused, naming it and what runs instead, rather than silently ignored: the
run it was meant to reproduce would not be the run it gets (docs/ENGINE_API.md, "Removed knobs")."""
from __future__ import annotations

import os

# EngineConfig field -> what runs now (the measurement: docs/perf/HISTORY.md or docs/PERF.md)
REMOVED_FIELDS = {
    "dense_kernel": "q/k/v, o_proj and the router always run cuBLAS (F.linear); the skinny Triton "
                    "launch was timed no faster at 1-16 rows",
    "p_sms": "a P epoch beside D runs on every SM; a green context for P was timed no faster at P1",
    "switch_interval_ms": "the process keeps Python's GIL switch interval; a shorter one changed "
                          "neither D's steps beside P nor pd's makespan",
}
# EngineConfig field -> {removed value: what runs now}
REMOVED_VALUES = {
    "priority_stream": {"p": "use 'd' (the default on one rank) or 'none'; P's stream first did not "
                             "shorten P epochs, bound by their thread issuing kernels"},
}
REMOVED_ENV = {
    "PDROLLOUT_FP8_SCALED_MM": "FP8 linears always dequantize then run a bf16 GEMM; the per-block "
                               "torch._scaled_mm path was correct but far slower",
}


def refuse_removed(data):
    """Raise ValueError naming the first removed field or value in an EngineConfig's input."""
    if not isinstance(data, dict):
        return data
    for name, instead in REMOVED_FIELDS.items():
        if name in data:
            raise ValueError(f"{name} was removed (issue 53): {instead}; drop it from the config")
    for name, values in REMOVED_VALUES.items():
        v = data.get(name)
        if isinstance(v, str) and v in values:
            raise ValueError(f"{name}={v!r} was removed (issue 53): {values[v]}")
    return data


def refuse_removed_env(environ=os.environ) -> None:
    """Raise ValueError naming a removed environment knob that is still set."""
    for name, instead in REMOVED_ENV.items():
        if name in environ:
            raise ValueError(f"environment variable {name} was removed (issue 53): {instead}; unset it")
