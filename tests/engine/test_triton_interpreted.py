"""The Triton kernels' own code on CPU. Triton's interpreter runs a kernel with numpy, but only if
TRITON_INTERPRET=1 is set before Triton is first imported (its standard library, `tl.sum` and the
rest, is made interpreted then), and other tests import Triton early through transformers. So the
interpreted tests (interp_*.py beside this file) run in a fresh pytest process each, and must all
pass there: a count short of the expected one fails here too."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
EXPECTED = {"interp_attention.py": 16, "interp_fused_moe.py": 36, "interp_norms.py": 14, "interp_paged_prefill.py": 19,
            "interp_prologue.py": 9, "interp_router.py": 16}   # tests in each file


def test_every_interpreted_module_is_run_here():
    assert sorted(p.name for p in HERE.glob("interp_*.py")) == sorted(EXPECTED)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("module", sorted(EXPECTED))
def test_kernels_under_the_triton_interpreter(module, tmp_path):
    """One single-threaded numpy process per module; `pytest -n` spreads the modules over workers."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / module)],
                       cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=840)
    assert r.returncode == 0 and f"{EXPECTED[module]} passed" in r.stdout, r.stdout[-6000:] + r.stderr[-2000:]
