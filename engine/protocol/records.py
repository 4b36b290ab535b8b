"""Typed per-step records: what the engine tells the server's metrics (and the bench) about each
step it ran. One record per step that ran work, on every world size."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PEpoch:
    """A P epoch that ran beside D (pd on one rank with solo_overlap), timed on its thread. Where
    its time went: issuing the forward (the thread's CPU time, the rest waiting for the GIL or a
    host sync), then the GPU finishing kernels already issued (wall - enqueue)."""
    tokens: int
    wall_s: float      # planned -> its logits complete
    enqueue_s: float   # its thread's forward, first kernel issued to the last (host syncs included)
    cpu_s: float       # the thread's CPU time in that forward


@dataclass(frozen=True)
class StepRecord:
    step: int
    t: float                          # monotonic start of the step
    duration_s: float
    mode: str                         # the policy: normal | mixed | pd
    decode_rows: int
    prefill_tokens: int
    decode_wait_s: tuple[float, ...] = ()      # per decode row: ready -> its step started (planner wait)
    multiplexing_active: bool = False          # P and D both ran under the pd policy (and the turnstile, on many ranks)
    span: int = 1
    rendezvous_s: tuple[float, ...] = ()       # every turnstile rendezvous of the step (rank 0)
    turnstile_rounds: int = 0                  # rounds that ran a rendezvous
    turnstile_wait_s: tuple[float, ...] = ()   # per round with D: round called -> D enqueued
    ordering: str = ""
    graph: bool = False                        # D ran as a CUDA graph replay
    spec_verify: int = 0                       # speculation: decode rows of this D iteration
    spec_proposed: int = 0                     # draft tokens they carried
    spec_accepted: int = 0                     # draft tokens the target accepted
    p_epoch: PEpoch | None = None              # the P epoch that finished in this step (one rank)
    p_beside: bool = False                     # a P epoch started earlier was in flight beside this step
    jit_compiles: int = 0                      # Triton compiles on any rank in the step: each stalls it (runtime/jit_watch.py)
