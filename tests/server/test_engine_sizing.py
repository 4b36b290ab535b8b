"""`pdrollout serve` takes the engine's size settings (--engine-config), says them in its log and
/server_info, and a request that cannot fit them gets a 400 naming the field; the server keeps serving."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from serverproc import SERVE

SIZES = {"block_size": 4, "num_blocks": 8, "max_running": 3, "max_context_len": 64,
         "control": {"prefill_budget_tokens": 32}}


def generate(server, prompt_len: int, max_new: int):
    return server.http.post("/generate", json={"input_ids": list(range(2, 2 + prompt_len)),
                                               "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}})


def test_sizes_from_serve_and_requests_that_cannot_fit(start_server):
    s = start_server("--engine-config", json.dumps(SIZES))
    info = s.http.get("/server_info").json()
    assert info["context_length"] == 64 and info["max_running_requests"] == 3
    assert info["max_total_num_tokens"] == 8 * 4 and info["page_size"] == 4
    assert info["control"]["prefill_budget_tokens"] == 32
    assert info["kv_mem_fraction"] is None and info["kv_free_bytes"] is None   # a size was given
    assert info["kv_cache_bytes"] > 0
    line = re.search(r"KV cache: (\d+) blocks of (\d+) tokens .*\[kv_cache_bytes=(\d+)\]", s.log)
    assert line and (int(line[1]), int(line[2]), int(line[3])) == (8, 4, info["kv_cache_bytes"]), s.log

    over_ctx = generate(s, 10, 55)          # 65 tokens > the 64 of max_context_len
    assert over_ctx.status_code == 400, over_ctx.text
    msg = over_ctx.json()["error"]["message"]
    assert "max_new_tokens (55)" in msg and "exceeds the context length 64" in msg, msg
    over_kv = generate(s, 10, 30)           # 40 tokens fit the context, not the 32 tokens of the cache
    assert over_kv.status_code == 400, over_kv.text
    msg = over_kv.json()["error"]["message"]
    assert "max_new_tokens = 40 tokens exceeds the KV cache capacity (32 tokens)" in msg, msg

    # the engine is not wedged: requests that fit, more of them than max_running, all finish
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(5) as pool:
        done = list(pool.map(lambda _: generate(s, 6, 10), range(5)))
    assert [r.status_code for r in done] == [200] * 5
    assert all(len(r.json()["output_ids"]) == 10 for r in done)
    idle = s.wait_for(lambda st: st["num_running_reqs"] + st["num_queue_reqs"] == 0, what="idle")
    assert idle["kv_blocks_total"] == 8
    assert s.stop() == 0, s.log


@pytest.mark.parametrize("field, value", [("kv_mem_fraction", 1.5), ("kv_mem_fraction", 0),
                                          ("kv_cache_bytes", -1), ("max_running", 0)])
def test_bad_size_setting_fails_fast_naming_the_field(tiny_model, field, value):
    p = subprocess.run([*SERVE, "--model", str(tiny_model), "--port", "0",
                        "--engine-config", json.dumps({field: value})],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and field in p.stderr, p.stderr
    assert "ready on" not in p.stdout
