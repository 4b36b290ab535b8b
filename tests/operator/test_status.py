"""Phase/conditions and group-restart decisions as pure functions."""
import logging
from datetime import datetime, timedelta, timezone

import pytest

from pdrollout.operator import group, status as st
from pdrollout.operator.engine_client import EngineMetrics, Health
from pdrollout.operator.models import Phase

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=timezone.utc)


def obs(**kw):
    base = dict(desired_nodes=2, ready_nodes=2, generation=3, observed_generation=3)
    return st.Observation(**{**base, **kw})


def conds(c):
    return {x.type.value: (x.status, x.reason) for x in c}


def test_running_when_all_ready_and_healthy():
    phase, c = st.decide(obs(health=Health(True, "HTTP 200: ok"), metrics=EngineMetrics()))
    assert phase is Phase.RUNNING
    assert conds(c) == {"Ready": ("True", "EngineHealthy"), "Progressing": ("False", "Converged"),
                        "Degraded": ("False", "EngineHealthy"), "Stalled": ("False", "NoStall")}


def test_starting_while_pods_come_up():
    phase, c = st.decide(obs(ready_nodes=1))
    assert phase is Phase.STARTING
    assert conds(c)["Progressing"] == ("True", "PodsStarting") and conds(c)["Ready"][0] == "False"


@pytest.mark.parametrize("reachable,reason", [(False, "EngineUnreachable"), (True, "EngineUnhealthy")])
def test_degraded_when_rank0_unhealthy(reachable, reason):
    phase, c = st.decide(obs(health=Health(False, "x", reachable=reachable)))
    assert phase is Phase.DEGRADED
    assert conds(c)["Degraded"] == ("True", reason) and conds(c)["Ready"] == ("False", reason)


def test_stalled_from_a_stall_exit_until_running_again():
    why = "engine of pod r-1 exited with the stall code 3"
    phase, c = st.decide(obs(restarting="container engine of pod r-1 restarted", stall=why))
    stalled = next(x for x in c if x.type.value == "Stalled")
    assert phase is Phase.RESTARTING and (stalled.status, stalled.reason, stalled.message) == \
        ("True", "EngineStalled", why)
    prev = stalled.model_dump(by_alias=True, mode="json")
    _, c = st.decide(obs(ready_nodes=1, previous_stalled=prev))          # group coming back: still True
    assert conds(c)["Stalled"] == ("True", "EngineStalled")
    _, c = st.decide(obs(health=Health(True, "ok"), previous_stalled=prev))   # running again
    assert conds(c)["Stalled"] == ("False", "Recovered")
    _, c = st.decide(obs(health=Health(True, "ok")))
    assert conds(c)["Stalled"] == ("False", "NoStall")


def test_stall_exit_is_read_from_the_engine_container():
    def pod_with(code, uid="u1", where="lastState"):
        return {"metadata": {"name": "r-1", "uid": uid}, "status": {"containerStatuses": [
            {"name": "engine", "restartCount": 1, where: {"terminated": {"exitCode": code,
                                                                          "finishedAt": "2026-11-30T10:00:00Z"}}}]}}
    key, msg = group.stall_exit([pod_with(3)])
    assert key == "u1/1/2026-11-30T10:00:00Z" and "stall code 3" in msg and "r-1" in msg
    assert group.stall_exit([pod_with(3, where="state")])[0] == key
    assert group.stall_exit([pod_with(4)]) is None                       # peer lost: a restart, not a stall
    assert "exit 4 (peer lost)" in group.pod_failure(pod_with(4))


def test_progressing_while_generation_not_observed():
    _, c = st.decide(obs(observed_generation=2, health=Health(True, "ok")))
    assert conds(c)["Progressing"] == ("True", "Reconciling")


def test_restarting_wins():
    phase, c = st.decide(obs(restarting="pod r-1 failed", health=Health(True, "ok")))
    assert phase is Phase.RESTARTING and conds(c)["Degraded"] == ("True", "GroupRestarting")


def test_a_template_update_is_progress_not_degradation():
    phase, c = st.decide(obs(ready_nodes=0, updating="pod template changed"))
    assert phase is Phase.UPDATING
    assert conds(c) == {"Ready": ("False", "GroupUpdating"), "Progressing": ("True", "GroupUpdating"),
                        "Degraded": ("False", "GroupUpdating"), "Stalled": ("False", "NoStall")}
    # A fault during the update is still a fault.
    phase, c = st.decide(obs(updating="pod template changed", restarting="pod r-1 failed"))
    assert phase is Phase.RESTARTING


def test_condition_transition_time_kept_while_status_unchanged():
    _, c1 = st.decide(obs(ready_nodes=1))
    first = st.merge_conditions([], c1, "T1")
    _, c2 = st.decide(obs(ready_nodes=1))
    second = st.merge_conditions(first, c2, "T2")
    assert all(c["lastTransitionTime"] == "T1" for c in second)
    _, c3 = st.decide(obs(health=Health(True, "ok")))
    third = {c["type"]: c["lastTransitionTime"] for c in st.merge_conditions(second, c3, "T3")}
    assert third["Ready"] == "T3" and third["Stalled"] == "T1"


def test_status_patch_keeps_last_figures_when_engine_away():
    p = st.status_patch(obs(), Phase.DEGRADED, [])
    assert "makespanSeconds" not in p and p["phase"] == "Degraded" and p["readyNodes"] == 2
    p = st.status_patch(obs(metrics=EngineMetrics(makespan_s=3.0, recent_ttft_p99_s=0.2, mean_decode_wait_s=0.01)),
                        Phase.RUNNING, [])
    assert (p["makespanSeconds"], p["recentTtftP99Seconds"], p["meanDecodeWaitSeconds"]) == (3.0, 0.2, 0.01)
    # What `kubectl get pdr` prints: milliseconds, not float noise.
    p = st.status_patch(obs(metrics=EngineMetrics(makespan_s=24.872143999999935, recent_ttft_p99_s=18.499999999999996,
                                                  mean_decode_wait_s=0.0012345678)), Phase.RUNNING, [])
    assert (p["makespanSeconds"], p["recentTtftP99Seconds"], p["meanDecodeWaitSeconds"]) == (24.872, 18.5, 0.001235)
    assert "stalls" not in p   # counted from engine exits by the handler, not from metrics


def pod(name, created=NOW, phase="Running", restarts=0, deleting=False, terminated=False):
    state = {"terminated": {"exitCode": 1}} if terminated else {"running": {}}
    meta = {"name": name, "creationTimestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ"), "uid": name}
    if deleting:
        meta["deletionTimestamp"] = "x"
    return {"metadata": meta, "status": {"phase": phase, "containerStatuses": [
        {"name": "engine", "restartCount": restarts, "state": state}]}}


def test_group_fault_detection():
    assert group.group_fault([pod("r-0"), pod("r-1")]) is None
    assert "r-1 failed" in group.group_fault([pod("r-0"), pod("r-1", phase="Failed")])
    assert "restarted (2x)" in group.group_fault([pod("r-0", restarts=2), pod("r-1")])
    assert "terminated" in group.group_fault([pod("r-0", terminated=True)])
    assert group.group_fault([pod("r-0", phase="Failed", deleting=True)]) is None
    recorded = {"r-0": "r-0", "r-1": "r-1"}
    assert group.group_fault([pod("r-0"), pod("r-1")], recorded) is None
    again = pod("r-1")
    again["metadata"]["uid"] = "new-uid"
    assert "r-1 was recreated without its group" in group.group_fault([pod("r-0"), again], recorded)
    assert group.group_fault([pod("r-0"), again], None) is None, "nothing recorded: nothing to compare"


def test_a_restart_forgets_the_old_group_even_when_the_status_read_trails(monkeypatch):
    """After a group restart the handler's memo says "no group recorded yet". An observer tick.s body can still
    carry the old groupPods (its watch event trails the status patch): the new group's pods must not
    look recreated alone, or one deleted pod costs two group restarts."""
    from types import SimpleNamespace
    from pdrollout.operator import handlers
    from pdrollout.operator.models import PDRolloutSpec
    deleted = []
    monkeypatch.setattr(handlers.kube, "delete_pods", lambda ns, pods: deleted.append(sorted(
        p["metadata"]["name"] for p in pods)))
    monkeypatch.setattr(handlers.events, "warn", lambda *a, **k: None)
    spec = PDRolloutSpec.model_validate({"image": "i", "model": {"path": "/m"}, "network": {"ibHCAs": ["mlx5_0"]},
                                         "topology": {"nodes": 2, "gpusPerNode": 1, "expertParallel": 2}})
    log = logging.getLogger("test")
    old = {"r-0": "r-0", "r-1": "r-1"}

    def tick(pods, status, memo):
        patch = SimpleNamespace(status={})
        return handlers._group_restart(spec, pods, status, memo, "ns", {}, patch, log), patch.status

    memo = {}
    again = pod("r-1")
    again["metadata"]["uid"] = "new-uid"
    why, patched = tick([pod("r-0"), again], {"groupPods": old}, memo)     # r-1 deleted by hand
    assert "recreated without its group" in why and deleted == [["r-0", "r-1"]]
    assert patched["groupRestarts"] == 1 and memo["group_pods"] is None
    new = [pod("r-0"), pod("r-1")]
    for p_ in new:
        p_["metadata"]["uid"] += "-2"
    stale = {"groupPods": old}          # this tick's body predates the restart's status patch
    why, patched = tick(new, stale, memo)
    assert why is None and deleted == [["r-0", "r-1"]], "no second restart"
    assert memo["group_pods"] == {"r-0": "r-0-2", "r-1": "r-1-2"} == patched["groupPods"]
    # a fresh operator process has no memo: the status's record is used
    why, _ = tick(new, {"groupPods": old}, {})
    assert "recreated without its group" in why


def test_membership_only_of_a_complete_group():
    assert group.membership([pod("r-0"), pod("r-1")], 2) == {"r-0": "r-0", "r-1": "r-1"}
    assert group.membership([pod("r-0"), pod("r-1", deleting=True)], 2) is None
    assert group.membership([pod("r-0")], 1) == {"r-0": "r-0"}


def test_backoff_doubles_to_cap():
    assert [group.backoff_s(n, 10, 60) for n in range(6)] == [0, 10, 20, 40, 60, 60]


def test_restart_waits_out_backoff():
    last = (NOW - timedelta(seconds=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    d = group.decide_restart("pod r-1 failed", streak=2, last_restart=last, now=NOW, base_s=10, cap_s=300)
    assert not d.restart_now and d.wait_s == pytest.approx(15) and "backoff" in d.reason
    d = group.decide_restart("pod r-1 failed", streak=0, last_restart=last, now=NOW, base_s=10, cap_s=300)
    assert d.restart_now and "recreating the whole group" in d.reason


def test_weight_version_reaches_status_and_is_kept_while_the_engine_is_away():
    o = obs(health=Health(True, "ok"), weight_version="step-3")
    phase, c = st.decide(o)
    patch = st.status_patch(o, phase, st.merge_conditions([], c, "t"))
    assert patch["weightVersion"] == "step-3"
    o = obs(health=Health(False, "x", reachable=False))
    phase, c = st.decide(o)
    assert "weightVersion" not in st.status_patch(o, phase, st.merge_conditions([], c, "t"))
