"""Benchmark outputs: results.json, per-request records and PNG plots (matplotlib Agg)."""
from __future__ import annotations

import json
import os

from .measures import RequestRecord

# Span colours of the activity timeline.
_WAIT, _PREFILL, _DECODE = "#c8c8c8", "#e8862a", "#2a6fb0"


def write_results(out_dir: str, results: dict[str, dict], meta: dict,
                  records: dict[str, list[RequestRecord]]) -> str:
    os.makedirs(out_dir, exist_ok=True)
    for mode, recs in records.items():
        with open(os.path.join(out_dir, f"records-{mode}.jsonl"), "w") as f:
            for r in recs:
                f.write(json.dumps(r.to_json()) + "\n")
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "modes": results}, f, indent=2)
    return path


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_makespan(path: str, results: dict[str, dict]) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(results), 3.6))
    modes = list(results)
    vals = [results[m]["makespan_s"] for m in modes]
    bars = ax.bar(modes, vals, color=_DECODE)
    ax.bar_label(bars, fmt="%.2f s")
    ax.set_ylabel("makespan (s)")
    ax.set_title("makespan per mode (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ttft_cdf(path: str, records: dict[str, list[RequestRecord]]) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for mode, recs in records.items():
        xs = sorted(1000 * (r.first_token_s - r.release_s) for r in recs if r.first_token_s)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=mode)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timeline(path: str, records: dict[str, list[RequestRecord]]) -> None:
    """Per session row: client wait, then prefill (release -> first token), then decode."""
    plt = _plt()
    modes = list(records)
    n_sessions = max(len({r.session_id for r in recs}) for recs in records.values())
    fig, axes = plt.subplots(len(modes), 1, sharex=True, squeeze=False,
                             figsize=(9, 1.2 + len(modes) * max(1.5, 0.03 * n_sessions)))
    for ax, mode in zip(axes[:, 0], modes):
        rows = {s: i for i, s in enumerate(sorted({r.session_id for r in records[mode]}))}
        spans = {_WAIT: [], _PREFILL: [], _DECODE: []}
        for r in records[mode]:
            y = rows[r.session_id]
            ft = r.first_token_s if r.first_token_s is not None else r.done_s
            if r.wait_start_s is not None:
                spans[_WAIT].append((y, r.wait_start_s, r.release_s - r.wait_start_s))
            spans[_PREFILL].append((y, r.release_s, ft - r.release_s))
            spans[_DECODE].append((y, ft, r.done_s - ft))
        for color, items in spans.items():
            for y, x, w in items:
                ax.broken_barh([(x, max(w, 1e-4))], (y - 0.4, 0.8), color=color, linewidth=0)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.set_ylabel(f"{mode}\nsession")
        ax.set_yticks([])
    axes[-1, 0].set_xlabel("time since first release (s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (_WAIT, _PREFILL, _DECODE)]
    axes[0, 0].legend(handles, ["client wait", "prefill (to first token)", "decode"],
                      loc="upper right", fontsize=7, ncol=3)
    axes[0, 0].set_title("P/D activity timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(out_dir: str, results: dict[str, dict],
                records: dict[str, list[RequestRecord]]) -> list[str]:
    paths = [os.path.join(out_dir, n) for n in ("makespan.png", "ttft_cdf.png", "timeline.png")]
    plot_makespan(paths[0], results)
    plot_ttft_cdf(paths[1], records)
    plot_timeline(paths[2], records)
    return paths
