"""The multi-rank engine's costs (docs/PERF.md, "D's bytes and the cost model").

What the code sends (`d_wire`, `p_wire`): per rank and step, the collectives an eager forward issues
and the bytes they send to peers, counted as the step log counts them (`d_collectives`, `d_bytes`;
runtime/collectives.py and token_slots.py): tests/distributed/test_mp_engine.py compares them with
gloo runs' logs. What a collective costs (`Fabric`): latency plus bytes over the slowest link a rank's
share crosses, NVLink between GPUs of a node and RDMA between nodes kept apart. What a rank reads
(`d_floor_bytes`): its decode step's HBM floor. e2e/rank_project.py puts these together.

The old code's fit (`RankModel`, `fit_old`, `OLD`): compute from the one-GPU fit (plan_sim.Cost), each
collective's latency by bytes and rank count, what its structure added per layer (host reads,
turnstile rounds); fitted to the old code's two-GPU step logs and validated against their makespans
(e2e/rank_sim.py). It describes the code before issue 48's rebuild, not today's.
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


# ---- what the code sends (the step log's d_collectives and d_bytes) ----------------------------
@dataclass(frozen=True)
class Shape:
    """What a forward's collectives depend on: the topology, the model's widths, the rows' dtype."""
    world: int
    adp: int
    ep: int
    hidden: int
    topk: int
    layers: int
    moe_layers: int
    elem: int = 2                 # bytes of the rows' dtype (bf16 on GPUs; the CPU tests run fp32)

    @property
    def atp(self) -> int:
        return self.world // self.adp


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def d_wire(s: Shape, rank: int, rows: list[int]) -> list[tuple[str, int, int]]:
    """One eager D forward on `rank` with `rows` decode rows a replica: (collective, its group's size,
    bytes this rank sends to peers) in issue order, every layer. A ring all-reduce sends 2(g-1)/g of
    its buffer; an all-gather or reduce-scatter (g-1) parts; the token slots' all-to-alls (ep-1) of
    their ep slices (each peer `m` slots of the token, its k ids and k weights; back, the partial sums)."""
    a, d, ep, H, k, e = s.atp, s.adp, s.ep, s.hidden, s.topk, s.elem
    own, m = rows[rank // a], _ceil(max(rows), a)
    layer = []
    if a > 1:
        layer.append(("atp-allreduce", a, 2 * (a - 1) * own * H * e // a))
    moe = [("dispatch", ep, (ep - 1) * m * (H + 2 * k) * e), ("combine", ep, (ep - 1) * m * H * e)]
    if a == 1:
        moe_layer = moe
    elif d > 1:   # the DP gather's pack is fp32: the rows, k ids, k weights, a validity flag
        moe_layer = [("dp-allgather", d, (d - 1) * m * (H + 2 * k + 1) * 4), *moe,
                     ("dp-reducescatter", d, (d - 1) * m * H * e), ("atp-allgather", a, (a - 1) * m * H * e)]
    else:
        moe_layer = [*moe, ("atp-allgather", a, (a - 1) * m * H * e)]
    return (layer + moe_layer) * s.moe_layers + layer * (s.layers - s.moe_layers)


def p_wire(s: Shape, rank: int, tokens: list[int]) -> list[tuple[str, int, int]]:
    """One eager P forward (one pass a layer) with `tokens` P tokens a replica, as d_wire: at ATP > 1
    the model-wide all-reduces of the zero-padded buffer of every replica's rows, around the token slots
    of each rank's chunk."""
    a, n, ep, H, k, e = s.atp, s.world, s.ep, s.hidden, s.topk, s.elem
    total, m = sum(tokens), _ceil(max(tokens), a)
    world = [("attn-allreduce", n, 2 * (n - 1) * total * H * e // n)] if a > 1 else []
    moe = [("dispatch", ep, (ep - 1) * m * (H + 2 * k) * e), ("combine", ep, (ep - 1) * m * H * e)]
    back = [("moe-allreduce", n, 2 * (n - 1) * total * H * e // n)] if a > 1 else []
    return (world + moe + back) * s.moe_layers + world * (s.layers - s.moe_layers)


def counted(wire: list[tuple[str, int, int]]) -> tuple[int, int]:
    """(collectives, bytes): what the step log's d_collectives and d_bytes hold for one forward."""
    return len(wire), sum(b for _, _, b in wire)


# ---- what a collective costs: NVLink in a node, RDMA between nodes ---------------------------
@dataclass(frozen=True)
class Link:
    alpha_s: float                # a collective's fixed cost on this link (launch, synchronization)
    bytes_s: float                # a rank's bandwidth a direction


@dataclass(frozen=True)
class Fabric:
    gpus_per_node: int
    nvlink: Link
    rdma: Link

    def coll_s(self, rank: int, group: list[int], sent: int, kind: str) -> float:
        """A rank's time in one collective over `group` that sends `sent` bytes to peers. An all-to-all
        sends each peer its share at once: the node's peers over NVLink, the others over the rank's
        RDMA link, the slower decides. A ring's steps each cross one hop: any hop between nodes makes
        every step wait for RDMA."""
        node = rank // self.gpus_per_node
        inter = [p for p in group if p != rank and p // self.gpus_per_node != node]
        peers = len(group) - 1
        if not peers:
            return 0.0
        if kind in ("dispatch", "combine"):
            share = sent / peers
            t_nvl = (peers - len(inter)) * share / self.nvlink.bytes_s
            t_rdma = len(inter) * share / self.rdma.bytes_s
            alpha = self.rdma.alpha_s if inter else self.nvlink.alpha_s
            return alpha + max(t_nvl, t_rdma)
        link = self.rdma if inter else self.nvlink
        return link.alpha_s + sent / link.bytes_s


def group_of(s: Shape, rank: int, name: str) -> list[int]:
    """The ranks of the group `name` runs over for `rank` (protocol/topology.py's groups)."""
    a = s.atp
    if name in ("atp-allreduce", "atp-allgather"):
        lo = rank // a * a
        return list(range(lo, lo + a))
    if name in ("dp-allgather", "dp-reducescatter"):
        return list(range(rank % a, s.world, a))
    if name in ("dispatch", "combine"):
        lo = rank // s.ep * s.ep
        return list(range(lo, lo + s.ep))
    return list(range(s.world))


def wire_s(s: Shape, fabric: Fabric, rank: int, wire: list[tuple[str, int, int]]) -> float:
    return sum(fabric.coll_s(rank, group_of(s, rank, name), sent, name) for name, _, sent in wire)


# ---- what a rank reads: a decode step's HBM floor ------------------------------------------
VOCAB, KV_HEADS, HEAD_DIM = 151936, 4, 128


def touched(experts: int, pairs: float) -> float:
    """Distinct experts among `pairs` uniform draws from `experts` (random weights route near uniform)."""
    return experts * (1 - (1 - 1 / experts) ** pairs)


def d_floor_bytes(world: int, adp: int, ep: int, rows: int, ctx: int, layers: int = 48) -> float:
    """Bytes a rank reads in a decode step with `rows` rows a replica at `ctx` tokens of context: its
    attention shard (ATP), the local experts its pairs touch (every replica's rows reach the EP group's
    experts), its KV shard of its replica's rows, the embedding row gather aside, the LM head."""
    atp = world // adp
    pairs_local = TOPK * rows * adp / ep            # pairs landing on this rank's experts
    local = EXPERTS // ep
    kv = rows * ctx * 2 * (KV_HEADS // atp if KV_HEADS >= atp else 1) * HEAD_DIM * 2
    per_layer = 2 * ATTN_PARAMS / atp + touched(local, pairs_local) * EXPERT_PARAMS * 2 + kv
    return layers * per_layer + VOCAB * HIDDEN * 2
