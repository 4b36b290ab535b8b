"""The spin model's runner (model/spin/spinrun.py) for the model-check tests."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "model" / "spin"))
import spinrun  # noqa: E402


@pytest.fixture(scope="session")
def spin():
    try:
        spinrun.tools()
    except spinrun.SpinMissing as e:   # CI installs it (.ci/run): a missing tool is a failure
        pytest.fail(str(e))
    return spinrun
