"""Shared fixtures: small random Qwen3-MoE checkpoints written by our own `checkpoint` module."""
from __future__ import annotations

import copy
import os
import sys

import pytest

from pdrollout.engine.model.checkpoint import write_checkpoint
from pdrollout.engine.protocol.config import load_preset

TINY = load_preset("tiny")

# pytest names test modules `tests.<dir>.<file>`; rank processes start by spawn and unpickle their
# target by that name, so the repository root must be importable there too. Appended, not
# prepended: the root's `operator/` must never shadow the standard library's `operator`.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)


def tiny_config(**overrides) -> dict:
    cfg = copy.deepcopy(TINY)
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The `tiny` preset, per-expert layout (the layout of real Hub checkpoints)."""
    return write_checkpoint(TINY, tmp_path_factory.mktemp("tiny"), seed=0)
