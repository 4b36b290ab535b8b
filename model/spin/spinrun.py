"""Run the Promela models with spin: verification runs, counterexample trails, the conformance
enumeration. Stdlib only; the tests import it and `python model/spin/spinrun.py table` prints
the table of docs/DISTRIBUTED.md ("Model check").

A configuration is a dict of the model's macros (ranks.pml's header names them). `mode` says
how pan stores states: "exhaustive" (COLLAPSE compression, every reachable state stored) or
"bitstate" (a bit per hashed state: a partial search whose coverage pan reports).
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDERINGS = {"fine-grained": 0, "global-enqueue": 1, "global-complete": 2, "normal": 3, "isolation-only": 4}
ACTIVATIONS = {"on": 0, "off": 1, "auto": 2}
MEMLIM_MB = int(os.environ.get("PDROLLOUT_SPIN_MEMLIM_MB", "2048"))   # pan stops there: "incomplete"
COMPRESS = os.environ.get("PDROLLOUT_SPIN_COMPRESS", "0") == "1"


class SpinMissing(RuntimeError):
    pass


def tools() -> tuple[str, str]:
    spin, cc = shutil.which("spin"), shutil.which("cc") or shutil.which("gcc")
    if not spin or not cc:
        raise SpinMissing("spin and a C compiler are needed (Debian: apt-get install -y spin gcc; .ci/run installs spin)")
    return spin, cc


@dataclasses.dataclass
class Config:
    ranks: int = 4
    adp: int = 2
    epochs: int = 1
    boundaries: int = 2
    d_iters: int = 1
    ordering: str = "fine-grained"
    activation: str = "on"
    span: int | str = 1                 # 1..4 or "auto" (K in 1..4 per round)
    dispatch: str = "any"               # "any" (random/GPU) or "fifo" (CpuDevice's oldest first)
    d_sync: bool = False                # D launch waits for D's collectives (the CPU engine)
    p_sync: bool = False
    per_rank_ready: bool = False
    no_pre_d: bool = False
    no_post_d: bool = False
    check_order: bool = True

    def defines(self) -> list[str]:
        if self.span != "auto" and not (isinstance(self.span, int) and 1 <= self.span <= 4):
            raise ValueError(f"span must be 1..4 or 'auto', got {self.span!r}")
        if self.ranks % self.adp:
            raise ValueError(f"ADP {self.adp} does not divide {self.ranks} ranks")
        if not 2 <= self.ranks <= 4:
            raise ValueError("the model's group macros cover 2..4 ranks")
        d = dict(N=self.ranks, ADP=self.adp, E=self.epochs, B=self.boundaries, DI=self.d_iters,
                 ORDERING=ORDERINGS[self.ordering], ACTIVATION=ACTIVATIONS[self.activation],
                 SPAN=0 if self.span == "auto" else self.span, DISPATCH=1 if self.dispatch == "any" else 0,
                 DSYNC=int(self.d_sync), PSYNC=int(self.p_sync), PER_RANK_READY=int(self.per_rank_ready),
                 NO_PRE_D=int(self.no_pre_d), NO_POST_D=int(self.no_post_d), CHECK_ORDER=int(self.check_order))
        return [f"-D{k}={v}" for k, v in d.items()]

    def label(self) -> str:
        atp = self.ranks // self.adp
        parts = [f"{self.ranks} ranks ATP{atp}/ADP{self.adp}", self.ordering, f"activation {self.activation}",
                 f"span {self.span}", f"dispatch {self.dispatch}", "D sync" if self.d_sync else "D async",
                 f"E{self.epochs} B{self.boundaries} D{self.d_iters}"]
        for flag, text in ((self.per_rank_ready, "per-rank ready"), (self.no_pre_d, "NO rendezvous 1"),
                           (self.no_post_d, "NO rendezvous 2"), (not self.check_order, "order check off"),
                           (self.p_sync, "P sync")):
            if flag:
                parts.append(text)
        return ", ".join(parts)


@dataclasses.dataclass
class Result:
    config: Config
    mode: str
    states: int
    transitions: int
    depth: int
    errors: int
    error: str               # pan's first error line ("" when none)
    seconds: float
    complete: bool           # the search finished (not cut by MEMLIM or the depth limit)
    coverage: str            # bitstate: pan's hash factor; exhaustive: "all"
    output: str
    workdir: str | None = None


def _build(cfg: Config, mode: str, workdir: str, printf: bool = False) -> None:
    # gcc -O2 takes ~4 s on pan.c and runs ~3x faster than -O0 (1.3 s): worth it only for the
    # multi-million-state 4-rank spaces
    spin, cc = tools()
    for f in ("ranks.pml", "turnstile.pml", "controller.pml"):
        shutil.copy(HERE / f, workdir)
    run = subprocess.run([spin, *cfg.defines(), "-a", "ranks.pml"], cwd=workdir, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"spin -a failed:\n{run.stdout}{run.stderr}")
    flags = ["-O2" if cfg.ranks == 4 else "-O0", "-w", "-DSAFETY", f"-DMEMLIM={MEMLIM_MB}"]
    # uncompressed is about twice as fast; COLLAPSE fits four times the states into MEMLIM
    flags += ["-DBITSTATE"] if mode == "bitstate" else (["-DCOLLAPSE"] if COMPRESS else ["-DNOCOMP"])
    if printf:
        flags.append("-DPRINTF")
    run = subprocess.run([cc, *flags, "-o", "pan", "pan.c"], cwd=workdir, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"compiling pan failed:\n{run.stderr[-4000:]}")


def verify(cfg: Config, mode: str = "exhaustive", timeout_s: float = 600, keep: bool = False,
           bitstate_log2: int = 30) -> Result:
    """One pan run. `keep` leaves the work dir (with a trail when pan found an error)."""
    if mode not in ("exhaustive", "bitstate"):
        raise ValueError(f"mode must be exhaustive|bitstate, got {mode!r}")
    workdir = tempfile.mkdtemp(prefix="pdrollout-spin-")
    try:
        _build(cfg, mode, workdir)
        args = ["./pan", "-m3000000"] + ([f"-w{bitstate_log2}"] if mode == "bitstate" else [])
        t0 = time.monotonic()
        try:
            run = subprocess.run(["nice", "-n", "10", *args], cwd=workdir, capture_output=True, text=True,
                                 timeout=timeout_s)
            out = run.stdout + run.stderr
        except subprocess.TimeoutExpired as e:   # reported as an incomplete search, never as a pass
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            out += f"\npan stopped after the {timeout_s:.0f} s time limit (timeout)"
        dt = time.monotonic() - t0
        res = _parse(cfg, mode, out, dt)
        res.workdir = workdir if keep else None
        return res
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _num(pattern: str, text: str, cast=int, default=0):
    m = re.search(pattern, text)
    return cast(m.group(1)) if m else default


def _parse(cfg: Config, mode: str, out: str, seconds: float) -> Result:
    errors = _num(r"errors: (\d+)", out)
    first = next((ln.strip() for ln in out.splitlines()
                  if ln.startswith("pan:") and ("violated" in ln or "invalid end state" in ln)), "")
    complete = "MEMLIM bound" not in out and "max search depth too small" not in out and "(timeout)" not in out
    coverage = "all"
    if mode == "bitstate":
        coverage = f"hash factor {_num(r'hash factor: ([0-9.e+]+)', out, str, '?')}"
    return Result(cfg, mode, states=_num(r"(\d+) states, stored", out), transitions=int(_num(r"([0-9.e+]+) transitions", out, float, 0)),
                  depth=_num(r"depth reached (\d+)", out), errors=errors, error=first, seconds=seconds,
                  complete=complete and errors == 0, coverage=coverage, output=out)


def trail(res: Result) -> str:
    """`spin -t` replay of the counterexample a kept run found: the model's '@' lines and the
    final process states."""
    if not res.workdir:
        raise ValueError("run verify(..., keep=True) to replay its trail")
    spin, _ = tools()
    run = subprocess.run([spin, *res.config.defines(), "-t", "ranks.pml"], cwd=res.workdir,
                         capture_output=True, text=True, timeout=120)
    return run.stdout + run.stderr


def cleanup(res: Result) -> None:
    if res.workdir:
        shutil.rmtree(res.workdir, ignore_errors=True)
        res.workdir = None


def final_slots(trail_text: str) -> dict[int, tuple[int, int] | None]:
    """Each rank's slot at the end of a trail: (kind, id) of the op holding it, or None."""
    slots: dict[int, tuple[int, int] | None] = {}
    for ln in trail_text.splitlines():
        m = re.search(r"@ rank (\d+) slot (\d+):(\d+)", ln)
        if m:
            slots[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
            continue
        m = re.search(r"@ rank (\d+) done (\d+):(\d+)", ln)
        if m:
            slots[int(m.group(1))] = None
    return slots


KIND_NAMES = {1: "P:R", 2: "D:atp", 3: "D:dp"}


def conformance_transitions(emax: int = 2, bmax: int = 3) -> tuple[list[tuple[int, ...]], dict]:
    """Every reachable (state, event, args) -> (error, may, state') of conformance.pml."""
    spin, cc = tools()
    workdir = tempfile.mkdtemp(prefix="pdrollout-spin-conf-")
    try:
        for f in ("conformance.pml", "turnstile.pml", "controller.pml"):
            shutil.copy(HERE / f, workdir)
        subprocess.run([spin, f"-DEMAX={emax}", f"-DBMAX={bmax}", "-a", "conformance.pml"], cwd=workdir,
                       check=True, capture_output=True)
        subprocess.run([cc, "-O2", "-w", "-DSAFETY", "-DPRINTF", "-DNOREDUCE", "-o", "pan", "pan.c"],
                       cwd=workdir, check=True, capture_output=True)
        t0 = time.monotonic()
        run = subprocess.run(["./pan", "-m100000"], cwd=workdir, capture_output=True, text=True, timeout=300)
        stats = {"states": _num(r"(\d+) states, stored", run.stdout),
                 "errors": _num(r"errors: (\d+)", run.stdout), "seconds": time.monotonic() - t0}
        rows = {tuple(int(x) for x in ln.split()[1:]) for ln in run.stdout.splitlines() if ln.startswith("T ")}
        decisions = {tuple(int(x) for x in ln.split()[1:]) for ln in run.stdout.splitlines() if ln.startswith("C ")}
        stats["decisions"] = sorted(decisions)
        return sorted(rows), stats
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ---- the documented matrix -----------------------------------------------------------------
def matrix(scope: str = "ci") -> list[tuple[Config, str, str]]:
    """(config, mode, expectation) rows. expectation: "pass", or "deadlock"/"assert" for the
    variants that must yield a counterexample. scope "ci" is what tests/model runs (about a
    minute on two cores); "full" adds the larger bounds recorded in docs/DISTRIBUTED.md."""
    full = scope == "full"
    rows: list[tuple[Config, str, str]] = []
    add = lambda cfg, expect="pass", mode="exhaustive": rows.append((cfg, mode, expect))
    b2 = dict(epochs=2, boundaries=4, d_iters=2)        # 2 ranks: two epochs, spans 1..4 all differ
    b2a = dict(epochs=1, boundaries=4, d_iters=2)       # span auto chooses K per round: one epoch
    b3 = dict(epochs=1, boundaries=3, d_iters=2)
    b4 = dict(epochs=1, boundaries=2, d_iters=1)        # 4 ranks, the crossed ATP2/ADP2 topology
    for adp in (2, 1):
        for span in (1, 2, 3, 4):
            if adp == 2 or span == 1 or full:
                add(Config(2, adp, span=span, **b2))
        add(Config(2, adp, span="auto", **(b2 if full else b2a)))
        if adp == 2 or full:
            add(Config(2, adp, activation="auto", **b2))
            add(Config(2, adp, activation="auto", span="auto", **(b2 if full else b2a)))
            add(Config(2, adp, ordering="global-enqueue", **b2))
            add(Config(2, adp, ordering="global-enqueue", activation="auto", **b2))
    for adp in (3, 1):
        add(Config(3, adp, **b3))
        add(Config(3, adp, ordering="global-enqueue", **b3))
        if adp == 3 or full:
            add(Config(3, adp, activation="auto", span="auto", **(b3 if full else dict(b3, d_iters=1))))
    add(Config(4, 2, **b4))
    # global-complete, normal and activation off (= normal): safe when the device starts ops
    # oldest first or D's launch waits for D; crossed with an async D on a device that starts
    # any stream's head (a finding: docs/DISTRIBUTED.md, "Model check")
    for o, a in (("global-complete", "on"), ("normal", "on"), ("fine-grained", "off")):
        for ranks, adp, b in ((2, 2, b2), (4, 2, b4)):
            if ranks == 4 and not full and o != "global-complete":
                continue
            add(Config(ranks, adp, ordering=o, activation=a, dispatch="fifo", **b))
            add(Config(ranks, adp, ordering=o, activation=a, d_sync=True, **b))
            if ranks == 2:   # 4 ranks: bad_variants() and test_model_check's counterexample tests
                add(Config(ranks, adp, ordering=o, activation=a, check_order=False, **b), "deadlock")
    if full:
        rows.extend((cfg, "exhaustive", expect) for cfg, expect in bad_variants())
        add(Config(4, 2, per_rank_ready=True, **b4))
        add(Config(4, 2, span=2, **b4))
        add(Config(4, 2, ordering="global-enqueue", **b4))
        add(Config(4, 2, activation="auto", **b4))
        add(Config(4, 2, activation="auto", span="auto", **b4))
        add(Config(4, 2, epochs=2, boundaries=1, d_iters=1))
        add(Config(4, 2, **dict(b4, d_iters=2)))
        add(Config(4, 1, **b4))
        add(Config(4, 4, **b4))
        # past the exhaustive bounds: bitstate (a partial search; pan's hash factor says how partial).
        # activation auto + span auto at E2 B2 D2 did not finish in 25 min: not claimed.
        for o in ("fine-grained", "global-enqueue"):
            add(Config(4, 2, ordering=o, epochs=2, boundaries=3, d_iters=2), mode="bitstate")
    return rows


def bad_variants() -> list[tuple[Config, str]]:
    """The known-bad variants on the crossed 4-rank topology and what each must yield."""
    b4 = dict(epochs=1, boundaries=2, d_iters=1)
    return [
        (Config(4, 2, ordering="isolation-only", check_order=False, **b4), "deadlock"),
        (Config(4, 2, ordering="isolation-only", dispatch="fifo", check_order=False, **b4), "deadlock"),
        (Config(4, 2, ordering="isolation-only", dispatch="fifo", **b4), "assert"),          # ORDER
        (Config(4, 2, per_rank_ready=True, no_pre_d=True, **b4), "assert"),                 # AGREE at the ACK
        (Config(4, 2, per_rank_ready=True, no_pre_d=True, no_post_d=True, check_order=False, **b4), "deadlock"),
        (Config(4, 2, no_post_d=True, **b4), "assert"),                                     # OVERTAKE
        (Config(4, 2, ordering="global-complete", check_order=False, **b4), "deadlock"),
    ]


def outcome(res: Result) -> str:
    if res.errors == 0:
        return "pass" if res.complete else ("timeout" if "(timeout)" in res.output else "incomplete")
    return "deadlock" if "invalid end state" in res.error else "assert"


def table(scope: str = "full", out=sys.stdout) -> int:
    """Run the matrix and print a markdown table; returns the number of unexpected outcomes."""
    bad = 0
    print("| configuration | mode | expected | outcome | states | transitions | depth | seconds |", file=out)
    print("|---|---|---|---|---:|---:|---:|---:|", file=out)
    for cfg, mode, expect in matrix(scope):
        res = verify(cfg, mode)
        got = outcome(res)
        bad += got != expect
        mark = "" if got == expect else " **UNEXPECTED**"
        cov = "" if mode == "exhaustive" else f" ({res.coverage})"
        print(f"| {cfg.label()} | {mode}{cov} | {expect} | {got}{mark} | {res.states} | {res.transitions} | "
              f"{res.depth} | {res.seconds:.1f} |", file=out, flush=True)
    return bad


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "table":
        sys.exit(1 if table(sys.argv[2] if len(sys.argv) > 2 else "full") else 0)
    print("usage: python model/spin/spinrun.py table [ci|full]", file=sys.stderr)
    sys.exit(2)
