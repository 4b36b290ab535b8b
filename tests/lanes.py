"""How `pytest -n 2` (pytest-xdist, as .ci/run runs it) splits the suite between its two workers.

A test that shares an expensive fixture with others must run on the worker that already holds it: the
control planes (`cluster`: kwok's; `real_cluster`: the real kubelets) are session-scoped, so all their
tests form one lane each, and a module's tests share its module-scoped servers, so they go as one unit.
Every other test is a unit of its own. The two cluster lanes go first: they are the longest units and
spend most of their time waiting on Kubernetes, which leaves the CPU to the other worker's tests."""
from __future__ import annotations

import pytest

# session-scoped fixture -> its lane, most expensive first (a test that needs both goes to the first)
LANES = {"real_cluster": "real-nodes", "cluster": "kwok"}
_SHARED = ("module", "class", "package")


def lane_of(item: pytest.Item) -> str | None:
    """The unit `item` runs in (None: a unit of its own)."""
    closure = getattr(item, "fixturenames", ())
    for fixture, lane in LANES.items():
        if fixture in closure:
            return lane
    defs = getattr(item, "_fixtureinfo", None)
    if defs is not None:
        for name in closure:
            if any(d.scope in _SHARED for d in defs.name2fixturedefs.get(name, ())):
                return item.nodeid.split("::", 1)[0]
    return None


def assign(items: list[pytest.Item]) -> None:
    """Marks every test with its unit (xdist_group) and puts the cluster lanes first. Identical on
    every worker (xdist checks that they collected the same list)."""
    order = list(LANES.values())
    for item in items:
        lane = lane_of(item)
        if lane is not None:
            item.add_marker(pytest.mark.xdist_group(lane))
    first = {lane: i for i, lane in enumerate(order)}

    def rank(item):
        lane = next((m.args[0] for m in item.iter_markers("xdist_group")), None)
        return first.get(lane, len(order))
    items.sort(key=rank)   # stable: the rest keep their collection order
