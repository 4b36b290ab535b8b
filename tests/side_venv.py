"""A program with its own dependencies (sglang-router, sglang's bench) in a venv of its own under
${PDROLLOUT_CACHE:-~/.cache/pdrollout}/NAME, built once under a lock and reused."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path


class SideVenvError(RuntimeError):
    pass


def side_venv(name: str, requirement: str, timeout: int) -> Path:
    """The venv's directory, with `requirement` installed; SideVenvError (pip's tail) when it cannot be."""
    cache = Path(os.environ.get("PDROLLOUT_CACHE") or Path.home() / ".cache" / "pdrollout")
    venv = cache / name
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # one builder at a time
        if not (venv / ".ready").exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", requirement],
                               capture_output=True, text=True, timeout=timeout)
            if r.returncode != 0:
                raise SideVenvError(f"cannot install {requirement}: {r.stderr[-2000:]}")
            (venv / ".ready").write_text("")
    return venv
