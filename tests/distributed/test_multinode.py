"""One engine across pods: two "pods" as two process trees on loopback, started with exactly the
command, args and env the operator's builders produce for a 2-node × 2-rank `device: cpu`
PDRollout (only pod-specific values resolved, e2e/harness/pod_launch.py), form one 4-rank engine
(ATP2/ADP2, EP4) in pd mode. Node 0 serves the API; node 1 serves /health (ready only after the
join) and /metrics for its ranks. Greedy tokens equal a one-rank `pdrollout generate` on the same
checkpoint and engine config. Killing node 1's tree mid-run ends node 0 with the peer-lost code
within the watchdog bound, with in-flight requests answered, not hung."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from pdrollout.engine.protocol.exits import EXIT_PEER_LOST
from pdrollout.engine.runtime.options import RankOptions
from pdrollout.operator import builders
from pdrollout.operator.models import PDRolloutSpec
from pod_launch import free_port, get_text, health, http, launch, metric, wait_health, write_config, write_secret

pytestmark = pytest.mark.timeout(600)
PROMPTS = [[(i * 37 + k * 11) % 500 + 2 for k in range(3 + 9 * i)] for i in range(4)]
WATCHDOG_BOUND_S = RankOptions().watchdog_bound_s   # the operator's command sets none: the default


@pytest.fixture
def group(tiny_model, tmp_path):
    """Both pods of a `device: cpu` rollout, node 1 started first (it must wait for node 0)."""
    spec = PDRolloutSpec.model_validate({
        "image": "pdrollout/engine-cpu:test", "model": {"path": str(tiny_model), "dtype": "float32"},
        "device": "cpu", "port": free_port(),
        "topology": {"nodes": 2, "gpusPerNode": 2, "expertParallel": 4, "attentionDataParallel": 2},
        "multiplexing": {"activation": "on", "ordering": "fine-grained", "span": 1, "prefillBudgetTokens": 24}})
    name, ns = "tiny", "t"
    net = f"127.{random.randint(1, 250)}.{random.randint(1, 250)}"   # two loopback "pod IPs" of our own
    ips = [f"{net}.2", f"{net}.3"]
    container = builders.statefulset(name, ns, spec)["spec"]["template"]["spec"]["containers"][0]
    config = write_config(builders.configmap(name, ns, spec), tmp_path / "config", ips[0], free_port())
    secret = write_secret(builders.admin_secret(name, ns, "t" * 64), tmp_path / "admin")
    pods: dict[int, object] = {}

    def start(node: int):
        pods[node] = launch(container, pod_name=f"{name}-{node}", node_rank=node, pod_ip=ips[node],
                            config_dir=config, log=tmp_path / f"{name}-{node}.log", secret_dir=secret)
        return pods[node]
    urls = [f"http://{ip}:{spec.port}" for ip in ips]
    yield spec, config, start, urls, pods
    for p in pods.values():
        p.kill_tree()
        p.proc.wait(30)


def _generate(url: str, prompt: list[int], n: int) -> dict:
    status, body = http(f"{url}/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True}}, timeout=300)
    assert status == 200, body
    return body


def _one_rank(model, config) -> list[list[int]]:
    """`pdrollout generate` on one rank with the same engine config file the pods read."""
    reqs = "".join(json.dumps({"rid": f"r{i}", "input_ids": p, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}) + "\n" for i, p in enumerate(PROMPTS))
    r = subprocess.run([sys.executable, "-m", "pdrollout.engine.cli", "generate", "--model", str(model),
                        "--requests", "-", "--mode", "pd", "--device", "cpu",
                        "--engine-config", (config / builders.ENGINE_CONFIG_KEY).read_text()],
                       input=reqs, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line)["output_ids"] for line in r.stdout.splitlines()]


def test_two_pods_form_one_engine_equal_to_one_rank(group, tiny_model, tmp_path):
    spec, config, start, urls, pods = group
    node1 = start(1)
    body = wait_health(node1, urls[1], 503, timeout=120)      # listening, but the group is not there
    assert body["status"] == "joining" and body["ranks"] == [2, 3]
    time.sleep(2.0)
    assert health(urls[1])[0] == 503, "node 1 turned ready before node 0 started"
    node0 = start(0)
    wait_health(node0, urls[0], 200, timeout=240)
    body = wait_health(node1, urls[1], 200, timeout=60)
    assert body == {"node_rank": 1, "ranks": [2, 3], "alive": 2, "stepped": 2, "status": "ok"}

    # Node 1 runs workers only: no API there.
    status, err = http(f"{urls[1]}/generate", {"input_ids": [1, 2], "sampling_params": {}})
    assert status == 404 and "the API is on node 0" in err["error"]["message"]

    # Node 0 plans for all four ranks (two attention replicas).
    status, info = http(f"{urls[0]}/get_model_info")
    assert status == 200 and (info["nproc"], info["adp"], info["ep"], info["atp"]) == (4, 2, 4, 2), info
    outs: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, _generate(urls[0], PROMPTS[i], 6)))
               for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    got = [outs[i]["output_ids"] for i in range(len(PROMPTS))]
    ref = _one_rank(tiny_model, config)
    assert len(ref) == len(PROMPTS) and all(len(r) == 6 for r in ref)
    assert got == ref, f"4 ranks over 2 pods: {got}\none rank: {ref}"

    # Each node's /metrics shows its own ranks; node 1's ranks stepped with the group.
    text = get_text(f"{urls[1]}/metrics")
    for r in (2, 3):
        assert metric(text, f'pdrollout:rank_up{{node="1",rank="{r}"}}') == 1.0
        assert metric(text, f'pdrollout:rank_steps_total{{node="1",rank="{r}"}}') >= 6
    assert metric(get_text(f"{urls[0]}/metrics"), 'pdrollout:rank_steps_total{node="0",rank="0"}') >= 6

    # The kubelet's side of the builders' container: its liveness path answers on both nodes, and its
    # preStop hook (the admin token from the mounted Secret) has nothing to drain on node 1 and drains node 0.
    engine = builders.pod_template("tiny", "t", spec)["spec"]["containers"][0]
    for url in urls:
        status, body = http(url + engine["livenessProbe"]["httpGet"]["path"])
        assert status == 200 and body["status"] == "ok", (url, body)
    hook = engine["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[0] == "python3"
    token_file = next(v for e in engine["env"] if e["name"] == "PDROLLOUT_ADMIN_TOKEN_FILE" for v in [e["value"]])
    for node, said in ((1, "nothing to drain"), (0, "'drained': True")):
        host = urls[node].removeprefix("http://").split(":")[0]
        r = subprocess.run([sys.executable, *hook[1:], "--host", host], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PDROLLOUT_ADMIN_TOKEN_FILE":
                                token_file.replace(builders.ADMIN_DIR, str(tmp_path / "admin"))})
        assert r.returncode == 0 and said in r.stdout, (node, r.stdout, r.stderr)
    assert health(urls[0]) == (503, {"status": "draining"})


def test_killing_node_1_ends_node_0_with_peer_lost(group):
    spec, config, start, urls, pods = group
    node1, node0 = start(1), start(0)
    wait_health(node0, urls[0], 200, timeout=240)
    wait_health(node1, urls[1], 200, timeout=60)
    answers: list = []

    def long_request(i):
        try:
            answers.append(http(f"{urls[0]}/generate", {"input_ids": PROMPTS[i], "sampling_params": {
                "max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}, timeout=120))
        except OSError as e:   # the server may close the connection as it goes: an answer, not a hang
            answers.append((None, repr(e)))
    threads = [threading.Thread(target=long_request, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60   # mid-run: tokens are flowing
    while time.monotonic() < deadline:
        if metric(get_text(f"{urls[0]}/metrics"), "pdrollout:generation_tokens_total") >= 8:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"no tokens flowed:\n{node0.tail()}")
    node1.kill_tree()
    t0 = time.monotonic()
    code = node0.proc.wait(WATCHDOG_BOUND_S + 15)
    took = time.monotonic() - t0
    assert code == EXIT_PEER_LOST, f"node 0 exit {code}:\n{node0.tail()}"
    assert took <= WATCHDOG_BOUND_S + 5, f"node 0 took {took:.1f}s (bound {WATCHDOG_BOUND_S}s)"
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "an in-flight request hung after the group failed"
    assert len(answers) == 2
    for status, body in answers:   # each got an answer: an abort that says why, or a closed connection
        if status is not None:
            assert status in (200, 503) and ("peer" in json.dumps(body).lower() or "lost" in json.dumps(body).lower()
                                             or body.get("meta_info", {}).get("finish_reason", {}).get("type") == "abort"), body
    deadline = time.monotonic() + 10
    while node0.alive_in_group() and time.monotonic() < deadline:   # node 0's own ranks go with it
        time.sleep(0.2)
    assert not node0.alive_in_group(), "a rank of node 0 outlived it"
    # the verdict is the log's last line (what `kubectl logs --tail` shows), after its ranks' tracebacks
    last = node0.tail().strip().splitlines()[-1]
    assert "exit 4 (peer lost)" in last, node0.tail()
