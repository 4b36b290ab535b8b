"""tests/lanes.py: the units `pytest -n N` hands out, their order, and the check that keeps a cluster
test in its lane; and a real `pytest -n 2` run over a small suite of its own (tests in a file with a
module fixture stay together, the others spread, each lane on one worker)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import lanes


def item(nodeid: str, *fixtures: str, shared: bool = False):
    scope = "module" if shared else "function"
    defs = {name: [SimpleNamespace(scope="session" if name == "tools" else scope)] for name in fixtures}
    return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixtures), _fixtureinfo=SimpleNamespace(name2fixturedefs=defs))


def test_a_test_is_a_unit_unless_its_file_shares_a_fixture_and_the_operator_tests_are_two_lanes():
    got = lanes.units([item("tests/a.py::t1", "tmp_path"), item("tests/a.py::t2[x::y]"),
                       item("tests/b.py::t1", "server", shared=True), item("tests/b.py::t2"),
                       item("tests/c.py::t1", "tools"),
                       item("tests/operator/test_real_fleet.py::f", "real_cluster"),
                       item("tests/operator/test_cluster.py::c", "cluster", shared=True),
                       item("tests/operator/test_builders.py::b")])
    assert got == {"tests/a.py::t1": "tests/a.py::t1", "tests/a.py::t2[x::y]": "tests/a.py::t2[x::y]",
                   "tests/b.py::t1": "tests/b.py", "tests/b.py::t2": "tests/b.py",
                   "tests/c.py::t1": "tests/c.py::t1",        # a session fixture is per worker: no reason to stay
                   "tests/operator/test_real_fleet.py::f": "real-nodes",
                   "tests/operator/test_cluster.py::c": "fake-nodes", "tests/operator/test_builders.py::b": "fake-nodes"}


def test_the_lanes_go_first_then_units_longest_first_each_units_tests_together_in_order():
    items = [item("tests/a.py::t1", "s", shared=True), item("tests/operator/test_cluster.py::c"), item("tests/b.py::t2"),
             item("tests/operator/test_real_nodes.py::r"), item("tests/a.py::t3"), item("tests/new.py::n"),
             item("tests/c.py::t4")]
    lanes.order(items, {"tests/a.py": 10.0, "tests/b.py::t2": 30.0, "tests/c.py::t4": 1.0, "fake-nodes": 0.0})
    # tests/new.py::n is not in the costs: the median unit (10 s), after the one it ties with
    assert [i.nodeid for i in items] == ["tests/operator/test_real_nodes.py::r", "tests/operator/test_cluster.py::c",
                                          "tests/b.py::t2", "tests/a.py::t1", "tests/a.py::t3", "tests/new.py::n",
                                          "tests/c.py::t4"]


def test_a_cluster_test_outside_its_lane_fails_the_collection():
    lanes.check([item("tests/operator/test_real_x.py::t", "real_cluster", "tools"),
                 item("tests/operator/test_gang.py::t", "cluster"), item("tests/server/test_s.py::t", "tiny_model")])
    with pytest.raises(pytest.UsageError, match=r"tests/server/test_s.py::t uses the fake-nodes cluster but runs in no lane"):
        lanes.check([item("tests/server/test_s.py::t", "cluster")])
    with pytest.raises(pytest.UsageError, match="test_fleet.py::t uses the real-nodes cluster but runs in fake-nodes"):
        lanes.check([item("tests/operator/test_fleet.py::t", "real_cluster", "cluster")])


def test_costs_come_from_a_junit_report_by_unit(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite>'
                   '<testcase classname="tests.a" name="t1" time="1.25"/><testcase classname="tests.a" name="t2" time="2"/>'
                   '<testcase classname="tests.b.TestK" name="t[1]" time="4"/>'
                   '<testcase classname="tests.gone" name="t" time="9"/></testsuite></testsuites>')
    unit = {"tests/a.py::t1": "tests/a.py", "tests/a.py::t2": "tests/a.py", "tests/b.py::TestK::t[1]": "tests/b.py::TestK::t[1]"}
    assert lanes.costs_from_junit(str(xml), unit) == {"tests/a.py": 3.2, "tests/b.py::TestK::t[1]": 4.0}


SUITE = {
    # the module-scoped fixture keeps this file's tests on one worker
    "tests/test_shared.py": """
import os, pytest
@pytest.fixture(scope="module")
def server():
    return os.getpid()
@pytest.mark.parametrize("i", range(4))
def test_s(server, i, record):
    record("shared", i, server)
""",
    # function fixtures only: each test is a unit of its own, so both workers get some
    "tests/test_split.py": """
import time, pytest
@pytest.mark.parametrize("i", range(6))
def test_p(i, record):
    time.sleep(0.5)
    record("split", i)
""",
    "tests/operator/test_real_a.py": """
import pytest
@pytest.mark.parametrize("i", range(2))
def test_r(i, record):
    record("real-nodes", i)
""",
    "tests/operator/test_k.py": """
import pytest
@pytest.mark.parametrize("i", range(3))
def test_k(i, record):
    record("fake-nodes", i)
""",
    "tests/conftest.py": """
import json, os, pytest
@pytest.fixture
def record():
    def write(kind, i, server=None):
        with open(os.environ["LANES_OUT"], "a") as f:
            f.write(json.dumps([kind, i, os.environ.get("PYTEST_XDIST_WORKER"), server]) + "\\n")
    return write
""",
}
COUNTS = {"shared": 4, "split": 6, "real-nodes": 2, "fake-nodes": 3}


def run_suite(tmp_path: Path, workers: int) -> dict[str, list]:
    root = tmp_path / f"n{workers}"
    for name, text in SUITE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    out = root / "ran.jsonl"
    env = {**os.environ, "LANES_OUT": str(out), "PYTHONPATH": f"{Path(lanes.__file__).parent}:{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", str(workers), "-p", "lanes", "-p", "no:cacheprovider",
                        "-p", "no:hypothesispytest", "-q", "--rootdir", str(root), "tests"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows: dict[str, list] = {}
    for line in out.read_text().splitlines():
        kind, i, worker, server = json.loads(line)
        rows.setdefault(kind, []).append((i, worker, server))
    assert {kind: sorted(i for i, _, _ in got) for kind, got in rows.items()} == \
        {kind: list(range(n)) for kind, n in COUNTS.items()}
    return {kind: [(worker, server) for _, worker, server in got] for kind, got in rows.items()}


def workers_of(rows, *kinds) -> set[str]:
    return {worker for kind in kinds for worker, _ in rows[kind]}


def test_pytest_n_2_puts_the_lanes_first_in_one_queue(tmp_path):
    rows = run_suite(tmp_path, 2)
    assert len(set(rows["shared"])) == 1 and len(workers_of(rows, "real-nodes")) == len(workers_of(rows, "fake-nodes")) == 1
    assert len(workers_of(rows, "split")) == 2, rows["split"]
