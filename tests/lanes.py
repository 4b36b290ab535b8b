"""How `pytest -n N` (pytest-xdist, as .ci/run runs it) splits the suite between its workers.

A unit of work is one test, or one whole file where a test of it uses a fixture wider than a test
(module, class or package scope: its servers are shared, so its tests stay on one worker). The
operator tests are two lanes: their control planes are session-scoped fixtures, so every test of the
real-node cluster (`real_cluster`, files tests/operator/test_real_*.py) is one lane and every other
operator test (the fake nodes' `cluster`) another, each started once. The lanes go first (they are the
longest units; on a fresh machine they wait for .ci/run's builds); then the units, longest first by
tests/costs.json (seconds per unit from a measured run; `python tests/lanes.py JUNIT_XML` rewrites
it), so no long unit starts last.

xdist's controller schedules test ids and never sees the items, so the workers, which collect the
same items, write each id's unit to a file the controller reads before it hands out any work
(`pytest_configure_node` passes the path). `check` holds the lanes' path rule to the fixtures each
test really uses."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import pytest

OPERATOR = "tests/operator/"
REAL_NODES = OPERATOR + "test_real_"
LANES = ("real-nodes", "fake-nodes")   # in the order they start
COSTS = Path(__file__).with_name("costs.json")
SHARED_SCOPES = ("class", "module", "package")


def lane_of(nodeid: str) -> str | None:
    path = nodeid.split("::", 1)[0]
    if path.startswith(REAL_NODES):
        return "real-nodes"
    if path.startswith(OPERATOR):
        return "fake-nodes"
    return None


def _shares_a_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:      # not a function test (a doctest, say): keep it with its file
        return True
    return any(defs and defs[-1].scope in SHARED_SCOPES for defs in info.name2fixturedefs.values())


def units(items) -> dict[str, str]:
    """nodeid -> unit: its lane, its file (a test there shares a fixture wider than a test), or itself."""
    shared = {item.nodeid.split("::", 1)[0] for item in items if _shares_a_fixture(item)}
    out = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        out[item.nodeid] = lane_of(item.nodeid) or (path if path in shared else item.nodeid)
    return out


def check(items) -> None:
    """Fails the collection where a test's cluster fixture and its file disagree: such a test would
    start a second control plane on the other worker."""
    wrong = []
    for item in items:
        closure = getattr(item, "fixturenames", ())
        needs = "real-nodes" if "real_cluster" in closure else "fake-nodes" if "cluster" in closure else None
        if needs and lane_of(item.nodeid) != needs:
            wrong.append(f"{item.nodeid} uses the {needs} cluster but runs in {lane_of(item.nodeid) or 'no lane'}")
    if wrong:
        raise pytest.UsageError("tests/lanes.py: a cluster test outside its lane (move it, or its file, "
                                f"under {REAL_NODES}* or {OPERATOR}):\n" + "\n".join(wrong))


def load_costs(path: Path = COSTS) -> dict[str, float]:
    return json.loads(path.read_text()) if path.exists() else {}


def order(items, costs: dict[str, float]) -> dict[str, str]:
    """Sorts `items` in place: the lanes, then units by cost, longest first (a unit missing from
    `costs`, a new test, counts as the median unit). The sort is stable and xdist queues a unit where
    its first test is, so a unit's tests keep their order. The same on every worker. Returns the units."""
    unit = units(items)
    default = statistics.median(costs.values()) if costs else 0.0
    rank = {lane: i for i, lane in enumerate(LANES)}

    def key(item):
        u = unit[item.nodeid]
        return rank.get(u, len(LANES)), -costs.get(u, default)

    items.sort(key=key)
    return unit


# --- the plugin (tests/conftest.py loads it; `-p lanes` elsewhere) ---------------------------------

def pytest_collection_modifyitems(config, items):
    check(items)
    publish(config, order(items, load_costs()))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Controller side: the file the workers' collection writes the units to."""
    config = node.config
    if not hasattr(config, "_lanes_units_file"):
        config._lanes_units_file = os.path.join(tempfile.mkdtemp(prefix="pdr-lanes-"), "units.json")
    node.workerinput["lanes_units_file"] = config._lanes_units_file


def pytest_unconfigure(config):
    if hasattr(config, "_lanes_units_file"):
        shutil.rmtree(os.path.dirname(config._lanes_units_file), ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """-n N: these units, unless --dist names another scheduling."""
    return scheduler(config, log) if config.getvalue("dist") == "load" else None


def publish(config, unit: dict[str, str]) -> None:
    """Worker side: every worker collects the same items; each writes the same file, whole."""
    path = getattr(config, "workerinput", {}).get("lanes_units_file")
    if path:
        tmp = f"{path}.{os.getpid()}"
        Path(tmp).write_text(json.dumps(unit))
        os.replace(tmp, path)


def scheduler(config, log):
    """xdist's scope scheduling over the units the workers wrote (handed out in the collected order)."""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        unit: dict[str, str] = {}

        def schedule(self):
            if self.collection is None and self.collection_is_completed:
                self.unit = json.loads(Path(config._lanes_units_file).read_text())
            return super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            return self.unit.get(nodeid) or lane_of(nodeid) or nodeid.split("::", 1)[0]

    return LaneScheduling(config, log)


def junit_key(nodeid: str) -> tuple[str, str]:
    """(classname, name) of a test id as pytest's JUnit XML writes it."""
    *scope, name = nodeid.split("::")
    return ".".join([scope[0].removesuffix(".py").replace("/", "."), *scope[1:]]), name


def costs_from_junit(xml_path: str, unit: dict[str, str]) -> dict[str, float]:
    """Seconds per unit (setup, call and teardown together) from a JUnit XML report of a run, for
    the ids in `unit` (nodeid -> unit); tests the report lacks (skipped, deselected) cost nothing."""
    import xml.etree.ElementTree as ET

    by_key = {junit_key(nodeid): u for nodeid, u in unit.items()}
    out: dict[str, float] = {}
    for case in ET.parse(xml_path).iter("testcase"):
        u = by_key.get((case.get("classname", ""), case.get("name", "")))
        if u is not None:
            out[u] = round(out.get(u, 0.0) + float(case.get("time") or 0), 1)
    return dict(sorted(out.items()))


def main(xml_path: str) -> None:
    """Collects the suite as .ci/run does and writes tests/costs.json from XML_PATH's times."""
    class Collect:
        unit: dict[str, str] = {}

        def pytest_collection_finish(self, session):
            self.unit = units(session.items)

    collect = Collect()
    code = pytest.main(["--collect-only", "-q", "-m", "not gpu", "-p", "no:cacheprovider"], plugins=[collect])
    if code != 0 or not collect.unit:
        sys.exit(f"collection failed ({code})")
    costs = costs_from_junit(xml_path, collect.unit)
    COSTS.write_text(json.dumps(costs, indent=0, sort_keys=True) + "\n")
    print(f"{COSTS}: {len(costs)} units, {sum(costs.values()) / 60:.0f} min in all", file=sys.stderr)


if __name__ == "__main__":   # python tests/lanes.py JUNIT_XML (from the repository root, in the venv)
    main(sys.argv[1])
