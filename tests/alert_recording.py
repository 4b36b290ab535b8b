"""Alert rules evaluated on recorded scrapes: a Recorder scrapes a /metrics URL on a fixed grid, as
Prometheus does, and turns the scrapes into promtool's input series; `rules` renders the chart's
PrometheusRule with short windows. Used by tests/operator/test_operator_alerts.py (fake nodes) and
test_real_nodes.py (a real stall)."""
from __future__ import annotations

import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "pdrollout-operator"
SCRAPE_S = 1            # the recording's cadence, and so promtool's interval
DEGRADED_FOR_S = 10     # the rule's `for`, rendered short so a test need not wait 5 minutes


def _urlopen(url: str) -> str | None:
    try:
        return urllib.request.urlopen(url, timeout=SCRAPE_S).read().decode()
    except OSError:
        return None


class Recorder:
    """Scrapes a /metrics URL every SCRAPE_S on a fixed grid, keeping each text (None: a failed scrape, no
    samples at that step, as `up` 0 would say). `fetch` reads one scrape (default: urllib from here)."""

    def __init__(self, url: str, fetch: Callable[[str], str | None] = _urlopen):
        self.url, self.fetch, self.scrapes, self._stop = url, fetch, [], threading.Event()
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
            self.scrapes.append(self.fetch(self.url))
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


def at(step: int) -> str:
    """promtool's eval_time of a recording step."""
    return f"{step * SCRAPE_S}s"


def rules(tools, tmp_path: Path) -> Path:
    """The chart's PrometheusRule spec, `for` and the stall window short."""
    import yaml
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


def stall_alert(ns: str, rollout: str) -> dict:
    """PDRolloutStalls as the chart's rule fires it for one rollout."""
    return {"exp_labels": {"severity": "critical", "namespace": ns, "rollout": rollout},
            "exp_annotations": {"summary": f"PDRollout {ns}/{rollout} engines stalled",
                                "description": "An engine exited with the stall code (3) in the last 1m; "
                                               "the Stalled condition has the pod."}}


def promtool_test(tools, tmp_path: Path, tests: list[dict], recorded: int) -> None:
    """Run promtool's rule tests on the chart's rules; fails with promtool's own output."""
    import yaml
    spec = tmp_path / "alerts_test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(rules(tools, tmp_path))], "evaluation_interval": f"{SCRAPE_S}s",
                                    "tests": tests}, width=1 << 20))
    r = subprocess.run([tools["promtool"], "test", "rules", str(spec)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{r.stdout}{r.stderr}\n(recorded {recorded} scrapes; test in {spec})"
