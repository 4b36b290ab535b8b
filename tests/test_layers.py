"""The codebase's shape, checked: import contracts (pyproject's [tool.importlinter]: arrows only
downward, a torch-free protocol and scheduler, an operator that imports only the protocol layer),
the operator importable with torch absent, and no engine module past ~400 lines."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 420   # "a module over ~400 lines is asking to be split along a noun"


def _lint(config: Path | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports") or pytest.fail("lint-imports is not installed (pip install import-linter)")
    args = [exe, "--no-cache"] + (["--config", str(config)] if config else [])
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    r = _lint()
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in r.stdout


def test_the_linter_sees_a_broken_contract(tmp_path):
    """The check can fail: a contract the code breaks (the scheduler imports the protocol) is reported."""
    cfg = tmp_path / "contracts.ini"
    cfg.write_text("[importlinter]\nroot_packages =\n    pdrollout.engine\n\n"
                   "[importlinter:contract:bad]\nname = scheduler without protocol\ntype = forbidden\n"
                   "source_modules =\n    pdrollout.engine.scheduler\nforbidden_modules =\n    pdrollout.engine.protocol\n")
    r = _lint(cfg)
    assert r.returncode != 0 and "scheduler without protocol BROKEN" in r.stdout, r.stdout[-3000:]
    assert "pdrollout.engine.scheduler.scheduler -> pdrollout.engine.protocol" in r.stdout


def test_operator_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import pdrollout.operator.handlers, pdrollout.operator.crd, pdrollout.operator.__main__\n"
            "try:\n    import pdrollout.engine.runtime.worker\nexcept ImportError:\n    print('torch blocked')\n"
            "print('operator ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["torch", "blocked", "operator", "ok"], r.stdout   # the block was real


def test_no_engine_module_past_the_size_limit():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / "engine").rglob("*.py")}
    over = {p: n for p, n in sizes.items() if n > MAX_LINES}
    assert not over, f"split these along a noun: {over}"
