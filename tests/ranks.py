"""Start N real rank processes on one host and collect their results; never hang.

The parent hosts a TCPStore on a free port (port 0); each child joins it, initializes a gloo
default group, runs `target(ctx, *args)` and writes its result to a file before a hard
`os._exit` (a thread stuck in a deadlocked collective must not keep the process alive). The
parent joins with a deadline and kills stragglers, so a test's worst case is its timeout.
"""
from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

EXIT_OK, EXIT_ERROR, EXIT_STALL = 0, 1, 3


@dataclass
class RankContext:
    rank: int
    world: int
    host: str
    port: int
    out_path: str

    def store(self, prefix: str = "") -> Any:
        """A fresh client connection to the side store (one per thread that uses it)."""
        import torch.distributed as dist
        s = dist.TCPStore(self.host, self.port, self.world, False, timeout=datetime.timedelta(seconds=60))
        return dist.PrefixStore(prefix, s) if prefix else s

    def write_result(self, result: Any) -> None:
        tmp = self.out_path + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(result, f)
        os.replace(tmp, self.out_path)


@dataclass
class RankOutcome:
    rank: int
    exitcode: int | None
    result: Any


def _child(rank: int, world: int, host: str, port: int, out_path: str,
           target: Callable, args: tuple, pg_timeout_s: float) -> None:
    import torch
    torch.set_num_threads(1)
    ctx = RankContext(rank, world, host, port, out_path)
    code = EXIT_OK
    try:
        import torch.distributed as dist
        dist.init_process_group("gloo", store=ctx.store("pg"), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        ctx.write_result(target(ctx, *args))
    except BaseException as e:
        ctx.write_result({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        code = EXIT_ERROR
    os._exit(code)  # no teardown: a collective thread may be deadlocked on purpose


def run_ranks(target: Callable, world: int, args: tuple = (), timeout_s: float = 120.0,
              pg_timeout_s: float = 300.0) -> list[RankOutcome]:
    """Run `target(ctx, *args)` on `world` rank processes; kills all of them at `timeout_s`."""
    import torch.distributed as dist
    from pdrollout.engine.runtime.local_ranks import start_process

    host = "127.0.0.1"
    store = dist.TCPStore(host, 0, world, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    with tempfile.TemporaryDirectory(prefix="pdrollout-ranks-") as tmp:
        outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world)]
        # forked from the forkserver, as the engine's ranks are (one per pytest worker, torch imported once)
        procs = [start_process(_child, (r, world, host, store.port, outs[r], target, args, pg_timeout_s), f"rank{r}")
                 for r in range(world)]
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:  # stragglers: the test must end even if a rank never does
            if p.is_alive():
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)
        res = []
        for r, p in enumerate(procs):
            val = None
            if os.path.exists(outs[r]):
                with open(outs[r], "rb") as f:
                    val = pickle.load(f)
            res.append(RankOutcome(r, p.exitcode, val))
    del store
    return res


def assert_ok(outs: list[RankOutcome]) -> None:
    """Every rank exited 0; else each failed rank's exit code, error and traceback, in full (a list
    in an assert message is cut to 240 characters, which hides which rank failed first and why)."""
    bad = [o for o in outs if o.exitcode != EXIT_OK]
    if bad:
        raise AssertionError("\n".join(
            f"rank {o.rank}: exit code {o.exitcode}\n"
            + (o.result.get("traceback") or o.result.get("error", "") if isinstance(o.result, dict) else repr(o.result))
            for o in bad))


def report_start(out_path: str, name: str) -> None:
    """A rank target for the start-up test: what the rank found when its target began."""
    import sys
    with open(out_path, "w") as f:
        f.write(f"{os.getppid()} {'torch' in sys.modules} {os.environ.get(name, '-')}")
