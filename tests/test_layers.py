"""The codebase's shape, checked: import contracts (pyproject's [tool.importlinter]: arrows only
downward, a torch-free protocol and scheduler, an operator that imports only the protocol layer),
the operator importable with torch absent, no import circle in the engine (deferred imports inside
functions included: a circle hidden in a function is still a circle), and no engine module past ~400 lines."""
from __future__ import annotations

import ast
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


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports, at any depth of the file (functions included)."""
    files = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}
    mods = {f"{package}.{m}" if m else package: p for m, p in files.items()}
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            out.update(n for n in names if n in mods and n != mod)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(comp) > 1:
                found.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_the_engine():
    assert not circles(import_graph(ROOT / "engine", "pdrollout.engine"))


def test_a_circle_through_a_deferred_import_is_found(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("x = 1\n\n\ndef later():\n    from .c import y\n")
    (tmp_path / "c.py").write_text("def y():\n    from pkg.a import x\n")
    (tmp_path / "d.py").write_text("from . import a\n")
    assert circles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.b", "pkg.c"]]
