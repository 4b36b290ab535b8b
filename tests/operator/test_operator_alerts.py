"""The chart's stall and degraded alerts, evaluated by promtool on series recorded from real scrapes of
the running operator's /metrics (against the real API server): an engine's stall exit (exit 3, as the
kubelet reports it) fires PDRolloutStalls, and a group whose pod stays Pending fires
PDRolloutGroupDegraded. Nothing is hand-written: each scrape becomes one sample of promtool's input."""
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdrollout.engine.protocol.exits import EXIT_STALL
from pod_launch import report_exit

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdrollout-operator"
SCRAPE_S = 1            # the recording's cadence, and so promtool's interval
DEGRADED_FOR_S = 10     # the rule's `for`, rendered short so the test need not wait 5 minutes


class Recorder:
    """Scrapes a /metrics URL every SCRAPE_S on a fixed grid, as Prometheus does, keeping each text."""

    def __init__(self, url: str):
        self.url, self.scrapes, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self):
        t0 = time.monotonic()
        while not self._stop.is_set():
            try:
                text = urllib.request.urlopen(self.url, timeout=SCRAPE_S).read().decode()
            except OSError:
                text = None   # a failed scrape: no samples at this step (as `up` 0 would say)
            self.scrapes.append(text)
            self._stop.wait(max(0.0, t0 + len(self.scrapes) * SCRAPE_S - time.monotonic()))

    @property
    def step(self) -> int:
        """The index the next scrape will have."""
        return len(self.scrapes)

    def value(self, step: int, name: str, **labels: str) -> float | None:
        for fam in text_string_to_metric_families(self.scrapes[step] or ""):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return None

    def series(self, **match: str) -> list[dict]:
        """promtool input_series for every sample whose labels include `match` ('_' where absent)."""
        values: dict[str, list[str]] = {}
        for i, text in enumerate(self.scrapes):
            for fam in text_string_to_metric_families(text or ""):
                for s in fam.samples:
                    if any(s.labels.get(k) != v for k, v in match.items()):
                        continue
                    labels = {**s.labels, "job": "pdrollout-operator"}
                    key = s.name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
                    values.setdefault(key, ["_"] * len(self.scrapes))[i] = repr(float(s.value))
        return [{"series": k, "values": " ".join(v)} for k, v in sorted(values.items())]


def _rules(tools, tmp_path: Path) -> Path:
    r = subprocess.run([tools["helm"], "template", "pdr", str(CHART), "--namespace", "ops", "--kube-version", "1.34.0",
                        "--api-versions", "monitoring.coreos.com/v1/PrometheusRule",
                        "--set", f"monitoring.prometheusRule.degradedFor={DEGRADED_FOR_S}s",
                        "--set", "monitoring.prometheusRule.stallWindow=1m"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (rule,) = [d for d in yaml.safe_load_all(r.stdout) if d and d["kind"] == "PrometheusRule"]
    out = tmp_path / "rules.yaml"
    out.write_text(yaml.safe_dump(rule["spec"]))
    return out


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

    def at(step: int) -> str:
        return f"{step * SCRAPE_S}s"

    labels = lambda name, sev: {"severity": sev, "namespace": ns, "rollout": name}   # noqa: E731
    tests = {"rule_files": [str(_rules(tools, tmp_path))], "evaluation_interval": f"{SCRAPE_S}s", "tests": [
        {"interval": f"{SCRAPE_S}s", "input_series": rec.series(namespace=ns, rollout="stalls"),
         "alert_rule_test": [
             {"eval_time": at(before_stall - 1), "alertname": "PDRolloutStalls", "exp_alerts": []},
             {"eval_time": at(stall_seen + 1), "alertname": "PDRolloutStalls", "exp_alerts": [{
                 "exp_labels": labels("stalls", "critical"),
                 "exp_annotations": {"summary": f"PDRollout {ns}/stalls engines stalled",
                                     "description": "An engine exited with the stall code (3) in the last 1m; "
                                                    "the Stalled condition has the pod."}}]}]},
        {"interval": f"{SCRAPE_S}s", "input_series": rec.series(namespace=ns, rollout="pending"),
         "alert_rule_test": [
             {"eval_time": at(pending_from + 1), "alertname": "PDRolloutGroupDegraded", "exp_alerts": []},
             {"eval_time": at(end), "alertname": "PDRolloutGroupDegraded", "exp_alerts": [{
                 "exp_labels": labels("pending", "warning"),
                 "exp_annotations": {"summary": f"PDRollout {ns}/pending is degraded",
                                     "description": "A pod of the group is Pending, the group is Degraded/"
                                                    "Restarting/Failed or an engine is not answering /metrics, "
                                                    f"for {DEGRADED_FOR_S}s."}}]}]}]}
    spec = tmp_path / "alerts_test.yaml"
    spec.write_text(yaml.safe_dump(tests, width=1 << 20))
    r = subprocess.run([tools["promtool"], "test", "rules", str(spec)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{r.stdout}{r.stderr}\n(recorded {len(rec.scrapes)} scrapes; test in {spec})"
