"""Per-rank GPU timeline of the multi-rank engine on CUDA (`--gpu-timeline DIR`).

Two records per rank, enough to check the turnstile on real streams (issue 8):
* the host enqueue order of every collective (a `Trace`: key, phase, group, lane, registered),
  which `trace.check_order` compares across ranks;
* stream intervals: a CUDA event pair around every collective and every forward, on the stream
  that ran it, and P's compute between two of its collectives ("compute", on the P stream), so
  overlaps between P and D work are measured on the device, not inferred.
An interval's start is when its stream reached the op (the kernel may start later if the SMs are
busy); its end is when the op's last kernel finished. Nothing here synchronizes until `dump`.
"""
from __future__ import annotations

import contextlib
import json
import threading

import torch

from .collective_trace import Trace

# The registered pair (docs/DISTRIBUTED.md): P's model-wide AllReduce and D's DP-attention gather/scatter.
REGISTERED = {"P": ("attn-allreduce", "moe-allreduce"), "D": ("dp-allgather", "dp-reducescatter")}


def is_registered(phase: str, name: str) -> bool:
    return name in REGISTERED.get(phase, ())


class GpuTimeline:
    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self.trace = Trace(rank)
        self._spans: list[tuple[str, dict, torch.cuda.Event, torch.cuda.Event]] = []
        self._lock = threading.Lock()
        self._base = torch.cuda.Event(enable_timing=True)
        self._base.record(torch.cuda.current_stream(device))
        self.rendezvous_s: list[float] = []

    @contextlib.contextmanager
    def span(self, name: str, stream: torch.cuda.Stream, **meta):
        start = self.mark(stream)
        try:
            yield
        finally:
            self.add(name, start, self.mark(stream), **meta, stream=int(stream.stream_id))

    def mark(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def add(self, name: str, start: torch.cuda.Event, end: torch.cuda.Event, **meta) -> None:
        with self._lock:
            self._spans.append((name, meta, start, end))

    def dump(self, path: str) -> None:
        torch.cuda.synchronize(self.device)
        with self._lock:
            spans = [{"name": n, **m, "t0_ms": self._base.elapsed_time(s), "t1_ms": self._base.elapsed_time(e)}
                     for n, m, s, e in self._spans]
        with open(path, "w") as f:
            json.dump({"rank": self.rank, "spans": spans, "enqueues": self.trace.records,
                       "rendezvous_s": self.rendezvous_s}, f)


def overlap_ms(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time covered by both interval sets (each set's own overlaps merged first)."""
    def merge(xs):
        out: list[list[float]] = []
        for s, e in sorted(xs):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out
    ma, mb, i, j, tot = merge(a), merge(b), 0, 0, 0.0
    while i < len(ma) and j < len(mb):
        lo, hi = max(ma[i][0], mb[j][0]), min(ma[i][1], mb[j][1])
        tot += max(0.0, hi - lo)
        if ma[i][1] < mb[j][1]:
            i += 1
        else:
            j += 1
    return tot


def summarize(timelines: dict[int, dict]) -> dict:
    """Per rank: the registered pair's overlap, P work overlapping D, counts; and the cross-rank
    order check of the registered collectives' host enqueues."""
    from .collective_trace import check_order
    out: dict = {"ranks": {}}
    for r, tl in sorted(timelines.items()):
        sp = tl["spans"]
        iv = lambda pred: [(s["t0_ms"], s["t1_ms"]) for s in sp if pred(s)]
        reg_p = iv(lambda s: s.get("phase") == "P" and s.get("registered"))
        reg_d = iv(lambda s: s.get("phase") == "D" and s.get("registered"))
        p_other = iv(lambda s: s.get("phase") == "P" and not s.get("registered")
                     and s["name"] not in ("forward", "compute"))
        d_coll = iv(lambda s: s.get("phase") == "D" and s["name"] not in ("forward", "compute"))
        p_compute = iv(lambda s: s.get("phase") == "P" and s["name"] == "compute")
        d_fwd = iv(lambda s: s.get("phase") == "D" and s["name"] == "forward")
        p_fwd = iv(lambda s: s.get("phase") == "P" and s["name"] == "forward")
        out["ranks"][r] = {
            "registered_p": len(reg_p), "registered_d": len(reg_d),
            "registered_pair_overlap_ms": round(overlap_ms(reg_p, reg_d), 3),
            # with one replica D has no registered collective; its ATP collectives meet P's on the same ranks
            "registered_p_overlapping_d_collectives_ms": round(overlap_ms(reg_p, d_coll), 3),
            "p_collectives_overlapping_d_forward_ms": round(overlap_ms(p_other, d_fwd), 3),
            "p_compute_overlapping_d_forward_ms": round(overlap_ms(p_compute, d_fwd), 3),
            "p_compute_ms": round(sum(e - s for s, e in p_compute), 3),
            "p_forward_overlapping_d_forward_ms": round(overlap_ms(p_fwd, d_fwd), 3),
            "d_forward_ms": round(sum(e - s for s, e in d_fwd), 3),
            "rendezvous": len(tl.get("rendezvous_s", [])),
            "rendezvous_mean_ms": round(1e3 * sum(tl["rendezvous_s"]) / len(tl["rendezvous_s"]), 3)
            if tl.get("rendezvous_s") else None,
        }
    out["order_violations"] = check_order({r: tl["enqueues"] for r, tl in timelines.items()})
    return out
