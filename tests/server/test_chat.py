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


CALL = {"name": "search", "arguments": {"q": "w7", "k": 2}}
PIECES = ["Let me look.", "<tool_call>\n{\"name\": \"search\",", " \"arguments\": " + json.dumps(CALL["arguments"]) + "}\n</tool_call>"]


def test_qwen3_tool_calls_come_out_as_tool_calls(chat_model, tmp_path):
    """Qwen 3's <tool_call> blocks in the answer become OpenAI tool_calls (SGLang's qwen25 parser), streaming
    and not: the greedy tokens the tiny model answers with are renamed in a copy of the tokenizer to the
    pieces of a tool call, so the server decodes exactly what Qwen would write."""
    from tokenizers import Tokenizer
    d, fast = chat_model
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    prompt = fast.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    s = ServerProcess(d)
    try:
        out = s.http.post("/generate", json={"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}).json()["output_ids"]
    finally:
        assert s.stop() == 0, s.log[-3000:]
    ids = out[:3]
    assert len(set(out)) == 4 and not set(out) & set(prompt), (out, prompt)   # renaming them changes no prompt token
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    names = {i: w for w, i in vocab.items()}
    for i, piece in zip(ids, PIECES):
        vocab[piece] = vocab.pop(names[i])
    vocab["\n"] = vocab.pop(names[out[3]])   # the 4th ends the answer (a stop token), as a newline
    t2 = tmp_path / "tool"
    shutil.copytree(d, t2)
    (t2 / "tokenizer.json").write_text(json.dumps(tok))
    Tokenizer.from_file(str(t2 / "tokenizer.json"))   # still a valid tokenizer
    s = ServerProcess(t2)
    try:
        stop = {**body, "stop_token_ids": [out[3]], "ignore_eos": False}
        r = s.http.post("/v1/chat/completions", json=stop)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        calls = choice["message"]["tool_calls"]
        assert choice["message"]["content"] == "Let me look." and choice["finish_reason"] == "tool_calls"
        assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
            [("function", "search", CALL["arguments"])] and calls[0]["id"].startswith("call_")
        # streaming: the text before the call as content deltas, then the call once its block closed
        r = s.http.post("/v1/chat/completions", json={**stop, "stream": True})
        deltas = [json.loads(x[6:])["choices"][0] for x in r.text.splitlines() if x.startswith("data: {")]
        text = "".join(c["delta"].get("content") or "" for c in deltas)
        streamed = [tc for c in deltas for tc in c["delta"].get("tool_calls", [])]
        assert text.strip() == "Let me look." and "<tool_call>" not in text, text
        assert [(tc["index"], tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in streamed] == \
            [(0, "search", CALL["arguments"])]
        assert deltas[-1]["finish_reason"] == "tool_calls"
        # a call of a tool the request did not offer, or tool_choice none: the text stays as written
        for extra in ({"tools": [{"type": "function", "function": {"name": "searcher"}}]}, {"tool_choice": "none"}):
            msg = s.http.post("/v1/chat/completions", json={**stop, **extra}).json()["choices"][0]["message"]
            assert "tool_calls" not in msg and "<tool_call>" in msg["content"], (extra, msg)
        r = s.http.post("/v1/chat/completions", json={**stop, "tool_choice": "required"})
        assert r.status_code == 400 and "tool_choice='required' is not supported" in r.text, r.text
    finally:
        assert s.stop() == 0, s.log[-3000:]
