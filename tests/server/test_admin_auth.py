"""The admin bearer token over real HTTP on loopback (`pdrollout serve --admin-token-file`): the routes that
change the engine for everyone answer 401 without the token and act with it; the serving, health and
metrics routes stay open. Also: which routes are admin, from the app's own route table."""
import asyncio
import subprocess

import pytest

from pdrollout.engine.server.app import Server, ServerSettings, is_admin
from pdrollout.engine.server.routes import build_app
from serverproc import SERVE, ServerProcess

TOKEN = "s3cret-admin-token"
ADMIN = {("PUT", "/control"), ("POST", "/abort_request"), ("POST", "/pause_generation"),
         ("POST", "/continue_generation"), ("POST", "/flush_cache"), ("GET", "/flush_cache"),
         ("POST", "/update_weights_from_disk"), ("POST", "/init_weights_update_group"),
         ("POST", "/update_weights_from_distributed"), ("POST", "/update_weights_from_tensor"),
         ("POST", "/destroy_weights_update_group"),
         ("POST", "/update_weight_version"), ("POST", "/release_memory_occupation"),
         ("GET", "/release_memory_occupation"), ("POST", "/resume_memory_occupation"),
         ("GET", "/resume_memory_occupation"), ("POST", "/drain")}


def test_admin_routes_are_exactly_the_mutating_ones():
    """A new route is open unless marked: this pins the list, so adding a mutating one fails here."""
    loop = asyncio.new_event_loop()
    try:
        app = build_app(Server(ServerSettings(model="m"), lambda: None, loop))
        routes = {(r.method, r.resource.canonical): r.handler for r in app.router.routes()
                  if r.method != "HEAD"}
    finally:
        loop.close()
    assert {k for k, h in routes.items() if is_admin(h)} == ADMIN
    for open_route in [("POST", "/generate"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                       ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics"), ("GET", "/control"),
                       ("GET", "/get_weight_version")]:
        assert open_route in routes and not is_admin(routes[open_route]), open_route


@pytest.fixture(scope="module")
def guarded(tiny_model, tmp_path_factory):
    f = tmp_path_factory.mktemp("admin") / "token"
    f.write_text(TOKEN + "\n")   # a Secret mounted as a file may end in a newline
    s = ServerProcess(tiny_model, "--admin-token-file", str(f))
    yield s
    assert s.stop() == 0, s.log


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_control_needs_the_token(guarded):
    before = guarded.http.get("/control").json()   # reading stays open
    r = guarded.http.put("/control", json={"span": 2})
    assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
    assert "PUT /control is an admin route: missing bearer token" in r.json()["error"]["message"]
    r = guarded.http.put("/control", json={"span": 2}, headers=auth("wrong"))
    assert r.status_code == 401 and "wrong bearer token" in r.json()["error"]["message"]
    r = guarded.http.put("/control", json={"span": 2}, headers={"Authorization": TOKEN})  # no scheme
    assert r.status_code == 401
    assert guarded.http.get("/control").json() == before, "a refused request changed the engine"
    r = guarded.http.put("/control", json={"span": 2}, headers=auth(TOKEN))
    assert r.status_code == 200 and r.json()["span"] == 2
    assert guarded.http.get("/control").json()["span"] == 2
    guarded.http.put("/control", json={"span": before["span"]}, headers=auth(TOKEN))


@pytest.mark.parametrize("method, path", sorted(ADMIN))
def test_every_admin_route_refuses_without_the_token(guarded, method, path):
    r = guarded.http.request(method, path, json={})
    assert r.status_code == 401, (method, path, r.status_code, r.text)


def test_pause_and_continue_with_the_token(guarded):
    assert guarded.http.post("/pause_generation", json={}).status_code == 401
    assert not guarded.http.get("/get_server_info").json()["paused"]
    assert guarded.http.post("/pause_generation", json={}, headers=auth(TOKEN)).status_code == 200
    assert guarded.http.get("/get_server_info").json()["paused"]
    assert guarded.http.post("/continue_generation", json={}, headers=auth(TOKEN)).status_code == 200
    assert not guarded.http.get("/get_server_info").json()["paused"]


def test_serving_routes_stay_open(guarded):
    r = guarded.http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
    r = guarded.http.post("/v1/completions", json={"model": guarded.http.get("/v1/models").json()["data"][0]["id"],
                                                   "prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert guarded.http.get("/health").status_code == 200
    assert "pdrollout:" in guarded.http.get("/metrics").text


@pytest.mark.parametrize("content, why", [(None, "No such file or directory"), ("\n", "is empty")])
def test_bad_token_file_is_a_config_error(tiny_model, tmp_path, content, why):
    f = tmp_path / "token"
    if content is not None:
        f.write_text(content)
    r = subprocess.run([*SERVE, "--model", str(tiny_model), "--port", "0", "--admin-token-file", str(f)],
                       capture_output=True, text=True, timeout=120)
    from pdrollout.engine.protocol.exits import EXIT_CONFIG
    assert r.returncode == EXIT_CONFIG and "--admin-token-file" in r.stderr and why in r.stderr, r.stderr


def _route_table() -> list[tuple[str, str]]:
    loop = asyncio.new_event_loop()
    try:
        app = build_app(Server(ServerSettings(model="m"), lambda: None, loop))
        return sorted({(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"})
    finally:
        loop.close()


def test_the_token_leaves_the_server_through_no_route(tiny_model, tmp_path):
    """Every route of the app's own table, every method, with and without the token, with an empty and a
    malformed body: the token is in no status line, header or body (error bodies included), nor in the
    server's log. A dedicated server: the sweep pauses, releases and aborts."""
    f = tmp_path / "token"
    f.write_text(TOKEN)
    s = ServerProcess(tiny_model, "--admin-token-file", str(f), "--enable-memory-saver")
    try:
        seen = 0

        def sweep(method: str, path: str) -> None:
            nonlocal seen
            for method_sent in {method, "GET", "POST", "PUT", "DELETE"}:
                for headers in ({}, auth(TOKEN), auth("wrong")):
                    for body in ({"json": {}}, {"content": b"{not json"}):
                        r = s.http.request(method_sent, path, headers=headers, **body)
                        text = r.text + repr(dict(r.headers)) + r.reason_phrase
                        assert TOKEN not in text, (method_sent, path, r.status_code, text[:300])
                        seen += 1
        for method, path in _route_table():
            if path == "/drain":   # one way (the pod is stopping): swept last, below
                continue
            sweep(method, path)
            if path in ("/pause_generation", "/release_memory_occupation"):   # undo what the sweep did
                assert s.http.post("/continue_generation", json={}, headers=auth(TOKEN)).status_code == 200
                assert s.http.post("/resume_memory_occupation", json={}, headers=auth(TOKEN)).status_code == 200
        info = s.http.get("/get_server_info").json()
        assert "admin_token" not in info and seen > 200
        assert s.http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
                           ).status_code == 200, "the sweep left the server unable to serve"
        sweep("POST", "/drain")
        assert s.http.get("/health").json()["status"] == "draining"
    finally:
        assert s.stop() == 0, s.log
    assert TOKEN not in s.log
