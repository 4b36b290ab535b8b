"""Pure measures of a benchmark run (docs/WORKLOAD.md): per-request records in, one summary dict out.

Field names follow `sglang.bench_serving` where they cover the same quantity; ours are added.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

import numpy as np

from ..protocol import metrics as metric
from .fleet import fleet_measures

# Server metrics scraped before and after a run (docs/SERVER.md).
DECODE_WAIT, RENDEZVOUS, ROLLOUT_MAKESPAN = metric.DECODE_WAIT, metric.RENDEZVOUS, metric.ROLLOUT_MAKESPAN
DECODE_STEP, DECODE_STEP_BESIDE_P = metric.DECODE_STEP, metric.DECODE_STEP_BESIDE_P
P_EPOCH, P_EPOCH_ENQUEUE, P_EPOCH_CPU = metric.P_EPOCH, metric.P_EPOCH_ENQUEUE, metric.P_EPOCH_CPU
ROUNDS, STALLS = metric.total(metric.ROUNDS), metric.total(metric.STALLS)
JIT_COMPILES = metric.total(metric.JIT_COMPILES)


class BenchError(RuntimeError):
    """A benchmark cannot go on or its result is not trustworthy; the message says why."""


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds from the start of the run."""
    session_id: str
    turn: int
    wait_start_s: float | None  # previous turn's completion (start of the client wait)
    release_s: float
    first_token_s: float | None
    done_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    finish_reason: str | None = None
    served_by: str | None = None    # the engine that answered (meta_info.served_by), behind a router
    # speculation (meta_info's spec_* keys; absent without it): D iterations, drafts proposed, accepted
    spec_verify_ct: int | None = None
    spec_proposed_drafts: int | None = None
    spec_accepted_drafts: int | None = None
    output_ids: list[int] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)
        # the ids themselves would bloat the records; their digest says whether two runs of one
        # trace generated the same tokens (greedy on near-flat logits can flip with a row's batch)
        d["output_digest"] = output_digest(d.pop("output_ids"))
        return d


def output_digest(ids: list[int]) -> str:
    """A short digest of a request's output ids (sha1 of their int32 bytes, 12 hex)."""
    return hashlib.sha1(np.asarray(ids, dtype=np.int32).tobytes()).hexdigest()[:12]


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def _mean(xs: list[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


def metric_sums(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over label sets} (buckets left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket") or s.name.endswith("_created"):
                continue
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def server_measures(before: dict[str, float], after: dict[str, float]) -> dict:
    """D wait, rendezvous and stalls over the run, from scrapes before and after it."""
    def delta(name):
        if name not in after:
            return None
        return after[name] - before.get(name, 0.0)

    def mean_ms(hist):
        n, s = delta(hist + "_count"), delta(hist + "_sum")
        return None if not n or s is None else 1000.0 * s / n

    def count(name):   # a counter's, or a histogram's `_count`
        n = delta(name)
        return None if n is None else int(n)

    return {
        "mean_decode_wait_ms": mean_ms(DECODE_WAIT),
        "decode_wait_count": count(DECODE_WAIT + "_count"),
        "rendezvous_count": count(RENDEZVOUS + "_count"),
        # decode-only steps' mean wall time: the per-step comparison a short run's makespan is too
        # noisy for (pd against normal on a decode-only workload: the same graph replays)
        "mean_decode_step_ms": mean_ms(DECODE_STEP),
        "decode_steps": count(DECODE_STEP + "_count"),
        # of them, those a P epoch ran beside (pd): against the mean above, what the overlap costs D
        "mean_decode_step_beside_p_ms": mean_ms(DECODE_STEP_BESIDE_P),
        "decode_steps_beside_p": count(DECODE_STEP_BESIDE_P + "_count"),
        # P epochs beside D (one rank): their mean wall time, and of it the issuing and its CPU time
        "mean_p_epoch_ms": mean_ms(P_EPOCH),
        "mean_p_epoch_enqueue_ms": mean_ms(P_EPOCH_ENQUEUE),
        "mean_p_epoch_cpu_ms": mean_ms(P_EPOCH_CPU),
        "p_epochs": count(P_EPOCH + "_count"),
        "mean_rendezvous_ms": mean_ms(RENDEZVOUS),
        "turnstile_rounds": count(ROUNDS),
        "stalls": count(STALLS),
        # Triton compiles in the run's steps: each a stall a warmed server would not have had
        "jit_compiles": count(JIT_COMPILES),
        "server_rollout_makespan_s": after.get(ROLLOUT_MAKESPAN),
    }


def summarize(records: list[RequestRecord], before: dict | None = None,
              after: dict | None = None) -> dict:
    """The run's measures; `before`/`after` are metric_sums() of /metrics around the run."""
    if not records:
        raise BenchError("no completed requests to summarize")
    start = min(r.release_s for r in records)
    end = max(r.done_s for r in records)
    makespan = end - start
    ttft = [1000 * (r.first_token_s - r.release_s) for r in records if r.first_token_s is not None]
    e2e = [1000 * (r.done_s - r.release_s) for r in records]
    traj: dict[str, tuple[float, float]] = {}
    for r in records:
        lo, hi = traj.get(r.session_id, (r.release_s, r.done_s))
        traj[r.session_id] = (min(lo, r.release_s), max(hi, r.done_s))
    traj_s = [hi - lo for lo, hi in traj.values()]
    waits = [r.release_s - r.wait_start_s for r in records if r.wait_start_s is not None]
    tin = sum(r.prompt_tokens for r in records)
    tout = sum(r.completion_tokens for r in records)
    rate = lambda x: x / makespan if makespan > 0 else None
    out = {
        "duration": makespan,
        "completed": len(records),
        "total_input_tokens": tin,
        "total_output_tokens": tout,
        "total_cached_tokens": sum(r.cached_tokens for r in records),
        **_speculation(records),
        "request_throughput": rate(len(records)),
        "input_throughput": rate(tin),
        "output_throughput": rate(tout),
        "mean_ttft_ms": _mean(ttft),
        "median_ttft_ms": _pct(ttft, 50),
        "p99_ttft_ms": _pct(ttft, 99),
        "mean_e2e_latency_ms": _mean(e2e),
        "median_e2e_latency_ms": _pct(e2e, 50),
        "p99_e2e_latency_ms": _pct(e2e, 99),
        "makespan_s": makespan,
        "sessions": len(traj),
        "mean_trajectory_s": _mean(traj_s),
        "p99_trajectory_s": _pct(traj_s, 99),
        "mean_client_wait_ms": _mean([1000 * w for w in waits]),
    }
    out.update(server_measures(before or {}, after or {}))
    out.update(fleet_measures(records))
    return out


# (label, key, format) rows of the side-by-side table.
TABLE_ROWS = (
    ("makespan (s)", "makespan_s", "{:.2f}"),
    ("requests/s", "request_throughput", "{:.2f}"),
    ("TTFT p50 (ms)", "median_ttft_ms", "{:.1f}"),
    ("TTFT p99 (ms)", "p99_ttft_ms", "{:.1f}"),
    ("request p99 (ms)", "p99_e2e_latency_ms", "{:.1f}"),
    ("trajectory p99 (s)", "p99_trajectory_s", "{:.2f}"),
    ("mean D wait (ms)", "mean_decode_wait_ms", "{:.2f}"),
    ("D-only step (ms)", "mean_decode_step_ms", "{:.2f}"),
    ("of it beside P (ms)", "mean_decode_step_beside_p_ms", "{:.2f}"),
    ("rendezvous", "rendezvous_count", "{:d}"),
    ("rendezvous mean (ms)", "mean_rendezvous_ms", "{:.3f}"),
    ("stalls", "stalls", "{:d}"),
    ("kernel compiles", "jit_compiles", "{:d}"),
    ("continuations cached", "continuation_cached_share", "{:.3f}"),
    ("cont. cached/prompt", "continuation_cached_ratio", "{:.3f}"),
    ("engines", "engines", "{:d}"),
    ("input tokens", "total_input_tokens", "{:d}"),
    ("output tokens", "total_output_tokens", "{:d}"),
)


def ratio(value, base) -> float | None:
    if value is None or base in (None, 0):
        return None
    return value / base


def format_table(results: dict[str, dict], base: str = "normal") -> str:
    """Measures per mode; with a `base` mode present, each other mode also gets value/base."""
    modes = list(results)
    has_base = base in results and len(modes) > 1
    head = f"{'':<22}" + "".join(f"{m:>14}" for m in modes)
    if has_base:
        head += "".join(f"{m + '/' + base:>16}" for m in modes if m != base)
    lines = [head]
    for label, key, fmt in TABLE_ROWS:
        cells = []
        for m in modes:
            v = results[m].get(key)
            cells.append(f"{'-' if v is None else fmt.format(v):>14}")
        if has_base:
            for m in modes:
                if m != base:
                    r = ratio(results[m].get(key), results[base].get(key))
                    cells.append(f"{'-' if r is None else f'x{r:.3f}':>16}")
        lines.append(f"{label:<22}" + "".join(cells))
    return "\n".join(lines)


def repeat_spread(runs: dict[str, list[dict]], bases: tuple[str, ...] = ("normal", "mixed")) -> dict:
    """Per mode over its servers (`runs`: each server's summary): every makespan and p99 TTFT, their
    medians, how far identical servers spread (max / min), and each mode's median makespan over each
    base mode's (`makespan_vs_normal`, ...) and its median p99 TTFT over normal's."""
    import statistics
    out: dict[str, dict] = {}
    for mode, summaries in runs.items():
        mk = [s["makespan_s"] for s in summaries]
        p99 = [s["p99_ttft_ms"] for s in summaries if s.get("p99_ttft_ms") is not None]
        out[mode] = {"servers": len(mk), "makespan_s": mk, "median_makespan_s": statistics.median(mk),
                     "spread": max(mk) / min(mk), "p99_ttft_ms": p99,
                     "median_p99_ttft_ms": statistics.median(p99) if p99 else None}
    for mode, row in out.items():
        for base in bases:
            if base in out and base != mode:
                row[f"makespan_vs_{base}"] = row["median_makespan_s"] / out[base]["median_makespan_s"]
        if "normal" in out and mode != "normal":
            row["p99_ttft_vs_normal"] = ratio(row["median_p99_ttft_ms"], out["normal"]["median_p99_ttft_ms"])
    return out


def format_repeats(spread: dict[str, dict]) -> str:
    """The repeated servers: per mode its median makespan, min–max, spread, and the ratios of medians."""
    cell = lambda v: "-" if v is None else f"x{v:.3f}"
    lines = [f"{'repeated servers':<22}{'servers':>8}{'median s':>10}{'min-max s':>16}{'max/min':>9}"
             f"{'vs normal':>11}{'vs mixed':>10}{'p99 TTFT vs normal':>20}"]
    for mode, r in spread.items():
        span = f"{min(r['makespan_s']):.2f}-{max(r['makespan_s']):.2f}"
        lines.append(f"{mode:<22}{r['servers']:>8}{r['median_makespan_s']:>10.2f}{span:>16}{r['spread']:>9.3f}"
                     f"{cell(r.get('makespan_vs_normal')):>11}{cell(r.get('makespan_vs_mixed')):>10}"
                     f"{cell(r.get('p99_ttft_vs_normal')):>20}")
    return "\n".join(lines)


def check_same_work(results: dict[str, dict]) -> None:
    """Every mode must have done identical work; raise BenchError naming the difference."""
    keys = ("completed", "total_input_tokens", "total_output_tokens")
    seen = {m: tuple(r[k] for k in keys) for m, r in results.items()}
    if len(set(seen.values())) > 1:
        detail = "; ".join(f"{m}: " + ", ".join(f"{k}={v}" for k, v in zip(keys, t))
                           for m, t in seen.items())
        raise BenchError(f"modes did different work (token totals differ): {detail}")


def _speculation(records) -> dict:
    """Acceptance over the run, from the requests' meta_info (nothing without speculation):
    accept rate = accepted / proposed drafts; accept length = output tokens per D iteration."""
    spec = [r for r in records if r.spec_verify_ct is not None]
    if not spec:
        return {}
    proposed = sum(r.spec_proposed_drafts or 0 for r in spec)
    accepted = sum(r.spec_accepted_drafts or 0 for r in spec)
    verify = sum(r.spec_verify_ct for r in spec)
    return {"spec_proposed_drafts": proposed, "spec_accepted_drafts": accepted,
            "spec_accept_rate": accepted / proposed if proposed else None,
            "spec_accept_length": sum(r.completion_tokens for r in spec) / verify if verify else None}
