"""Synthetic multi-turn agentic traces with the paper's per-request statistics (docs/WORKLOAD.md).

Model (docs/WORKLOAD.md has the longer story):
* Each marginal (new prompt, output, client wait) has a piecewise log-linear quantile function
  through the paper's p50/p90/p99 plus guessed end points. A trace draws one stratified pool per
  marginal (one value per 1/N quantile slice, jittered), so its percentiles sit on the targets.
* Pool values are handed to requests by a Gaussian-copula score: first turns get a boost (the
  system/task prompt is the large one) and every conversation has a latent "verbosity" shared by
  its turns. Retained context (all earlier inputs and outputs of the conversation) then emerges;
  the two knobs are calibrated so its p50/p90 land on the paper's too.
* Retained context and client wait are statistics of the 1,137 continuations (a first turn has
  neither); new prompt and output are over all 1,265 requests.
* Full input of a request = retained context + new prompt; the paper's 6,574,104 input tokens is
  the sum of that over requests (the sum of new prompts alone would be ~0.8 M).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

# docs/WORKLOAD.md, per request p50/p90/p99.
PAPER_PERCENTILES = {
    "new_prompt": (292, 2008, 3062),
    "output": (88, 391, 1057),
    "retained_context": (4716, 8828, 12507),
    "wait_s": (3.1, 3.9, 15.0),
}
PAPER_TOTALS = {"conversations": 128, "requests": 1265, "continuations": 1137,
                "input_tokens": 6_574_104, "output_tokens": 220_862}

# Quantile anchors (q, value). The p50/p90/p99 points are the paper's; the ends are our guesses.
_ANCHORS = {
    "new_prompt": ((0.0, 24), (0.5, 292), (0.9, 2008), (0.99, 3062), (1.0, 4096)),
    "output": ((0.0, 8), (0.5, 88), (0.9, 391), (0.99, 1057), (1.0, 2048)),
    "wait_s": ((0.0, 1.0), (0.1, 2.5), (0.5, 3.1), (0.9, 3.9), (0.99, 15.0), (1.0, 30.0)),
}

# Wait multipliers of the pressure points; "trace" keeps the generated waits.
PRESSURE = {"P1": 0.0, "P2": 0.01, "P3": 0.03, "P4": 0.10, "trace": 1.0}

# Calibrated copula knobs (see module docstring): first-turn score boost, conversation correlation.
# Fitted on seeds 0-9 of the paper preset: retained p50/p90 within ~5 %, input total within ~4 %.
FIRST_TURN_BOOST = 3.0
CONVERSATION_RHO = 0.37


@dataclass(frozen=True)
class Preset:
    name: str
    conversations: int
    requests: int
    max_turns: int
    length_scale: float  # token lengths x this; waits are time and stay as they are


PRESETS = {
    "paper": Preset("paper", 128, 1265, 10, 1.0),
    "small": Preset("small", 16, 158, 10, 1 / 8),
    "tiny": Preset("tiny", 8, 30, 4, 1 / 16),
    # One GPU inside a device lease: a quarter of the conversations, a quarter of the lengths.
    "gpu": Preset("gpu", 32, 316, 10, 1 / 4),
}


def quantile(name: str, q: np.ndarray) -> np.ndarray:
    """Piecewise log-linear quantile function of marginal `name` at probabilities q."""
    qs, vs = zip(*_ANCHORS[name])
    return np.exp(np.interp(q, qs, np.log(vs)))


def _stratified(rng: np.random.Generator, name: str, n: int) -> np.ndarray:
    """n draws, one per quantile slice [i/n, (i+1)/n), sorted ascending."""
    u = (np.arange(n) + rng.uniform(size=n)) / n
    return quantile(name, u)


def _turn_counts(rng: np.random.Generator, p: Preset) -> np.ndarray:
    """Turns per conversation: all start at max_turns; the surplus is removed one turn at a time."""
    if not p.conversations <= p.requests <= p.conversations * p.max_turns:
        raise ValueError(f"preset {p.name}: requests must be within conversations x [1, max_turns]")
    counts = np.full(p.conversations, p.max_turns)
    for _ in range(p.conversations * p.max_turns - p.requests):
        choices = np.flatnonzero(counts > 1)
        counts[rng.choice(choices)] -= 1
    return counts


def _assign(rng, pool, latent_conv, conv_of, first, boost, rho):
    """Hand sorted pool values to requests in the order of their copula score."""
    eps = rng.standard_normal(len(conv_of))
    score = rho * latent_conv[conv_of] + math.sqrt(1 - rho * rho) * eps + boost * first
    out = np.empty_like(pool)
    out[np.argsort(score, kind="stable")] = np.sort(pool)
    return out


def generate(preset: str | Preset = "paper", seed: int = 0, pressure: str = "trace",
             boost: float = FIRST_TURN_BOOST, rho: float = CONVERSATION_RHO) -> list[dict]:
    """Trace rows in conversation/turn order; deterministic in (preset, seed)."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    if pressure not in PRESSURE:
        raise ValueError(f"unknown pressure {pressure!r}; choose one of {', '.join(PRESSURE)}")
    rng = np.random.default_rng(seed)
    counts = _turn_counts(rng, p)
    conv_of = np.repeat(np.arange(p.conversations), counts)
    turn = np.concatenate([np.arange(c) for c in counts])
    first = (turn == 0).astype(float)
    n = len(conv_of)
    latent = rng.standard_normal(p.conversations)
    prompt = _assign(rng, _stratified(rng, "new_prompt", n), latent, conv_of, first, boost, rho)
    output = _assign(rng, _stratified(rng, "output", n), latent, conv_of, first, 0.0, rho)
    waits = _stratified(rng, "wait_s", n - p.conversations)
    rng.shuffle(waits)
    scale = PRESSURE[pressure]
    rows, k = [], 0
    for i in range(n):
        delay_ms = 0 if turn[i] == 0 else int(round(waits[k] * 1000 * scale))
        k += turn[i] != 0
        row = {
            "session_id": f"conv-{conv_of[i]:04d}",
            "turn": int(turn[i]),
            "input_length": max(1, int(round(prompt[i] * p.length_scale))),
            "output_length": max(1, int(round(output[i] * p.length_scale))),
            "delay_ms": delay_ms,
        }
        if turn[i] == 0:
            row["timestamp"] = 0  # Mooncake/aiperf: arrival of a session's first turn, ms
        rows.append(row)
    return rows


def write_jsonl(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path: str) -> list[dict]:
    """Load a trace; rows are regrouped by session and ordered by turn."""
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            missing = {"session_id", "input_length", "output_length"} - r.keys()
            if missing:
                raise ValueError(f"{path}:{lineno}: missing field(s) {sorted(missing)}")
            rows.append(r)
    order: dict[str, int] = {}
    seen: dict[str, int] = {}
    for r in rows:
        order.setdefault(r["session_id"], len(order))
        r.setdefault("turn", seen.get(r["session_id"], 0))  # default: file order in the session
        seen[r["session_id"]] = seen.get(r["session_id"], 0) + 1
        r.setdefault("delay_ms", r.get("delay", 0))  # aiperf names the wait `delay` (ms)
    return sorted(rows, key=lambda r: (order[r["session_id"]], r["turn"]))


# What a replay sends as /generate's `priority`: nothing, or the critical-path hint (`work_left`).
PRIORITY_HINTS = ("none", "critical-path")


def work_left(turns: list[dict], k: int) -> int:
    """The critical-path hint of turn k: its trajectory's output tokens still to come, this turn's
    included (what an RL client knows as its turn and token budget left)."""
    return sum(r["output_length"] for r in turns[k:])


def sessions(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped by session_id (insertion order), each list ordered by turn."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["session_id"], []).append(r)
    for turns in out.values():
        turns.sort(key=lambda r: r["turn"])
    return out


def stats(rows: list[dict]) -> dict:
    """Achieved per-request statistics: percentiles, counts and token totals."""
    prompt, output, retained, wait = [], [], [], []
    for turns in sessions(rows).values():
        ctx = 0
        for r in turns:
            prompt.append(r["input_length"])
            output.append(r["output_length"])
            if r["turn"] > 0:  # a first turn retains nothing: both are continuation stats
                retained.append(ctx)
                wait.append(r["delay_ms"] / 1000)
            ctx += r["input_length"] + r["output_length"]
    pct = lambda xs: tuple(float(np.percentile(xs, q)) if xs else 0.0 for q in (50, 90, 99))
    n_sessions = len(sessions(rows))
    return {
        "percentiles": {"new_prompt": pct(prompt), "output": pct(output),
                        "retained_context": pct(retained), "wait_s": pct(wait)},
        "conversations": n_sessions,
        "requests": len(rows),
        "continuations": len(rows) - n_sessions,
        "max_turns": max((len(t) for t in sessions(rows).values()), default=0),
        "input_tokens": int(sum(prompt) + sum(retained)),
        "output_tokens": int(sum(output)),
    }


def format_stats(st: dict, length_scale: float = 1.0) -> str:
    """Achieved percentiles beside the paper's (token targets x length_scale)."""
    lines = [f"{'per request':<18}{'p50':>9}{'p90':>9}{'p99':>9}   {'paper p50/p90/p99':<22}"
             f"{'err p50':>8}{'err p90':>8}"]
    for name, got in st["percentiles"].items():
        s = 1.0 if name == "wait_s" else length_scale
        ref = [v * s for v in PAPER_PERCENTILES[name]]
        err = [100 * (g - r) / r for g, r in zip(got, ref)]
        fmt = "{:>9.2f}" if name == "wait_s" else "{:>9.0f}"
        lines.append(f"{name:<18}" + "".join(fmt.format(g) for g in got)
                     + f"   {'/'.join(f'{v:g}' for v in ref):<22}{err[0]:>+7.1f}%{err[1]:>+7.1f}%")
    lines.append(f"{'conversations':<18}{st['conversations']:>9d}   paper {PAPER_TOTALS['conversations']}")
    conv = st["conversations"] / PAPER_TOTALS["conversations"]  # totals scale with the count
    for key in ("requests", "continuations", "input_tokens", "output_tokens"):
        ref = PAPER_TOTALS[key] * conv * (length_scale if key.endswith("tokens") else 1.0)
        lines.append(f"{key:<18}{st[key]:>9d}   paper {ref:,.0f} ({100 * (st[key] - ref) / ref:+.1f}%)")
    lines.append(f"{'max_turns':<18}{st['max_turns']:>9d}")
    return "\n".join(lines)
