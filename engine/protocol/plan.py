"""The rank-shared step plan: what rank 0's planner hands every rank (one rank included) to execute.

Plain data; between ranks it travels in a fixed binary layout (runtime/plan_wire.py). Rank 0 owns intake, the per-replica schedulers and the KV block pools, so a
row carries its block table: workers keep no scheduling state and cannot diverge. A request is
pinned to one attention replica for its life (its KV and prefix blocks live there).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Phase(str, Enum):
    """Which work a row, a forward or a collective belongs to: the one spelling of P and D from the
    planner down to the expert communication. A MIXED forward (decode rows and prefill segments
    together, one rank or the normal/mixed policies) runs on the P path."""
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"

    @property
    def path(self) -> str:
        """The collective path and stream lane: "d" for decode, "p" otherwise."""
        return "d" if self is Phase.DECODE else "p"


@dataclass(frozen=True)
class RowSpec:
    rid: str
    kind: Phase             # DECODE | PREFILL
    start: int              # position of the first new token
    tokens: tuple           # the new tokens (one for a decode row)
    blocks: tuple           # the request's block table (cache block ids on its replica)
    samples: bool           # produces a token (a decode row, or a prefill segment that completes)
    logprob: bool = False
    routes: bool = False    # report each input token's top-k expert ids per layer (routing replay)
    draft: int = 0          # a verify row: the last `draft` tokens are proposals the target checks

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def logit_rows(self) -> int:
        """Positions whose logits this row needs: every position of a verify row, else the last."""
        return self.draft + 1 if self.draft else 1


@dataclass(frozen=True)
class ReplicaWork:
    decode: tuple[RowSpec, ...] = ()
    prefill: tuple[RowSpec, ...] = ()

    @property
    def decode_rows(self) -> int:
        return len(self.decode)

    @property
    def prefill_rows(self) -> int:
        return len(self.prefill)

    @property
    def decode_tokens(self) -> int:
        return sum(r.length for r in self.decode)

    @property
    def prefill_tokens(self) -> int:
        return sum(r.length for r in self.prefill)

    @property
    def spec(self) -> bool:
        """A decode row verifies drafts."""
        return any(r.draft for r in self.decode)

    @property
    def routes(self) -> bool:
        """A row wants its routing reported."""
        return any(r.routes for r in self.decode + self.prefill)


@dataclass(frozen=True)
class ReplicaShape:
    """Another replica's rank-shared facts, all a rank needs of it (runtime/plan_wire.py): its row and
    token counts size the collectives both take part in; no rows."""
    decode_rows: int = 0
    prefill_rows: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    spec: bool = False
    routes: bool = False


@dataclass(frozen=True)
class NewRequest:
    rid: str
    replica: int
    sampling: object        # SamplingParams (its generator is made on the replica's ranks)


@dataclass(frozen=True)
class EngineOp:
    """A rank-shared change of the engine's state (weights, memory, a weights update group), run by
    every rank at the same plan boundary: it travels in the StepPlan, never beside it."""
    kind: str               # load_disk | group_init | group_update | group_destroy | release | resume
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StepPlan:
    step: int
    control: dict                               # ControlSettings.model_dump() in force this step
    replicas: tuple[ReplicaWork, ...] = ()     # on a rank other than 0: its own, ReplicaShape for the others
    new: tuple[NewRequest, ...] = ()
    drop: tuple[str, ...] = ()                  # finished or aborted: forget the generator
    multiplexing: bool = False                  # the pd policy put P and D in this step
    stop: bool = False                          # shut the workers down
    ops: tuple[EngineOp, ...] = ()              # run before the rows (an op plan carries no rows)
    # pd on several ranks, fine-grained: this step's P epoch may go on under the next steps' D
    # (p_span); a step planned while one is in flight carries its epoch (p_flight) and no P rows
    p_span: bool = False
    p_flight: int | None = None
    p_collect: bool = False                     # every rank reported its P of p_flight done: hand it back

    @property
    def d_any(self) -> bool:
        return any(w.decode_rows for w in self.replicas)

    @property
    def p_any(self) -> bool:
        return any(w.prefill_rows for w in self.replicas)

    @property
    def prefill_tokens(self) -> int:
        """P tokens over every replica (the step's P size)."""
        return sum(w.prefill_tokens for w in self.replicas)

    @property
    def decode_rows(self) -> int:
        return sum(w.decode_rows for w in self.replicas)

    @property
    def spec_any(self) -> bool:
        """A decode row verifies drafts: D runs eagerly this step (a graph is one token per row)."""
        return any(w.spec for w in self.replicas)

    @property
    def routes_any(self) -> bool:
        """A row wants its routing: every rank runs this step eagerly (no graph holds the ids)."""
        return any(w.routes for w in self.replicas)


@dataclass
class StepReport:
    """What one rank sends back: the sampled tokens (replica leaders only) and turnstile counts."""
    rank: int
    step: int
    tokens: dict = field(default_factory=dict)      # rid -> (token, logprob | None); a verify row:
    #                                                 (tuple of emitted tokens, tuple of logprobs | None)
    rounds: int = 0                                 # turnstile rounds that ran a rendezvous
    rendezvous_s: list = field(default_factory=list)
    turnstile_wait_s: list = field(default_factory=list)   # per round with D: round called -> D enqueued
    ordering: str = ""
    span: int | str = 1
    multiplexed: bool = False
    graph: bool = False                             # D ran as a CUDA graph replay
    routes: dict = field(default_factory=dict)      # rid -> int32 bytes [tokens, layers, top-k] (leaders)
    hidden: dict = field(default_factory=dict)      # --speculative mtp, leaders other than rank 0: rid ->
    #                                                 [(start, host tensor [len, H])], the final hidden
    #                                                 states rank 0's MTP proposer reads (runtime/mtp.py)
    ops: list = field(default_factory=list)         # per op: None (done) or an error message
    p_pending: bool = False                         # this step's P epoch is still in flight
    p_ready: bool = False                           # this rank's P of the epoch in flight is done (ATP1)
    p_done: int | None = None                       # the epoch whose P finished in this step: its
    #                                                 rows' tokens are in `tokens`
    p_epoch: object = None                          # records.PEpoch: its timing (one rank, solo_overlap)
    jit_compiles: tuple = ()                        # Triton kernels this rank compiled in the step (runtime/jit_watch.py)
