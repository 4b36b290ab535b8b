"""The Triton kernels' own code on CPU. Triton's interpreter runs a kernel with numpy, but only if
TRITON_INTERPRET=1 is set before Triton is first imported (its standard library, `tl.sum` and the
rest, is made interpreted then), and other tests import Triton early through transformers. So the
interpreted tests (interp_*.py beside this file) run in a fresh pytest process each, and must all
pass there: a count short of the expected one fails here too."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
EXPECTED = {"interp_attention.py": 16, "interp_fused_moe.py": 36, "interp_norms.py": 14, "interp_paged_prefill.py": 19,
            "interp_prologue.py": 9, "interp_router.py": 16}   # tests in each file


def test_every_interpreted_module_is_run_here():
    assert sorted(p.name for p in HERE.glob("interp_*.py")) == sorted(EXPECTED)


@pytest.fixture(scope="module")
def interpreted_runs(tmp_path_factory):
    """Every module's interpreted run, at most one per core at a time: each is one single-threaded
    numpy process, so on CI's two cores two overlap instead of queuing."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    logs = tmp_path_factory.mktemp("interpreted")
    pending, running, done = sorted(EXPECTED), {}, {}
    deadline = time.monotonic() + 1200
    while pending or running:
        while pending and len(running) < max(1, min(2, os.cpu_count() or 1)):
            module = pending.pop(0)
            with open(logs / f"{module}.out", "w") as out, open(logs / f"{module}.err", "w") as err:
                running[module] = subprocess.Popen(
                    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / module)],
                    cwd=HERE.parents[1], env=env, stdout=out, stderr=err)
        for module, proc in list(running.items()):
            if proc.poll() is None and time.monotonic() > deadline:
                proc.kill()
                proc.wait()
            if proc.poll() is not None:
                del running[module]
                done[module] = (proc.returncode, (logs / f"{module}.out").read_text(),
                                (logs / f"{module}.err").read_text())
        time.sleep(0.5)
    return done


@pytest.mark.timeout(1500)   # the first one's setup runs them all
@pytest.mark.parametrize("module", sorted(EXPECTED))
def test_kernels_under_the_triton_interpreter(module, interpreted_runs):
    code, out, err = interpreted_runs[module]
    assert code == 0 and f"{EXPECTED[module]} passed" in out, out[-6000:] + err[-2000:]
