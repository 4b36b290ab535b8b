"""What the kernel tests under Triton's interpreter (tests/engine/interp_*.py) share. Each of those
files runs in a pytest process of its own with TRITON_INTERPRET=1 (test_triton_interpreted.py):
`from interp import interpreted, rel` there makes every test check that it really is interpreted."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def interpreted():
    assert os.environ.get("TRITON_INTERPRET") == "1", \
        "run through tests/engine/test_triton_interpreted.py (TRITON_INTERPRET=1 before Triton's first import)"


def rel(a, b) -> float:
    """Relative L2 error of a against b, in fp64."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
