"""tests/lanes.py: the units `pytest -n 2` hands out, and the check that keeps a cluster test in its lane."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import lanes


def item(nodeid: str, *fixtures: str):
    return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixtures))


def test_units_are_files_and_the_operator_tests_two_lanes():
    assert lanes.unit_of("tests/server/test_chat.py::test_a[x::y]") == "tests/server/test_chat.py"
    assert lanes.unit_of("tests/operator/test_real_fleet.py::test_f") == "real-nodes"
    assert lanes.unit_of("tests/operator/test_cluster.py::test_c") == "kwok"
    assert lanes.unit_of("tests/operator/test_builders.py::test_b") == "kwok"


def test_the_lanes_go_first_and_the_rest_keep_their_order():
    items = [item("tests/a.py::t1"), item("tests/operator/test_cluster.py::c"), item("tests/b.py::t2"),
             item("tests/operator/test_real_nodes.py::r"), item("tests/a.py::t3")]
    lanes.order(items)
    assert [i.nodeid for i in items] == ["tests/operator/test_real_nodes.py::r", "tests/operator/test_cluster.py::c",
                                          "tests/a.py::t1", "tests/b.py::t2", "tests/a.py::t3"]


def test_a_cluster_test_outside_its_lane_fails_the_collection():
    lanes.check([item("tests/operator/test_real_x.py::t", "real_cluster", "tools"),
                 item("tests/operator/test_gang.py::t", "cluster"), item("tests/server/test_s.py::t", "tiny_model")])
    with pytest.raises(pytest.UsageError, match=r"tests/server/test_s.py::t uses the kwok cluster but runs in "
                                                r"'tests/server/test_s.py'"):
        lanes.check([item("tests/server/test_s.py::t", "cluster")])
    with pytest.raises(pytest.UsageError, match="test_fleet.py::t uses the real-nodes cluster but runs in 'kwok'"):
        lanes.check([item("tests/operator/test_fleet.py::t", "real_cluster", "cluster")])
