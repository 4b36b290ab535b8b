"""What the kernel sweeps share: a graph replay timed by CUDA events, a config sweep checked
against the reference, their command line, the meta every result carries (commit, machine, nproc,
seed, command) and the JSON written for the device's return."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

from .hbm import replays_ms


def timed(fn, reps: int) -> float:
    """Seconds per call of a graph-captured `fn`, from CUDA events."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replays_ms(graph, reps) / 1e3


def rel(a, b) -> float:
    """Relative L2 error of `a` against the reference `b`, in fp64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def sweep_each(make, ref, configs: list[dict], time: bool = True, reps: int = 20, figures=lambda us: {}) -> list[dict]:
    """Each config whose launch (`make(cfg)`, a callable) compiles and agrees with the reference,
    fastest first (a config past shared memory or registers is reported, not fatal); `figures(us)`
    adds what a timed entry is worth. time=False (a CPU dry run): the check alone."""
    out = []
    for cfg in configs:
        try:
            run = make(cfg)
            entry = {"config": cfg, "rel_err": rel(run(), ref)}
            if time:
                entry["us"] = timed(run, reps) * 1e6
                entry.update(figures(entry["us"]))
        except Exception as exc:
            entry = {"config": cfg, "error": str(exc).splitlines()[0][:120]}
        out.append(entry)
    return sorted(out, key=lambda r: r.get("us", 0) if r.get("rel_err", 1) < 2e-2 else float("inf"))


def sweep_configs(run, ref, flops: float, configs: list[dict], time: bool = True) -> list[dict]:
    """sweep_each of `run(**config)`, each timed entry with its TFLOP/s."""
    return sweep_each(lambda cfg: lambda: run(**cfg), ref, configs, time, figures=lambda us: {"tflops": flops / us / 1e6})


def parser(doc: str | None = None, **ints: int) -> argparse.ArgumentParser:
    """OUT, which every tool here writes, and an integer option --NAME per keyword (its default)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    for name, default in ints.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    return ap


def sweep_parser(doc: str | None, **strings: str) -> argparse.ArgumentParser:
    """OUT.json and --sweep, which every kernel sweep takes, and a string option --NAME per keyword."""
    ap = parser(doc)
    ap.add_argument("--sweep", action="store_true")
    for name, default in strings.items():
        ap.add_argument(f"--{name}", default=default)
    return ap


def run_group(args: list[str], timeout: float, env: dict | None = None) -> tuple[int | str, str, str]:
    """(rc or "timeout", stdout, stderr) of `args` in a process group of its own, which goes whole
    when the run ends: a rank left spinning on its GPU would hold SMs (and the output pipes) of
    every later run."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    finally:
        try:
            os.killpg(p.pid, 9)
        except ProcessLookupError:
            pass
    if rc == "timeout":
        stdout, stderr = p.communicate()
    return rc, stdout, stderr


def parse_on_device(ap: argparse.ArgumentParser) -> tuple[argparse.Namespace, bool, torch.device]:
    """(the options, a CPU dry run?, the device): DEVICE=cpu runs the mechanics on a tiny shape here."""
    cpu = os.environ.get("DEVICE") == "cpu"
    return ap.parse_args(), cpu, torch.device("cpu" if cpu else "cuda")


def meta(cpu: bool, **extra) -> dict:
    """Where a result came from; COMMIT and MACHINE are set by the caller (the device copy's git
    HEAD can lag the tree it runs)."""
    return {"gpu": None if cpu else torch.cuda.get_device_name(), "commit": os.environ.get("COMMIT", "unknown"),
            "machine": os.environ.get("MACHINE", "unknown"), "nproc": 1, "seed": 0,
            "command": " ".join(sys.argv), **extra}


def finish(out: str, meta: dict, rows: list[dict], wrong: list, what: str) -> int:
    """Writes {meta, rows} to `out`; 1 with `what` and the rows named in `wrong` when any is."""
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if wrong:
        print(f"{what} {wrong}", file=sys.stderr)
        return 1
    return 0


def off_reference(rows: list[dict], err: str, label) -> list:
    """label(row) of each row whose default launch (`err`) or any swept config is off the reference."""
    return [label(r) for r in rows if r[err] > 2e-2 or any(e.get("rel_err", 0) > 2e-2 for e in r.get("sweep", []))]
