"""Issue 63, Must show 4: /update_weights_from_tensor with the bodies verl 0.9.1 and slime send, built by
their released code where it imports (tests/rl_tensor_clients.py: verl's bucketing, SGLang's
LocalSerializedTensor and MultiprocessingSerializer with load_format null; slime's flattened buckets from
SGLang's FlattenedTensorBucket), CPU tensors pickled by torch's ForkingPickler on the server's host. With
the file_system sharing strategy the server opens them by name and the greedy tokens become the pushed
checkpoint's; with torch's default (file descriptors, which only the trainer's own children can take) the
update is refused with that advice and nothing changes."""
from __future__ import annotations

import json

import pytest

import rl_clients
from rl_common import ENGINE, checkpoint
from serverproc import ServerProcess

pytestmark = pytest.mark.timeout(900)
PROMPTS = [[3, 5, 7, 9, 11], list(range(20, 38))]
SP = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
TOPOLOGIES = {"1rank": [], "4ranks-atp2-adp2": ["--nproc", "4", "--adp", "2", "--ep", "4"]}


def greedy(s: ServerProcess) -> list[list[int]]:
    r = s.http.post("/generate", json={"input_ids": PROMPTS, "sampling_params": SP})
    assert r.status_code == 200, r.text
    return [b["output_ids"] for b in r.json()]


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_verl_and_slime_tensor_bodies_on_one_host(topo, tmp_path):
    s0, s1 = checkpoint(tmp_path / "s0", 0), checkpoint(tmp_path / "s1", 1)
    ranks = 4 if topo.startswith("4") else 1
    s = ServerProcess(s0, *TOPOLOGIES[topo], "--engine-config", ENGINE)
    try:
        ref0 = greedy(s)
        assert s.http.post("/update_weights_from_disk", json={"model_path": s1}).status_code == 200
        ref1 = greedy(s)   # a disk update equals a fresh engine (test_rl_weights)
        assert ref1 != ref0
        for client in ("verl", "slime"):
            assert s.http.post("/update_weights_from_disk", json={"model_path": s0}).status_code == 200
            r = rl_clients.run("rl_tensor_clients.py", "--url", s.url, "--model", s1, "--client", client,
                               "--sharing", "file_descriptor", "--ranks", str(ranks))
            answers = [json.loads(x)["update"] for x in r.stdout.splitlines() if '"update"' in x]
            assert r.returncode == 0 and answers, r.stderr[-3000:]
            assert all(a["status"] == 400 and "set_sharing_strategy('file_system')" in a["body"]["message"]
                       for a in answers), (client, answers[0])
            assert greedy(s) == ref0, client   # nothing changed
            if client == "slime":   # its order: pause, flush (its buckets say flush_cache false), push, continue
                assert s.http.post("/pause_generation", json={}).status_code == 200
                assert s.http.get("/flush_cache").status_code == 200
            r = rl_clients.run("rl_tensor_clients.py", "--url", s.url, "--model", s1, "--client", client,
                               "--sharing", "file_system", "--ranks", str(ranks))
            answers = [json.loads(x)["update"] for x in r.stdout.splitlines() if '"update"' in x]
            assert r.returncode == 0 and len(answers) > 1, r.stderr[-3000:]
            assert all(a["status"] == 200 and a["body"]["success"] for a in answers), (client, answers)
            if client == "slime":
                assert s.http.post("/continue_generation", json={}).status_code == 200
            assert greedy(s) == ref1, client
        assert s.http.get("/get_weight_version").json() == {"weight_version": "1"}   # slime's, last
    finally:
        assert s.stop() == 0, s.log[-3000:]
