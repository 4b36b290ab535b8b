"""A pytest session in one checkout that imports `pdrollout` from another (the shared venv's
editable install left pointing at the other) is refused, naming both. The shim's case (this
checkout's sources, as CI and e2e/lib/env.sh import them) is every other test of the session."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def second_checkout(at: Path) -> Path:
    """The minimal tree a test session needs: project file, sources, the root conftest and one test."""
    (at / "tests").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", at)
    shutil.copytree(ROOT / "engine", at / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("conftest.py", "checkout_guard.py", "procs.py"):
        shutil.copy(ROOT / "tests" / name, at / "tests")
    (at / "tests" / "test_one.py").write_text("def test_one():\n    pass\n")
    return at


def pytest_importing(checkout: Path, engine: Path, shim: Path) -> subprocess.CompletedProcess:
    """pytest run in `checkout` with `pdrollout.engine` importable only from `engine` (as an
    editable install or the shim would make it)."""
    (shim / "pdrollout").mkdir(parents=True)
    (shim / "pdrollout" / "engine").symlink_to(engine)
    env = {**os.environ, "PYTHONPATH": str(shim)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_one.py"],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=120)


def test_session_importing_another_checkout_is_refused(tmp_path):
    second = second_checkout(tmp_path / "second")
    run = pytest_importing(second, ROOT / "engine", tmp_path / "shim-first")
    out = run.stdout + run.stderr
    assert run.returncode == 4, out
    assert f"tests the checkout {second}" in out and f"imported from {ROOT}" in out, out
