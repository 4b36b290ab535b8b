"""`pdrollout trace` and `pdrollout bench` (wired into the main CLI by engine/cli.py)."""
from __future__ import annotations

import sys

MODES = ("normal", "mixed", "pd")


def _cmd_trace(a) -> int:
    from .trace import PRESETS, format_stats, generate, read_jsonl, stats, write_jsonl

    if a.stats is not None and a.stats != "":
        rows = read_jsonl(a.stats)
    else:
        rows = generate(a.preset, a.seed, a.pressure)
    if a.out:
        write_jsonl(rows, a.out)
        print(f"wrote {len(rows)} requests to {a.out}", file=sys.stderr)
    if a.stats is not None:
        p = PRESETS[a.preset]
        print(f"reference: paper numbers x {p.length_scale:g} (preset {p.name}); waits unscaled")
        print(format_stats(stats(rows), p.length_scale))
        if p.max_turns != PRESETS["paper"].max_turns:
            print(f"note: preset {p.name} has at most {p.max_turns} turns, so retained context and "
                  "token totals are not comparable to the paper's")
    elif not a.out:
        print("nothing to do: give --out FILE and/or --stats", file=sys.stderr)
        return 2
    return 0


def _cmd_bench(a) -> int:
    from .bench import Interrupted, interrupt, pending_signal, run_bench
    from .measures import BenchError
    from .trace import generate, read_jsonl

    modes = [m.strip() for m in (a.modes or "").split(",") if m.strip()]
    if a.repeats < 1:
        print(f"error: --repeats {a.repeats}: at least 1", file=sys.stderr)
        return 2
    if a.url:
        if len(modes) > 1:
            print("error: --url benches one running server: give at most one --modes label",
                  file=sys.stderr)
            return 2
        if a.repeats > 1:
            print("error: --repeats starts fresh servers: give --model DIR, not --url", file=sys.stderr)
            return 2
    elif not a.model:
        print("error: give --model DIR (fresh server per mode) or --url URL", file=sys.stderr)
        return 2
    else:
        modes = modes or list(MODES)
        bad = [m for m in modes if m not in MODES]
        if bad:
            print(f"error: unknown mode(s) {bad}; choose from {', '.join(MODES)}", file=sys.stderr)
            return 2
    rows = read_jsonl(a.trace) if a.trace else generate(a.preset, a.seed)
    meta = {"trace": a.trace or f"preset:{a.preset}", "model": a.model, "url": a.url,
            "device": a.device}
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, interrupt)
    try:
        run_bench(rows, a.out, modes=modes, model=a.model, url=a.url, device=a.device,
                  pressure=a.pressure, seed=a.seed, progress=not a.no_progress,
                  serve_args=tuple(a.serve_arg), meta=meta, priority=a.priority, repeats=a.repeats,
                  plots=not a.no_plots)
    except BenchError as e:
        print(f"bench failed: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Interrupted) as e:
        signum = e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT
        print(f"bench interrupted ({signal.Signals(signum).name}); its server was stopped", file=sys.stderr)
        return 128 + signum
    if pending_signal:   # its KeyboardInterrupt was dropped after the last replay's watcher ended
        print(f"bench interrupted ({signal.Signals(pending_signal[0]).name}) as it finished", file=sys.stderr)
        return 128 + pending_signal[0]
    return 0


def add_trace_parser(subparsers) -> None:
    from .trace import PRESETS, PRESSURE

    t = subparsers.add_parser("trace", help="generate a synthetic multi-turn agentic trace (JSONL)")
    t.add_argument("--preset", choices=list(PRESETS), default="paper")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--pressure", choices=list(PRESSURE), default="trace",
                   help="scale client waits: P1..P4 = x0, 0.01, 0.03, 0.10; trace keeps them")
    t.add_argument("--out", help="write the trace here (JSONL)")
    t.add_argument("--stats", nargs="?", const="", metavar="FILE",
                   help="print achieved percentiles beside the paper's (of FILE, else of the "
                        "generated preset)")
    t.set_defaults(func=_cmd_trace)


def add_bench_parser(subparsers) -> None:
    from .trace import PRESETS, PRESSURE, PRIORITY_HINTS

    b = subparsers.add_parser("bench", help="closed-loop replay of a trace; side-by-side modes")
    b.add_argument("--modes", help="comma list of normal,mixed,pd (default: all three); with "
                                    "--url, one label for the results (default: server)")
    b.add_argument("--model", help="model dir: a fresh `pdrollout serve` per mode")
    b.add_argument("--url", help="bench an already running server instead (one mode)")
    src = b.add_mutually_exclusive_group()
    src.add_argument("--trace", help="trace JSONL (from `pdrollout trace`)")
    src.add_argument("--preset", choices=list(PRESETS), default="tiny")
    b.add_argument("--seed", type=int, default=0, help="trace seed (presets) and token-id seed")
    b.add_argument("--pressure", choices=list(PRESSURE), default="trace",
                   help="multiply the trace's waits (use with a trace generated unscaled)")
    b.add_argument("--device", help="passed to `pdrollout serve --device`")
    b.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `pdrollout serve` (repeatable; {mode} becomes the mode, "
                        "{run} the server: the mode, or mode-rN with --repeats; "
                        "e.g. --serve-arg=--step-log --serve-arg=logs/{run})")
    b.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="N fresh servers per mode, the mode order reversed every other round; each mode's "
                        "median server stands for it, results.json's `repeats` has every server and the "
                        "ratios between the modes' medians (one GPU's identical servers differ by up to ~7 %%)")
    b.add_argument("--priority", choices=PRIORITY_HINTS, default="none",
                   help="/generate's `priority`: critical-path sends each turn its trajectory's output "
                        "tokens still to come (what an RL client knows), so long trajectories go first")
    b.add_argument("--out", required=True, help="directory for results.json, records and plots")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--no-plots", action="store_true",
                   help="no PNGs, results.json and the records only (plotting is half of a short bench's CPU)")
    b.set_defaults(func=_cmd_bench)
