"""How `pytest -n 2` (pytest-xdist, as .ci/run runs it) splits the suite between its two workers.

A unit of work is one test file, so a module's tests share its module-scoped servers, except the
operator tests: the control planes are session-scoped fixtures, so every test of the real-node cluster
(`real_cluster`, files tests/operator/test_real_*.py) is one lane and every other operator test (kwok's
`cluster`) another, each started once. The two lanes go first: they are the longest units and spend
most of their time waiting on Kubernetes, which leaves the CPU to the other worker's tests.

The unit is decided from the test's id alone: xdist's controller schedules ids, not items (and its own
`xdist_group` marks do not reach the ids under pytest 9.2). `check` holds the path rule to the
fixtures each test really uses."""
from __future__ import annotations

import pytest

OPERATOR = "tests/operator/"
REAL_NODES = OPERATOR + "test_real_"
LANES = ("real-nodes", "kwok")   # in the order they start


def unit_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    if path.startswith(REAL_NODES):
        return "real-nodes"
    if path.startswith(OPERATOR):
        return "kwok"
    return path


def check(items: list[pytest.Item]) -> None:
    """Fails the collection where a test's cluster fixture and its file disagree: such a test would
    start a second control plane on the other worker."""
    wrong = []
    for item in items:
        closure = getattr(item, "fixturenames", ())
        needs = "real-nodes" if "real_cluster" in closure else "kwok" if "cluster" in closure else None
        if needs and unit_of(item.nodeid) != needs:
            wrong.append(f"{item.nodeid} uses the {needs} cluster but runs in {unit_of(item.nodeid)!r}")
    if wrong:
        raise pytest.UsageError("tests/lanes.py: a cluster test outside its lane (move it, or its file, "
                                f"under {REAL_NODES}* or {OPERATOR}):\n" + "\n".join(wrong))


def order(items: list[pytest.Item]) -> None:
    """The lanes first; the rest keep their collection order. The same on every worker."""
    rank = {lane: i for i, lane in enumerate(LANES)}
    items.sort(key=lambda item: rank.get(unit_of(item.nodeid), len(LANES)))


def scheduler(config, log):
    """xdist's scope scheduling over `unit_of`'s units (units are handed out in collection order)."""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return LaneScheduling(config, log)
