"""The official `openai` client against /v1/completions with token-id prompts."""
from __future__ import annotations

import openai
import pytest

PROMPT = [7, 21, 42, 99, 100, 256, 300]


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def test_models_list(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [server.http.get("/get_model_info").json()["served_model_name"]]


def test_completion_matches_native_generate(client, server):
    model = client.models.list().data[0].id
    c = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    assert c.object == "text_completion" and len(c.choices) == 1
    ch = c.choices[0]
    assert ch.finish_reason == "length" and ch.text == ""
    assert c.usage.prompt_tokens == len(PROMPT) and c.usage.completion_tokens == 6
    ids = ch.model_extra["token_ids"]
    assert ch.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert len(ch.logprobs.token_logprobs) == 6 and all(lp <= 0 for lp in ch.logprobs.token_logprobs)
    native = server.http.post("/generate", json={
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        "return_logprob": True}).json()
    assert ids == native["output_ids"]
    assert ch.logprobs.token_logprobs == pytest.approx([x[0] for x in native["meta_info"]["output_token_logprobs"]],
                                                       abs=1e-4)


def test_streaming_completion_with_usage(client):
    stream = client.completions.create(model=client.models.list().data[0].id, prompt=[PROMPT, PROMPT[:4]],
                                       max_tokens=5, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    ids = {0: [], 1: []}
    finish, usage = {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            ids[ch.index] += ch.model_extra["token_ids"]          # OpenAI chunks are deltas
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert [len(ids[0]), len(ids[1])] == [5, 5] and finish == {0: "length", 1: "length"}
    assert usage.completion_tokens == 10 and usage.prompt_tokens == len(PROMPT) + 4
    again = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].model_extra["token_ids"] == ids[0]


def test_openai_errors_are_api_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=client.models.list().data[0].id, prompt=[1, 2], max_tokens=2, n=2)
    assert "n=2" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="tokenizer"):
        client.completions.create(model=client.models.list().data[0].id, prompt="hello", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="some-other-model", prompt=[1, 2], max_tokens=2)
