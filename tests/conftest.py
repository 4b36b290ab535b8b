"""Shared fixtures: small random Qwen3-MoE checkpoints written by our own `checkpoint` module."""
from __future__ import annotations

import copy

import pytest

from pdrollout.engine.model.checkpoint import write_checkpoint
from pdrollout.engine.protocol.config import load_preset

TINY = load_preset("tiny")


def tiny_config(**overrides) -> dict:
    cfg = copy.deepcopy(TINY)
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The `tiny` preset, per-expert layout (the layout of real Hub checkpoints)."""
    return write_checkpoint(TINY, tmp_path_factory.mktemp("tiny"), seed=0)
