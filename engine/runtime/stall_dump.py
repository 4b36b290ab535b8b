"""Where every thread of a rank is when its group stalls (a GPU stall blocks host threads in CUDA
calls), written in one piece so ranks sharing stderr do not interleave line by line.
PDROLLOUT_STALL_NATIVE=DIR adds the native stacks (which CUDA or NCCL call each thread is in)
through py-spy, if installed, into DIR/rankN.txt."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import traceback

from ..protocol.exits import say


def dump_threads(rank: int) -> None:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [f"[rank {rank}] threads at the stall:"]
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame, limit=12))
        parts.append(f"--- rank {rank} thread {names.get(ident, ident)}\n{stack}")
    say("\n".join(parts))
    out = os.environ.get("PDROLLOUT_STALL_NATIVE")
    spy = shutil.which("py-spy")
    if out and spy:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
            subprocess.run([spy, "dump", "--native", "--pid", str(os.getpid())], stdout=f,
                           stderr=subprocess.STDOUT, timeout=120, check=False)
