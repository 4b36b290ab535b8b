"""The engine's HTTP contract as the operator uses it (docs/ENGINE_API.md): /health, /metrics, /control.
Blocking stdlib HTTP, called from kopf's handler threads; every failure becomes an EngineError."""
from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from pdrollout.engine.protocol import metrics as metric

TIMEOUT_S = 3.0


class EngineError(Exception):
    """The engine could not be reached or answered outside its contract."""


def _request(url: str, method: str = "GET", body: dict | None = None, token: str | None = None
             ) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:  # a non-2xx answer is still an answer
        return e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        raise EngineError(f"{method} {url}: {getattr(e, 'reason', e)}") from None


def base_url(pod_ip: str, port: int) -> str:
    return f"http://{pod_ip}:{port}"


@dataclass(frozen=True)
class Health:
    ok: bool
    detail: str
    reachable: bool = True


def health(url: str) -> Health:
    try:
        code, raw = _request(f"{url}/health")
    except EngineError as e:
        return Health(ok=False, detail=str(e), reachable=False)
    try:
        status = json.loads(raw).get("status", "")
    except (ValueError, AttributeError):
        status = raw[:80].decode(errors="replace")
    return Health(ok=code == 200, detail=f"HTTP {code}: {status}")


def get_control(url: str) -> dict:
    code, raw = _request(f"{url}/control")
    if code != 200:
        raise EngineError(f"GET {url}/control: HTTP {code}: {raw[:200]!r}")
    return json.loads(raw)


def put_control(url: str, control: dict, token: str | None = None) -> dict:
    """PUT /control, an admin route: `token` is the rollout's admin bearer token."""
    code, raw = _request(f"{url}/control", "PUT", control, token)
    if code != 200:
        raise EngineError(f"PUT {url}/control: HTTP {code}: {raw[:200]!r}")
    return json.loads(raw)


def weight_version(url: str) -> str:
    """The engine's weight version (SGLang's GET /get_weight_version)."""
    code, raw = _request(f"{url}/get_weight_version")
    if code != 200:
        raise EngineError(f"GET {url}/get_weight_version: HTTP {code}: {raw[:200]!r}")
    try:
        version = json.loads(raw)["weight_version"]
    except (ValueError, KeyError, TypeError):
        raise EngineError(f"GET {url}/get_weight_version: no weight_version in {raw[:200]!r}") from None
    if not isinstance(version, str):
        raise EngineError(f"GET {url}/get_weight_version: weight_version is not a string: {version!r}")
    return version


@dataclass(frozen=True)
class EngineMetrics:
    makespan_s: float | None = None
    recent_ttft_p99_s: float | None = None   # exact p99 of the engine's last TTFT_WINDOW first tokens
    mean_decode_wait_s: float | None = None


def parse_metrics(text: str) -> EngineMetrics:
    """The rollout figures the status shows, from the engine's Prometheus text (summed over labels).
    TTFT is the engine's own recent p99 (a value some request saw), not an interpolation over the
    histogram's buckets, which are seconds wide where TTFTs of an RL rollout lie."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    count = sums.get(metric.DECODE_WAIT + "_count")
    makespan = sums.get(metric.ROLLOUT_MAKESPAN)
    finished = sums.get(metric.total(metric.ROLLOUTS_FINISHED))
    ttft = sums.get(metric.TTFT_RECENT_P99)
    return EngineMetrics(
        makespan_s=makespan if finished else None,  # the gauge means nothing before a rollout finished
        recent_ttft_p99_s=ttft if ttft is not None and math.isfinite(ttft) else None,   # NaN: no request yet
        mean_decode_wait_s=sums[metric.DECODE_WAIT + "_sum"] / count if count else None,
    )


def metrics(url: str) -> EngineMetrics:
    code, raw = _request(f"{url}/metrics")
    if code != 200:
        raise EngineError(f"GET {url}/metrics: HTTP {code}")
    try:
        return parse_metrics(raw.decode())
    except ValueError as e:
        raise EngineError(f"GET {url}/metrics: unparsable Prometheus text: {e}") from None
