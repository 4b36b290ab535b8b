"""A program with its own dependencies (sglang-router, sglang's bench) in a venv of its own under
${PDROLLOUT_CACHE:-~/.cache/pdrollout}/NAME, built once under a lock and reused."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import sysconfig
from pathlib import Path


class SideVenvError(RuntimeError):
    pass


def side_venv(name: str, requirement: str, timeout: int, *, beside_ours: tuple[str, ...] = ()) -> Path:
    """The venv's directory, with `requirement` installed; SideVenvError (pip's tail) when it cannot be.

    With `beside_ours`, the venv sees this venv's packages (torch, transformers, ...) after its own,
    and `requirement` and the listed pins are installed without their dependencies: the program
    gets only what its imports need that ours lacks, not a second torch with CUDA wheels. The name
    is keyed by this venv, so a rebuilt one gets a fresh side venv."""
    cache = Path(os.environ.get("PDROLLOUT_CACHE") or Path.home() / ".cache" / "pdrollout")
    if beside_ours:
        name += "-on-" + Path(sys.prefix).name
    venv = cache / name
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # one builder at a time
        if not (venv / ".ready").exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)], check=True)
            pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                   "--disable-pip-version-check"]
            if beside_ours:
                site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                      capture_output=True, text=True, check=True).stdout.strip()
                Path(site, "zz-beside-ours.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
                pip.append("--no-deps")
            r = subprocess.run([*pip, requirement, *beside_ours], capture_output=True, text=True, timeout=timeout)
            if r.returncode != 0:
                raise SideVenvError(f"cannot install {requirement}: {r.stderr[-2000:]}")
            (venv / ".ready").write_text("")
    return venv
