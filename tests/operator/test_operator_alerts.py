"""The chart's stall and degraded alerts, evaluated by promtool on series recorded from real scrapes of
the running operator's /metrics (against the real API server): an engine's stall exit (exit 3, as the
kubelet reports it) fires PDRolloutStalls, and a group whose pod stays Pending fires
PDRolloutGroupDegraded. Nothing is hand-written: each scrape becomes one sample of promtool's input.
test_real_nodes.py records the same alert over an engine that really stalls."""
import time
from pathlib import Path

import pytest
import yaml
from alert_recording import DEGRADED_FOR_S, SCRAPE_S, Recorder, at, promtool_test, stall_alert

from pdrollout.engine.protocol.exits import EXIT_STALL
from pod_launch import report_exit

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def _pods(cluster, ns: str, name: str) -> list[dict]:
    return cluster.get("pods", "-n", ns, "-l", f"pdrollout.io/rollout={name}")["items"]


def test_stall_and_degraded_alerts_fire_on_recorded_scrapes(cluster, tools, operator, namespace, tmp_path, wait):
    ns, url = namespace, f"http://{operator.env['PDROLLOUT_OPERATOR_METRICS_ADDRESS']}/metrics"
    doc = yaml.safe_load((ROOT / "examples/pdrollout.yaml").read_text())
    stalls = {**doc, "metadata": {"name": "stalls"}}
    # No node carries this label: the group's pod stays Pending.
    pending = {**doc, "metadata": {"name": "pending"},
               "spec": {**doc["spec"], "podTemplate": {"nodeSelector": {"pdrollout.io/no-such-pool": "x"}}}}
    with Recorder(url) as rec:
        for d in (stalls, pending):
            cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(d))
        pod = wait("the stalls pod Running", lambda: next((p for p in _pods(cluster, ns, "stalls")
                                                           if p["status"].get("phase") == "Running"), None), timeout=60)
        wait("the operator exporting both rollouts", lambda: rec.step and all(
            rec.value(rec.step - 1, "pdrollout_operator_group_desired_pods", namespace=ns, rollout=r) == 1
            for r in ("stalls", "pending")), timeout=60)
        assert _pods(cluster, ns, "pending")[0]["status"]["phase"] == "Pending"
        before_stall = rec.step
        report_exit(cluster, ns, pod, EXIT_STALL)
        wait("the stall counted", lambda: cluster.get("pdrollout", "stalls", "-n", ns)["status"].get("stalls") == 1,
             timeout=60)
        stall_seen = wait("a scrape that shows it", lambda: next((
            i for i in range(before_stall, rec.step)
            if rec.value(i, "pdrollout_operator_engine_stalls_total", namespace=ns, rollout="stalls") == 1), None),
            timeout=30)
        pending_from = next(i for i in range(rec.step) if rec.value(
            i, "pdrollout_operator_group_pods", namespace=ns, rollout="pending", phase="Pending") == 1)
        time.sleep(DEGRADED_FOR_S + 3 * SCRAPE_S)
        end = rec.step - 1
    assert end - pending_from > DEGRADED_FOR_S // SCRAPE_S + 1, "the recording must outlast the rule's `for`"

    labels = lambda name, sev: {"severity": sev, "namespace": ns, "rollout": name}   # noqa: E731
    promtool_test(tools, tmp_path, [
        {"interval": f"{SCRAPE_S}s", "input_series": rec.series(namespace=ns, rollout="stalls"),
         "alert_rule_test": [
             {"eval_time": at(before_stall - 1), "alertname": "PDRolloutStalls", "exp_alerts": []},
             {"eval_time": at(stall_seen + 1), "alertname": "PDRolloutStalls",
              "exp_alerts": [stall_alert(ns, "stalls")]}]},
        {"interval": f"{SCRAPE_S}s", "input_series": rec.series(namespace=ns, rollout="pending"),
         "alert_rule_test": [
             {"eval_time": at(pending_from + 1), "alertname": "PDRolloutGroupDegraded", "exp_alerts": []},
             {"eval_time": at(end), "alertname": "PDRolloutGroupDegraded", "exp_alerts": [{
                 "exp_labels": labels("pending", "warning"),
                 "exp_annotations": {"summary": f"PDRollout {ns}/pending is degraded",
                                     "description": "A pod of the group is Pending, the group is Degraded/"
                                                    "Restarting/Failed or an engine is not answering /metrics, "
                                                    f"for {DEGRADED_FOR_S}s."}}]}]}], len(rec.scrapes))
