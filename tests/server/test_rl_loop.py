"""Issue 18, Must-show 2 and 4: requests in flight during a weight update, and a replay of one RL
step the way slime drives SGLang, on a real `pdrollout serve` (one rank) and a real trainer process.

In flight: with generation running an update waits for the in-flight requests, which finish under
the old weights (their single weight_versions span says so) while new ones wait and run under the
new; `abort_all_requests` ends them with their partial output, and re-sent they finish under the
new weights exactly as a fresh engine on those weights continues them; paused with `retract`
they are recomputed under the new weights after /continue_generation (two spans); `in_place` keeps
their KV (two spans). None is lost or hangs: every request gets one answer, in bounded time."""
from __future__ import annotations

import json
import subprocess
import threading
import time

import httpx
import pytest

from serverproc import ServerProcess
import rl_clients
from rl_common import ENGINE, checkpoint

pytestmark = pytest.mark.timeout(900)
N = 200   # tokens per request: each stream still in flight once the last has its first tokens (40 were not, on a fast CPU)
PROMPTS = [[(7 * i + 3 * k) % 400 + 5 for k in range(6 + 5 * i)] for i in range(4)]


def sp(n: int = N) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    d = tmp_path_factory.mktemp("loop")
    s0, s1 = checkpoint(d / "s0", 0), checkpoint(d / "s1", 1)
    ref1 = ServerProcess(s1, "--engine-config", ENGINE)     # a fresh engine on the new weights
    live = ServerProcess(s0, "--engine-config", ENGINE)
    yield {"s0": s0, "s1": s1, "ref1": ref1, "live": live}
    for s in (ref1, live):
        assert s.stop() == 0, s.log[-3000:]


def generate(s: ServerProcess, prompt, n=N, **extra) -> dict:
    r = s.http.post("/generate", json={"input_ids": prompt, "sampling_params": sp(n), **extra}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


class Streams:
    """Streaming /generate requests in threads; each one's cumulative chunks as they arrive."""

    def __init__(self, url: str, prompts) -> None:
        self.chunks = [[] for _ in prompts]
        self.threads = [threading.Thread(target=self._run, args=(url, i, p), daemon=True) for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _run(self, url, i, prompt):
        body = {"input_ids": prompt, "sampling_params": sp(), "stream": True}
        with httpx.stream("POST", url + "/generate", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.chunks[i].append(json.loads(line[6:]))

    def wait_tokens(self, k: int, timeout=60) -> None:
        deadline = time.monotonic() + timeout
        while any(not c or len(c[-1]["output_ids"]) < k for c in self.chunks):
            assert time.monotonic() < deadline, "requests did not start"
            time.sleep(0.005)

    def finals(self, timeout=120) -> list[dict]:
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), "a request hangs"
        return [c[-1] for c in self.chunks]


def update(s: ServerProcess, model: str, version: str, **extra) -> dict:
    r = s.http.post("/update_weights_from_disk", json={"model_path": model, "weight_version": version, **extra},
                    timeout=300)
    assert r.status_code == 200 and r.json()["success"], r.text
    return r.json()


def spans(body) -> list[tuple]:
    return [(x["version"], x["start"], x["end"]) for x in body["meta_info"]["weight_versions"]]


def test_in_flight_requests_during_updates(servers):
    live, ref1, s0, s1 = servers["live"], servers["ref1"], servers["s0"], servers["s1"]
    old = [generate(live, p)["output_ids"] for p in PROMPTS]
    new = [generate(ref1, p)["output_ids"] for p in PROMPTS]
    assert old != new

    # 1. running: the update waits for the in-flight requests (old weights), new ones wait for it
    st = Streams(live.url, PROMPTS)
    st.wait_tokens(2)
    late: dict = {}
    t_update = threading.Thread(target=lambda: late.setdefault("u", update(live, s1, "v1")))
    t_update.start()
    live.wait_for(lambda i: not i["admitting"], what="update waiting for in-flight requests", read=live.info)
    t_late = threading.Thread(target=lambda: late.setdefault("r", generate(live, PROMPTS[0])))
    t_late.start()
    live.wait_for(lambda i: i["held"] == 1, what="late request held behind the update", read=live.info)
    finals = st.finals()
    t_update.join(120)
    t_late.join(120)
    assert [f["output_ids"] for f in finals] == old
    assert all(spans(f) == [("default", 0, N)] and f["meta_info"]["finish_reason"]["type"] == "length" for f in finals)
    assert late["r"]["output_ids"] == new[0] and spans(late["r"]) == [("v1", 0, N)]

    # 2. abort_all_requests: partial outputs (old weights); re-sent, they continue under the new
    # weights exactly as a fresh engine on them continues prompt + partial output
    update(live, s0, "v0")
    st = Streams(live.url, PROMPTS)
    st.wait_tokens(3)
    update(live, s1, "v2", abort_all_requests=True)
    finals = st.finals()
    for p, f, o in zip(PROMPTS, finals, old):
        k = len(f["output_ids"])
        assert f["meta_info"]["finish_reason"]["type"] == "abort" and 3 <= k < N
        assert f["output_ids"] == o[:k] and spans(f) == [("v0", 0, k)]
        again = generate(live, p + f["output_ids"], N - k)
        assert again["output_ids"] == generate(ref1, p + f["output_ids"], N - k)["output_ids"]
        assert spans(again) == [("v2", 0, N - k)]

    # 3. paused with retract: recomputed under the new weights after continue (two spans)
    update(live, s0, "v3")
    st = Streams(live.url, PROMPTS)
    st.wait_tokens(3)
    r = live.http.post("/pause_generation", json={"mode": "retract"})
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["retracted"] >= 1, r.text
    assert live.http.get("/flush_cache").status_code == 200     # retracted requests hold no KV
    update(live, s1, "v4")                                       # paused: applies at once
    assert live.http.post("/continue_generation", json={}).status_code == 200
    for p, f, o in zip(PROMPTS, st.finals(), old):
        (v_a, a0, k), (v_b, k2, end) = spans(f)
        assert (v_a, a0, v_b, k2, end) == ("v3", 0, "v4", k, N) and 0 < k < N
        assert f["output_ids"][:k] == o[:k]
        assert f["output_ids"][k:] == generate(ref1, p + o[:k], N - k)["output_ids"]

    # 4. paused in place: KV kept; the tokens after continue come from the new weights
    update(live, s0, "v5")
    st = Streams(live.url, PROMPTS)
    st.wait_tokens(3)
    assert live.http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    assert live.http.get("/flush_cache").status_code == 400     # requests hold KV
    update(live, s1, "v6", flush_cache=False)
    assert live.http.post("/continue_generation", json={}).status_code == 200
    for f, o in zip(st.finals(), old):
        (v_a, _, k), (v_b, _, end) = spans(f)
        assert (v_a, v_b, end) == ("v5", "v6", N) and f["output_ids"][:k] == o[:k]
        assert f["meta_info"]["finish_reason"]["type"] == "length"
    assert live.http.get("/get_server_info").json()["in_flight"] == 0


def test_partial_rollout_resumes_from_the_prefix_cache(servers):
    live = servers["live"]
    update(live, servers["s0"], "p0")
    whole = generate(live, PROMPTS[3])["output_ids"]
    st = Streams(live.url, [PROMPTS[3]])
    st.wait_tokens(9)
    r = live.http.post("/pause_generation", json={})                # SGLang's default: abort
    assert r.status_code == 200 and r.json()["message"] == "Generation paused successfully."
    (f,) = st.finals(5)                                              # answered before pause returned
    k = len(f["output_ids"])
    assert f["meta_info"]["finish_reason"]["type"] == "abort" and k >= 9
    assert live.http.post("/continue_generation", json={}).json()["status"] == "ok"
    again = generate(live, PROMPTS[3] + f["output_ids"], N - k)
    assert f["output_ids"] + again["output_ids"] == whole
    assert again["meta_info"]["cached_tokens"] >= 4 * ((len(PROMPTS[3]) + k - 1) // 4) - 4 > 0


def test_rl_step_replay_as_slime_drives_sglang(servers):
    """slime's order (rollout/sglang_rollout.py, update_weight_from_distributed.py, sglang_engine.py):
    connect the trainer's update group; roll out a batch; the train step's weight sync =
    pause_generation ({} = abort) -> GET flush_cache -> update_weights_from_distributed per bucket,
    weight_version as a string -> continue_generation; aborted samples come back as partial
    rollouts (prompt + tokens so far) and finish; flush_cache; get_weight_version."""
    live, ref1 = servers["live"], servers["ref1"]
    update(live, servers["s0"], "0")
    tr = rl_clients.popen("rl_trainer.py", "--url", live.url, "--model", servers["s1"], "--engine-ranks", "1",
                          "--version", "1", "--steps", "init,wait,update", "--bucket-bytes", str(256 << 10),
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        init = json.loads(tr.stdout.readline())["init"]
        assert init["status"] == 200 and init["body"]["success"], init
        assert json.loads(tr.stdout.readline()) == {"waiting": True}
        batch = [p for p in PROMPTS for _ in range(2)]
        st = Streams(live.url, batch)
        st.wait_tokens(2)
        # the trainer's weight sync (rank 0 of the trainer calls these in slime)
        assert live.http.post("/pause_generation", json={}).status_code == 200
        assert live.http.get("/flush_cache").status_code == 200
        tr.stdin.write("go\n")
        tr.stdin.flush()
        out, err = tr.communicate(timeout=300)
        assert tr.returncode == 0, err[-3000:]
        answers = [json.loads(x) for x in out.splitlines()]
        assert all(a["update"]["status"] == 200 for a in answers if "update" in a) and answers[-1] == {"done": True}
        assert live.http.post("/continue_generation", json={}).status_code == 200
        first = st.finals()
        partial = [f for f in first if f["meta_info"]["finish_reason"]["type"] == "abort"]
        assert partial, "the weight sync caught no sample in flight"
        for p, f in zip(batch, first):   # partial rollout: re-send prompt + tokens so far
            k = len(f["output_ids"])
            assert spans(f) == [("0", 0, k)]
            if k == N:
                continue
            rest = generate(live, p + f["output_ids"], N - k, return_logprob=True)
            assert rest["output_ids"] == generate(ref1, p + f["output_ids"], N - k)["output_ids"]
            assert spans(rest) == [("1", 0, N - k)] and len(rest["meta_info"]["output_token_logprobs"]) == N - k
        assert live.http.get("/flush_cache").status_code == 200
        assert live.http.get("/get_weight_version").json() == {"weight_version": "1"}
        r = live.http.post("/destroy_weights_update_group", json={"group_name": "slime-pp_0"})
        assert r.status_code == 200 and r.json()["success"], r.text
    finally:
        if tr.poll() is None:
            tr.kill()
