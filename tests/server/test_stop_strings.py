"""Issue 49, Must show 4: stop strings with SGLang's semantics against transformers' generate(stop_strings=...)
as the reference. The tiny model gets a tokenizer built here (no hub download): pieces of 1-4 characters over
a small alphabet whose decode is their concatenation, so stop strings span tokens and end inside them.
For a held-out list of stop strings (fixed before any output was seen), greedy output_ids equal transformers',
streaming and not; finish_reason says which string matched; the text is cut before it (SGLang's default),
keeps it with include_stop_str_in_output, or stays whole with no_stop_trim. Bad stop input gets a 400 that
names the field and the server keeps serving."""
from __future__ import annotations

import json
import random

import pytest
import torch

from hf_reference import hf_model
from server.piece_tokenizer import piece_model
from serverproc import ServerProcess

PROMPTS = [[3, 5, 7, 9, 11], list(range(40, 52)), [401, 17, 99]]
HELD_OUT = [["dd"], ["ae", "fb"], "ce", ["cc", "b f"], ["fffff"], ["aea"], ["e e"], "ba"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def text_model(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("stops")
    fast = piece_model(tiny_model, d)
    s = ServerProcess(d)
    yield d, fast, s
    assert s.stop() == 0, s.log


def reference(model_dir, fast, prompt, stop) -> list[int]:
    stops = [stop] if isinstance(stop, str) else stop
    with torch.no_grad():
        out = hf_model(str(model_dir)).generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                                eos_token_id=None, pad_token_id=0, stop_strings=stops, tokenizer=fast)
    return out[0, len(prompt):].tolist()


def body(prompt, stop, stream=False, **extra) -> dict:
    return {"input_ids": prompt, "stream": stream,
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "stop": stop, **extra}}


def last_event(r) -> dict:
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert r.text.rstrip().endswith("data: [DONE]") and events
    return events[-1]


def test_stop_strings_equal_transformers(text_model):
    d, fast, s = text_model
    stopped = ran_out = 0
    for prompt in PROMPTS:
        for stop in HELD_OUT:
            ref = reference(d, fast, prompt, stop)
            full = fast.decode(ref)
            plain = s.http.post("/generate", json=body(prompt, stop)).json()
            streamed = last_event(s.http.post("/generate", json=body(prompt, stop, stream=True)))
            for out in (plain, streamed):
                assert out["output_ids"] == ref, (prompt, stop, out["output_ids"], ref)
                fr = out["meta_info"]["finish_reason"]
                if len(ref) == MAX_NEW and fr["type"] == "length":
                    ran_out += 1
                    assert out["text"] == full
                    continue
                stopped += 1
                matched = fr["matched"]
                assert fr["type"] == "stop" and matched in ([stop] if isinstance(stop, str) else stop), fr
                assert matched in full and matched not in fast.decode(ref[:-1])   # its last token completed it
                assert out["text"] == full[:full.find(matched)]
    assert stopped and ran_out, (stopped, ran_out)   # the list exercises both endings


def mid_step_stops(s, fast, prompt) -> list[tuple[str, int]]:
    """(stop string, the token it completes at) for tokens that arrived first of several in one
    step, from a streamed run without stops: each chunk carries what one step brought."""
    r = s.http.post("/generate", json=body(prompt, None, stream=True))
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    out, found, before = events[-1]["output_ids"], [], 0
    for e in events:
        n = len(e["output_ids"])
        if n - before >= 2:
            for width in (2, 3, 4):
                stop = fast.decode(out[max(0, before + 1 - width): before + 1])
                if stop.strip() and stop not in fast.decode(out[:before]):   # it first completes here
                    found.append((stop, before))
                    break
        before = n
    return found


def test_stop_strings_hold_when_a_step_brings_several_tokens(text_model):
    """n-gram speculation: a D step can bring up to k+1 tokens and a stop string may complete at any
    of them, not only the last; the request ends at exactly that token, as transformers' does."""
    d, fast, _ = text_model
    s = ServerProcess(d, "--speculative", "ngram", "--speculative-k", "4")
    mid = 0
    try:
        rng = random.Random(1)
        for prompt in PROMPTS + [[rng.randrange(500) for _ in range(8)] for _ in range(6)]:
            for stop, at in mid_step_stops(s, fast, prompt)[:3]:
                ref = reference(d, fast, prompt, stop)
                assert len(ref) == at + 1, (prompt, stop, at, ref)   # transformers stops at that token too
                for stream in (False, True):
                    r = s.http.post("/generate", json=body(prompt, stop, stream=stream))
                    out = last_event(r) if stream else r.json()
                    assert out["output_ids"] == ref, (prompt, stop, stream, out["output_ids"], ref)
                    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
                mid += 1
    finally:
        assert s.stop() == 0, s.log
    assert mid >= 5, mid   # the case this test is for happened, and more than once by chance


def test_include_stop_str_and_no_stop_trim(text_model):
    d, fast, s = text_model
    prompt, stop = PROMPTS[0], ["dd", "ae", "ce"]
    ref = reference(d, fast, prompt, stop)
    full = fast.decode(ref)
    first = s.http.post("/generate", json=body(prompt, stop)).json()
    matched = first["meta_info"]["finish_reason"]["matched"]
    assert len(ref) < MAX_NEW and first["output_ids"] == ref
    pos = full.find(matched)
    for extra, want in (({"include_stop_str_in_output": True}, full[:pos + len(matched)]),
                        ({"no_stop_trim": True}, full)):
        for stream in (False, True):
            r = s.http.post("/generate", json=body(prompt, stop, stream=stream, **extra))
            out = last_event(r) if stream else r.json()
            assert out["text"] == want and out["output_ids"] == ref, (extra, stream, out["text"], want)
    # the OpenAI route: the same cut, the matched string as vLLM's stop_reason
    r = s.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
                                             "ignore_eos": True, "stop": stop})
    choice = r.json()["choices"][0]
    assert choice["text"] == full[:pos] and choice["finish_reason"] == "stop" and choice["stop_reason"] == matched


@pytest.mark.parametrize("sp, field", [
    ({"stop": 5}, "sampling_params.stop must be a string or a list of strings"),
    ({"stop": ["ab", 3]}, "sampling_params.stop must be a string or a list of strings"),
    ({"stop": ["ab", ""]}, "sampling_params.stop[1] is an empty string"),
    ({"stop": "ab", "include_stop_str_in_output": "yes"}, "sampling_params.include_stop_str_in_output must be a boolean"),
    ({"stop": "ab", "no_stop_trim": 1}, "sampling_params.no_stop_trim must be a boolean")])
def test_bad_stop_input_names_the_field(text_model, sp, field):
    _, _, s = text_model
    r = s.http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, **sp}})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    assert s.http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_stop_strings_need_a_tokenizer(server):
    r = server.http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "stop": "x"}})
    assert r.status_code == 400 and "sampling_params.stop needs a tokenizer" in r.json()["error"]["message"]
