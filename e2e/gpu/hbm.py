"""The device's copy rate: the ceiling every HBM floor in e2e/gpu is taken against; and how the
scripts time a captured graph's replays."""
from __future__ import annotations

import torch


def replays_ms(graph, reps: int) -> float:
    """Mean ms of `reps` back-to-back replays of a captured CUDA graph (CUDA events), after one
    replay that is not timed."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def copy_bw(dev="cuda") -> float:
    """Device-to-device copy rate, bytes read + written per second, from eager copies of 2 GiB timed
    by CUDA events. Not a captured graph: a copy captured into a CUDA graph (a memcpy node) measured
    2.71 TB/s on the H200 where eager copies measured 4.21 TB/s in the same call (docs/perf/HISTORY.md,
    twentieth session), so floors taken against it were 1.56x too long."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    start.record()
    for _ in range(reps):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    bw = 2 * x.numel() * reps / (start.elapsed_time(end) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return bw


def captured_copy_bw(dev="cuda") -> float:
    """The same rate from a 1-GiB copy captured into a CUDA graph and replayed (how the kernel scripts
    measured it before): kept to show the difference, not for floors."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    y.copy_(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.copy_(x)
    return 2 * x.numel() / (replays_ms(graph, 20) / 1e3)


def main() -> int:
    """Both rates, three times each, as JSON."""
    import json
    print(json.dumps({"gpu": torch.cuda.get_device_name(),
                      "eager_tbs": [round(copy_bw() / 1e12, 3) for _ in range(3)],
                      "captured_tbs": [round(captured_copy_bw() / 1e12, 3) for _ in range(3)]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
