"""Refuses a test session whose `pdrollout` is imported from another place than the checkout
under test: the shared venv's editable install points at whichever checkout refreshed it last,
so without the shim (e2e/lib/env.sh) pytest would silently test another checkout's code."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def imported_engine() -> Path | None:
    """The directory `pdrollout.engine` is imported from (symlinks resolved: the shim links to it)."""
    spec = importlib.util.find_spec("pdrollout.engine")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def check(root: Path) -> None:
    want = (root / "engine").resolve()
    got = imported_engine()
    if got != want:
        raise pytest.UsageError(
            f"this session tests the checkout {root}, but `pdrollout` is imported from "
            f"{got.parent if got else 'nowhere (not installed)'}: run `source e2e/lib/env.sh && "
            f"pdrollout_venv` in {root} first (its shim puts this checkout's sources on PYTHONPATH)")
