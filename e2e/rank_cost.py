"""A step's cost on the multi-rank engine (docs/PERF.md, "The cost model of the multi-rank engine"):
compute from the one-GPU fit (plan_sim.Cost), plus each collective's latency by bytes and rank count,
plus what the code's structure adds per layer (host reads, turnstile rounds), plus P beside D on
separate streams with an interference factor. `fit_old` fits the old code's collective floor and
per-layer overheads to the two-GPU step logs; `Structure` says what the code does per step.
"""
from __future__ import annotations

import gzip
import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from plan_sim import Cost

# Qwen3-30B-A3B's per-layer shape (engine/presets/qwen3-30b-a3b.json): the floors' bytes and FLOPs.
HIDDEN, TOPK, EXPERTS, MOE_I = 2048, 8, 128, 768
ATTN_PARAMS = HIDDEN * 32 * 128 * 2 + HIDDEN * 4 * 128 * 2   # q, o; k, v
EXPERT_PARAMS = 3 * HIDDEN * MOE_I
# Share of a P token's work in attention (the rest is experts), by active parameters a layer:
# 18.9 M attention against 8 x 4.7 M expert weights; context-length attention FLOPs are left out.
ATTN_SHARE = ATTN_PARAMS / (ATTN_PARAMS + TOPK * EXPERT_PARAMS)


@dataclass(frozen=True)
class Chip:
    """Where a chip enters: its floors. A step's fitted H200 time moves by the change of its floor
    (bytes / HBM bandwidth for D, FLOPs / peak for P): the fitted costs sit far above the floors at
    this workload's batches, so the latency parts are kept, not scaled."""
    name: str
    hbm_bytes_s: float
    bf16_flops: float


# H200 SXM: 4.8 TB/s HBM3e, 989 TFLOPS dense BF16 (NVIDIA H200 datasheet). H20: 4.0 TB/s HBM3,
# 148 TFLOPS dense BF16 (NVIDIA's H20 figures as published by resellers, e.g. willitrunai.com/gpus/h20-96gb).
H200 = Chip("H200", 4.8e12, 989e12)
H20 = Chip("H20", 4.0e12, 148e12)


@dataclass(frozen=True)
class Links:
    """A collective of `nbytes` per rank: alpha + nbytes / beta. `exchange_s`: what a step costs on
    rank 0 outside the ranks' own step time (the plan's broadcast, the reports' gloo gather);
    `round_s`: one turnstile round (two rendezvous) where the code has one."""
    ranks: int
    alpha_s: float
    beta_bytes_s: float
    exchange_s: float
    round_s: float

    def coll_s(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.beta_bytes_s


@dataclass(frozen=True)
class Structure:
    """What the code does a layer. old: ~5 collectives a D layer, an eager forward on every rank when
    any replica has P, P's expert counts read on the host every layer, a turnstile round every P layer
    under pd. new: 2 collectives a D layer at ATP1 (+ the ATP all-reduce above it), no host reads in P,
    no turnstile where groups do not cross, P epochs beside D's graph replays under pd."""
    name: str
    d_colls: int
    p_colls: int
    p_layer_host_s: float = 0.0    # old: the per-layer overhead of P beyond its collectives (fitted)
    turnstile: bool = False        # pd: a round a P layer, in the step (old) or a D step beside P (crossed)
    overlap: bool = False          # pd: P epochs span D steps on their own stream
    token_slots: bool = False      # P's exchange: every peer a slot for each of the bound's rows


@dataclass
class RankModel:
    cost: Cost                     # one H200, the `small` preset's layers (plan_sim.fit)
    layers: int
    n: int                         # ranks (EP = n)
    adp: int
    links: Links
    structure: Structure
    chip: Chip = H200
    interference: float = 0.0      # P beside D: both stretch by this fraction
    meta: dict = field(default_factory=dict)

    @property
    def atp(self) -> int:
        return self.n // self.adp

    def _d_floor_s(self, rows: list[int], chip: Chip) -> float:
        """Bytes a rank reads in a D step: its attention share and the experts the batch touches."""
        touched = min(EXPERTS, TOPK * sum(rows)) / self.n
        per_layer = 2 * (ATTN_PARAMS / self.atp + touched * EXPERT_PARAMS)
        return self.layers * per_layer / chip.hbm_bytes_s

    def _p_floor_s(self, tokens: float, chip: Chip) -> float:
        return self.layers * 2 * (ATTN_PARAMS + TOPK * EXPERT_PARAMS) * tokens / chip.bf16_flops

    def _chip_delta(self, rows: list[int], p_tokens: float) -> float:
        if self.chip == H200:
            return 0.0
        return (self._d_floor_s(rows, self.chip) - self._d_floor_s(rows, H200)
                + self._p_floor_s(p_tokens, self.chip) - self._p_floor_s(p_tokens, H200))

    def _p_tokens(self, ptok: list[int]) -> float:
        """A rank's share of the step's P work, in one-GPU tokens: its replica's attention over ATP,
        its 1/EP of every replica's experts."""
        return ATTN_SHARE * max(ptok) / self.atp + (1 - ATTN_SHARE) * sum(ptok) / self.n

    def _rows(self, rows: list[int]) -> int:
        return max(rows, default=0)

    def d_step_s(self, rows: list[int], beside_p: bool = False) -> float:
        """A decode-only step as a graph replay on every rank; `beside_p`: a P epoch is in flight."""
        a, b = self.cost.graph
        t = a + b * self._rows(rows) + self._chip_delta(rows, 0)
        nbytes = self._rows(rows) * TOPK * HIDDEN * 2
        t += self.layers * self.structure.d_colls * self.links.coll_s(nbytes)
        if beside_p:
            t *= 1 + self.interference
            if self.structure.turnstile and self.atp > 1:   # crossed: R+ ordered on D's stream
                t += self.links.round_s
        return t + self.links.exchange_s

    def p_work_s(self, rows: list[int], ptok: list[int]) -> float:
        """The step's P on every rank (with its D rows, fused): its compute, or the host's issue of
        its layers where that is longer. An eager forward's kernels run while the host issues the
        next ones, so the two overlap; a host read per layer (old) makes the issue the longer one:
        the two-GPU logs' P steps take ~52-81 ms whatever their token count (0-37 us a token)."""
        a, b, c = self.cost.eager
        share = self._p_tokens(ptok)
        compute = a + b * self._rows(rows) + c * share + self._chip_delta(rows, share)
        # per peer: the token slots send the bound's rows to every peer (runtime/token_slots.py);
        # the counted path a (token, expert) pair's share
        nbytes = max(ptok) / self.atp * (HIDDEN + 2 * TOPK) * 2 if self.structure.token_slots else \
            max(ptok) * TOPK * HIDDEN * 2 / self.n
        issue = self.layers * (self.structure.p_colls * self.links.coll_s(nbytes) + self.structure.p_layer_host_s)
        return max(compute, issue)

    def p_step_s(self, rows: list[int], ptok: list[int], pd: bool) -> float:
        """A fused step: an eager forward on every rank while any replica has P."""
        t = self.p_work_s(rows, ptok) + self.links.exchange_s
        if pd and self.structure.turnstile and not self.structure.overlap:
            t += self._pd_fused_s(rows)
        return t

    def _pd_fused_s(self, rows: list[int]) -> float:
        """Old pd: D's own forward beside P in the step, ordered against it layer by layer (a round
        a layer), so the step holds both."""
        a, b = self.cost.graph
        d = a + b * self._rows(rows) if any(rows) else 0.0
        return d + self.layers * self.links.round_s

    def p_epoch_s(self, ptok: list[int]) -> float:
        """A P epoch on its own stream beside D's replays."""
        return self.p_work_s([0], ptok) * (1 + self.interference)


OLD = Structure("old", d_colls=5, p_colls=6, turnstile=True)


def new_structure(atp: int) -> Structure:
    """2 expert all-to-alls a D layer, one ATP all-reduce more above ATP1; P the same through the
    token slots, no host reads; the turnstile only where groups cross (ATP > 1)."""
    extra = 1 if atp > 1 else 0
    return Structure("new", d_colls=2 + extra, p_colls=2 + extra, turnstile=atp > 1, overlap=True, token_slots=True)


def joint_steps(run_dir: str | Path) -> list[dict]:
    """One record a step of a 2-rank run: both ranks' rows and P tokens, the slower rank's wall."""
    logs = []
    for f in sorted(Path(run_dir).glob("rank*.jsonl*")):
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt") as fh:
            logs.append([json.loads(x) for x in fh if x.strip()])
    out = []
    for same in zip(*logs):
        assert len({s["step"] for s in same}) == 1, "the ranks' logs disagree on the step"
        out.append({"rows": [s["decode_rows"] for s in same], "ptok": [s["prefill_tokens"] for s in same],
                    "wall_s": max(s["wall_s"] for s in same), "rounds": same[0]["rounds"]})
    return out[1:]   # step 0: the warm-up through every path


def fit_old(cost: Cost, runs: dict[str, list[dict]], layers: int, exchange_s: float, beta: float) -> RankModel:
    """The old code's unknowns from two-GPU step logs by mode: the collective floor alpha (D graph
    steps, 5 collectives a layer, after the one-GPU compute), the P layer's overhead past its
    collectives (normal/mixed steps with P), the turnstile round (pd steps with P). `exchange_s`
    (fitted by the caller from makespans) is outside the logged step times."""
    base = RankModel(cost, layers, 2, 2, Links(2, 0.0, beta, 0.0, 0.0), OLD)
    d = [s for steps in runs.values() for s in steps if not any(s["ptok"])]
    d_res = [s["wall_s"] - base.d_step_s(s["rows"]) for s in d]
    alpha = statistics.fmean(d_res) / (layers * OLD.d_colls)
    links = replace(base.links, alpha_s=alpha)
    base = replace(base, links=links)
    p = [s for m, steps in runs.items() if m != "pd" for s in steps if any(s["ptok"])]
    want = statistics.fmean(s["wall_s"] for s in p)
    lo, hi = 0.0, want / layers   # the per-layer host cost whose steps' mean time is the logs' mean
    for _ in range(60):
        mid = (lo + hi) / 2
        trial = replace(base, structure=replace(OLD, p_layer_host_s=mid))
        got = statistics.fmean(trial.p_work_s(s["rows"], s["ptok"]) for s in p)
        lo, hi = (mid, hi) if got < want else (lo, mid)
    host = lo
    structure = replace(OLD, p_layer_host_s=host)
    base = replace(base, structure=structure)
    pd = [s for s in runs.get("pd", []) if any(s["ptok"])]
    pd_res = sum(s["wall_s"] - base.p_work_s(s["rows"], s["ptok"]) - base._pd_fused_s(s["rows"]) for s in pd)
    round_s = pd_res / (layers * len(pd)) if pd else 0.0   # charged a round a layer (the logs: 11.5-11.7)
    return replace(base, links=replace(links, round_s=round_s, exchange_s=exchange_s),
                   meta={"exchange_ms": exchange_s * 1e3, "alpha_us": alpha * 1e6, "p_layer_host_us": host * 1e6,
                         "round_ms": round_s * 1e3, "d_steps": len(d), "p_steps": len(p), "pd_p_steps": len(pd)})
