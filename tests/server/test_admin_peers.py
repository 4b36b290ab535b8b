"""Issue 49, Must show 2 (the peer half): the auth model an RL deployment needs, over real HTTP on loopback.
A server started as the operator starts it (an admin token, the trainer's address in --admin-peers):
clients bind a source address (127.0.0.2 is the declared trainer, 127.0.0.3 is not). The trainer pauses,
aborts, updates and releases with no Authorization header (as slime, AReaL and verl call SGLang); anyone
else gets 401 and changes nothing; the token still works from any address. Also SGLang's own key flags:
--api-key guards every route but /health*, /metrics; --admin-api-key is the admin token inline."""
import subprocess

import httpx
import pytest

from pdrollout.engine.protocol.exits import EXIT_CONFIG
from serverproc import SERVE, ServerProcess

TOKEN = "peer-test-admin-token"
TRAINER, STRANGER = "127.0.0.2", "127.0.0.3"
GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


def client(s: ServerProcess, source: str, **headers) -> httpx.Client:
    return httpx.Client(base_url=s.url, timeout=120, headers=headers,
                        transport=httpx.HTTPTransport(local_address=source))


@pytest.fixture(scope="module")
def deployed(tiny_model, tmp_path_factory):
    f = tmp_path_factory.mktemp("peers") / "token"
    f.write_text(TOKEN)
    s = ServerProcess(tiny_model, "--admin-token-file", str(f), "--admin-peers", f"{TRAINER}/32,10.0.0.0/8",
                      "--enable-memory-saver")
    yield s
    assert s.stop() == 0, s.log
    assert TOKEN not in s.log


def paused(s: ServerProcess) -> bool:
    return s.http.get("/get_server_info").json()["paused"]


def test_the_trainer_needs_no_token_a_stranger_is_refused(deployed, tiny_model):
    trainer, stranger = client(deployed, TRAINER), client(deployed, STRANGER)
    anywhere = client(deployed, STRANGER, Authorization=f"Bearer {TOKEN}")
    try:
        # a stranger (and loopback itself: not listed) cannot mutate; nothing changes
        for c in (stranger, deployed.http):
            r = c.post("/pause_generation", json={})
            assert r.status_code == 401 and "missing bearer token" in r.json()["error"]["message"], r.text
            assert "--admin-peers" in r.json()["error"]["message"]
            assert not paused(deployed)
            for path, body in (("/abort_request", {"abort_all": True}),
                               ("/update_weights_from_disk", {"model_path": str(tiny_model)}),
                               ("/release_memory_occupation", {}), ("/flush_cache", {})):
                assert c.post(path, json=body).status_code == 401, path
        assert deployed.http.get("/get_server_info").json()["memory"]["released"] == []
        # the declared trainer, no Authorization header at all
        r = trainer.post("/pause_generation", json={"mode": "in_place"})
        assert r.status_code == 200 and paused(deployed), r.text
        assert trainer.post("/abort_request", json={"abort_all": True}).json()["success"] is True
        assert trainer.post("/flush_cache").status_code == 200
        r = trainer.post("/update_weights_from_disk", json={"model_path": str(tiny_model), "weight_version": "v-peer"})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert deployed.http.get("/get_weight_version").json() == {"weight_version": "v-peer"}
        assert trainer.post("/release_memory_occupation", json={}).status_code == 200
        assert deployed.http.get("/get_server_info").json()["memory"]["released"] != []
        assert trainer.post("/resume_memory_occupation", json={}).status_code == 200
        assert trainer.post("/continue_generation", json={}).status_code == 200 and not paused(deployed)
        # the token works from an address that is not a peer
        assert anywhere.post("/pause_generation", json={}).status_code == 200 and paused(deployed)
        assert anywhere.post("/continue_generation", json={}).status_code == 200 and not paused(deployed)
        # a wrong token from a stranger stays refused; serving stays open to everyone
        r = client(deployed, STRANGER, Authorization="Bearer nope").post("/continue_generation", json={})
        assert r.status_code == 401 and "wrong bearer token" in r.json()["error"]["message"]
        assert stranger.post("/generate", json=GEN).status_code == 200
    finally:
        for c in (trainer, stranger, anywhere):
            c.close()


def test_peers_without_a_token_still_guard_the_admin_routes(tiny_model):
    s = ServerProcess(tiny_model, "--admin-peers", TRAINER)
    try:
        with client(s, STRANGER) as stranger, client(s, TRAINER) as trainer:
            r = stranger.post("/pause_generation", json={})
            assert r.status_code == 403 and "not in --admin-peers" in r.json()["error"]["message"], r.text
            assert STRANGER in r.json()["error"]["message"] and not paused(s)
            assert stranger.post("/generate", json=GEN).status_code == 200
            assert trainer.post("/pause_generation", json={}).status_code == 200 and paused(s)
            assert trainer.post("/continue_generation", json={}).status_code == 200
    finally:
        assert s.stop() == 0, s.log


def test_sglang_api_key_and_admin_api_key(tiny_model):
    """SGLang's semantics: --api-key on every route (Bearer or x-api-key) except /health*, /metrics; the
    admin key (--admin-api-key) on the admin routes, where the api key is not accepted."""
    api, adm = "plain-api-key", "inline-admin-key"
    s = ServerProcess(tiny_model, "--api-key", api, "--admin-api-key", adm)
    try:
        assert s.http.get("/health").status_code == 200 and s.http.get("/metrics").status_code == 200
        assert s.http.get("/health_generate").status_code == 200
        r = s.http.post("/generate", json=GEN)
        assert r.status_code == 401 and "--api-key" in r.json()["error"]["message"]
        assert s.http.get("/get_server_info").status_code == 401
        assert s.http.post("/generate", json=GEN, headers={"Authorization": f"Bearer {api}"}).status_code == 200
        assert s.http.post("/generate", json=GEN, headers={"x-api-key": api}).status_code == 200
        assert s.http.post("/pause_generation", json={}, headers={"Authorization": f"Bearer {api}"}).status_code == 401
        assert s.http.post("/pause_generation", json={}, headers={"Authorization": f"Bearer {adm}"}).status_code == 200
        r = s.http.get("/get_server_info", headers={"Authorization": f"Bearer {api}"})
        assert r.status_code == 200 and r.json()["paused"] and api not in r.text and adm not in r.text
        assert s.http.post("/continue_generation", json={}, headers={"x-api-key": adm}).status_code == 200
    finally:
        assert s.stop() == 0, s.log
    assert api not in s.log and adm not in s.log


def test_a_dual_stack_listener_admits_a_v4_trainer_by_its_mapped_address(tiny_model):
    """On `--host ::` a v4 client's peer address is `::ffff:a.b.c.d`: it is the v4 peer it maps."""
    s = ServerProcess(tiny_model, "--host", "::", "--admin-peers", f"{TRAINER}/32", "--api-key", "k")
    port = s.url.rsplit(":", 1)[1]
    try:
        assert s.url.startswith("http://[::]:"), s.url
        at = lambda source: httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120,
                                         transport=httpx.HTTPTransport(local_address=source))
        with at(TRAINER) as trainer, at(STRANGER) as stranger:
            r = stranger.post("/pause_generation", json={})
            assert r.status_code == 401, r.text
            assert trainer.post("/pause_generation", json={}).status_code == 200
            assert trainer.post("/continue_generation", json={}).status_code == 200
            assert trainer.post("/generate", json=GEN).status_code == 200   # the key's routes too
            assert stranger.post("/generate", json=GEN).status_code == 401
    finally:
        assert s.stop() == 0, s.log


def test_api_key_file_live_and_the_metrics_port(tiny_model, tmp_path):
    """The key from a file (a mounted Secret: not on the command line); the liveness probe carries no
    key; --metrics-port serves /metrics and nothing else."""
    key = "key-from-a-file"
    (tmp_path / "key").write_text(key + "\n")
    s = ServerProcess(tiny_model, "--api-key-file", str(tmp_path / "key"), "--metrics-port", "0")
    try:
        port = int(s.log.split("/metrics also on http://127.0.0.1:")[1].split()[0])
        assert s.http.post("/generate", json=GEN).status_code == 401
        assert s.http.post("/generate", json=GEN, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert s.http.get("/live").status_code == 200 and s.http.get("/health").status_code == 200
        with open(f"/proc/{s.proc.pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read()
        scrape = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        r = scrape.get("/metrics")
        assert r.status_code == 200 and "pdrollout:num_running_reqs" in r.text
        for path in ("/generate", "/health", "/get_server_info", "/pause_generation"):
            assert scrape.post(path, json=GEN).status_code in (404, 405), path
            assert scrape.get(path).status_code == 404, path
    finally:
        assert s.stop() == 0, s.log
    assert key not in s.log


@pytest.mark.parametrize("args, why", [
    (["--admin-peers", "10.0.0.0/8,trainer-0"], "--admin-peers: 'trainer-0' is not an IP address or CIDR"),
    (["--admin-peers", ","], "--admin-peers: no address given"),
    (["--admin-api-key", "a", "--admin-token-file", "/dev/null"], "not both"),
    (["--api-key", " "], "--api-key is empty"),
    (["--api-key", "a", "--api-key-file", "/dev/null"], "not both"),
    (["--api-key-file", "/dev/null"], "--api-key-file /dev/null is empty"),
    (["--api-key-file", "/nonexistent/key"], "--api-key-file: No such file or directory"),
    (["--metrics-port", "70000"], "--metrics-port must be in [0, 65535]")])
def test_bad_auth_flags_are_config_errors(tiny_model, args, why):
    r = subprocess.run([*SERVE, "--model", str(tiny_model), "--port", "0", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_CONFIG and why in r.stderr, r.stderr
