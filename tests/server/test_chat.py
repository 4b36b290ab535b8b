"""/v1/chat/completions with a tokenizer built here (no hub download): a word-level tokenizer over
the tiny model's vocabulary and a chat template that renders tools. The prompt must be exactly what
transformers' apply_chat_template makes (the independent reference), and the answer what /generate
gives for those ids; streaming deltas add up to the same text."""
from __future__ import annotations

import json
import shutil

import pytest

from serverproc import ServerProcess

TEMPLATE = (
    "{% if tools %}<|system|> tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "w3 w14 w15 w92 w5"}]
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    d = tmp_path_factory.mktemp("chat")
    for f in tiny_model.iterdir():
        shutil.copy(f, d / f.name)
    vocab_size = json.loads((d / "config.json").read_text())["vocab_size"]
    specials = ["<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|eos|>", "tools:", "search"]
    vocab = {w: i for i, w in enumerate(specials + [f"w{i}" for i in range(vocab_size - len(specials))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|eos|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(d)
    return d, fast


def test_chat_prompt_is_transformers_and_answer_is_generate(chat_model):
    d, fast = chat_model
    ref_ids = fast.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    ref_ids = list(ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids)   # transformers 5: a BatchEncoding
    s = ServerProcess(d)
    try:
        body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = s.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        gen = s.http.post("/generate", json={"input_ids": ref_ids, "sampling_params": {
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).json()
        assert out["usage"]["prompt_tokens"] == len(ref_ids) and out["usage"]["completion_tokens"] == 6
        msg = out["choices"][0]["message"]
        assert out["object"] == "chat.completion" and msg["role"] == "assistant"
        assert msg["content"] == fast.decode(gen["output_ids"]) and out["choices"][0]["finish_reason"] == "length"
        # OpenAI's metadata is a Dict[str, str]: the version spans joined, no list
        assert out["metadata"] == {"weight_version": "default", "weight_versions": "default:0-6"}
        # streaming: role first, then deltas that add up to the same text, usage last
        r = s.http.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        assert r.text.rstrip().endswith("data: [DONE]")
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
        assert text == msg["content"] and events[-1]["usage"]["completion_tokens"] == 6
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
        # bad input: a clear 400, and the server keeps serving
        for bad, words in (({"messages": []}, "messages is empty"), ({"messages": [{"content": "x"}]}, "string role"),
                           ({"messages": MESSAGES, "n": 2}, "n=2 is not supported")):
            r = s.http.post("/v1/chat/completions", json=bad)
            assert r.status_code == 400 and words in r.text, r.text
        assert s.http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"] == msg
    finally:
        assert s.stop() == 0, s.log[-3000:]


def test_chat_without_a_template_is_a_clear_error(server):
    r = server.http.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert r.status_code == 400 and "needs a tokenizer with a chat template" in r.text
