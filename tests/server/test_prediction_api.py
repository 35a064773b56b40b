"""Predicted Outputs and the tokenizer endpoints through the official ``openai`` client and
httpx, against the session's real server (ngram, greedy verification).

- ``prediction`` on chat and completions, streamed and not, alone and batched with requests
  without one: the text is the one the request gets without a prediction, and
  ``usage.completion_tokens_details`` counts the accepted and rejected prediction tokens (in
  the streamed usage chunk too).
- Every bad ``prediction`` is a 400 in the OpenAI error schema naming the field.
- ``/tokenize`` and ``/detokenize`` as vLLM serves them: the count of a chat equals the
  ``prompt_tokens`` a chat request is billed, ids round-trip to text, a bad id is a 400
  naming ``tokens``, the API key is required.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from server_harness import API_KEY, MODEL_NAME

from specdec.workloads import code_edit_tasks

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def task():
    messages, prediction = code_edit_tasks(2, max_lines=14)[1]
    return messages, prediction


@pytest.fixture(scope="module")
def plain_chat(server, task):
    messages, _ = task
    return server.openai().chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                                   temperature=0)


def _prediction(text) -> dict:
    return {"type": "content", "content": text}


def test_chat_with_a_prediction_gives_the_same_text_and_counts_it(server, task, plain_chat):
    messages, prediction = task
    client = server.openai()
    response = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=0, prediction=_prediction(prediction))
    assert response.choices[0].message.content == plain_chat.choices[0].message.content
    details = response.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > details.rejected_prediction_tokens >= 0
    assert details.accepted_prediction_tokens <= response.usage.completion_tokens
    assert plain_chat.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert plain_chat.usage.completion_tokens_details.rejected_prediction_tokens == 0
    # Streamed, with the content as a list of text parts (OpenAI takes both).
    parts = [{"type": "text", "text": prediction[:20]}, {"type": "text", "text": prediction[20:]}]
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0, prediction=_prediction(parts), stream=True,
                                            stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == plain_chat.choices[0].message.content
    assert usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_completions_with_a_prediction_streamed_and_not(server, task):
    messages, prediction = task
    prompt = server.engine_loop.tokenizer.apply_chat_template(messages)
    client = server.openai()
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    body = {"prediction": _prediction(prediction)}
    predicted = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body=body)
    assert predicted.choices[0].text == plain.choices[0].text
    assert predicted.usage.completion_tokens_details.accepted_prediction_tokens > 0
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body=body, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_batched_requests_with_and_without_predictions_get_their_own_texts(server, task, plain_chat):
    """Three at once: the prediction drafts for its own request alone."""
    messages, prediction = task
    other = [{"role": "user", "content": "Write a short poem about the sea at night."}]
    alone = server.openai().chat.completions.create(model=MODEL_NAME, messages=other, max_tokens=MAX_TOKENS,
                                                    temperature=0).choices[0].message.content

    async def run():
        client = server.async_openai()
        calls = [client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, prediction=_prediction(prediction)),
                 client.chat.completions.create(model=MODEL_NAME, messages=other, max_tokens=MAX_TOKENS,
                                                temperature=0),
                 # The wrong prediction for the poem: rejected drafts, the same poem.
                 client.chat.completions.create(model=MODEL_NAME, messages=other, max_tokens=MAX_TOKENS,
                                                temperature=0, prediction=_prediction(prediction))]
        return await asyncio.gather(*calls)

    edited, poem, poem_predicted = asyncio.run(run())
    assert edited.choices[0].message.content == plain_chat.choices[0].message.content
    assert edited.usage.completion_tokens_details.accepted_prediction_tokens > 0
    assert poem.choices[0].message.content == alone
    assert poem_predicted.choices[0].message.content == alone
    assert poem.usage.completion_tokens_details.accepted_prediction_tokens == 0


BAD_PREDICTIONS = [
    ("a string", "code", "prediction"),
    ("wrong type", {"type": "text", "content": "x"}, "prediction.type"),
    ("no type", {"content": "x"}, "prediction.type"),
    ("no content", {"type": "content"}, "prediction.content"),
    ("content a number", {"type": "content", "content": 5}, "prediction.content"),
    ("an image part", {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "prediction.content[0]"),
    ("a part without text", {"type": "content", "content": [{"type": "text"}]}, "prediction.content[0]"),
    ("an unknown key", {"type": "content", "content": "x", "extra": 1}, "prediction.extra"),
    ("more tokens than the context", {"type": "content", "content": "word " * 9000}, "prediction.content"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_predictions_are_400s_naming_the_field(server, path):
    base = {"model": MODEL_NAME, "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"})
    for name, prediction, param in [*BAD_PREDICTIONS, ("with n=2", _prediction("x"), "prediction")]:
        body = {**base, "prediction": prediction}
        if name == "with n=2":
            body["n"] = 2
        response = server.http.post(path, json=body)
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert set(error) == ERROR_KEYS and error["param"] == param, (name, error)
        assert error["message"].startswith(param), (name, error)
    assert server.health()["status"] == "ok"


# -- /tokenize and /detokenize -----------------------------------------------------------------


def test_tokenize_counts_what_a_chat_request_is_billed(server, task, plain_chat):
    messages, _ = task
    response = server.http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["count"] == len(body["tokens"]) == plain_chat.usage.prompt_tokens
    assert body["max_model_len"] == server.engine_loop.max_model_len
    without = server.http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert without["count"] < body["count"] and body["tokens"][:without["count"]] == without["tokens"]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_CONVERSATION = [
    {"role": "user", "content": "What is the weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Rain, 4 degrees."},
]


def test_tokenize_counts_a_tool_conversation_as_a_chat_request_is_billed(server):
    """Past calls, tool results and the tools offered are prompt text: /tokenize renders them
    as the chat endpoint does, with the same ``tools``."""
    billed = {}
    for name, extra in (("with tools", {"tools": [WEATHER_TOOL]}), ("without", {})):
        usage = server.openai().chat.completions.create(model=MODEL_NAME, messages=TOOL_CONVERSATION, max_tokens=1,
                                                        temperature=0, **extra).usage
        body = server.http.post("/tokenize", json={"model": MODEL_NAME, "messages": TOOL_CONVERSATION, **extra}).json()
        assert body["count"] == len(body["tokens"]) == usage.prompt_tokens, (name, body["count"], usage)
        billed[name] = body["count"]
    assert billed["with tools"] > billed["without"]


def test_history_arguments_nested_deeper_than_json_decodes_are_no_server_error(server):
    """A past call's ``arguments`` that nest deeper than the JSON decoder goes (a RecursionError,
    a 500 before) are rendered as the text the client sent."""
    arguments = "[" * 1200 + "]" * 1200  # past the decoder's depth, in few tokens
    messages = [TOOL_CONVERSATION[0], {**TOOL_CONVERSATION[1], "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": arguments}}]},
        TOOL_CONVERSATION[2]]
    body = {"model": MODEL_NAME, "messages": messages, "tools": [WEATHER_TOOL]}
    counted = server.http.post("/tokenize", json=body)
    chat = server.http.post("/v1/chat/completions", json={**body, "max_tokens": 1, "temperature": 0})
    assert counted.status_code == chat.status_code == 200, (counted.text[:200], chat.text[:200])
    assert counted.json()["count"] == chat.json()["usage"]["prompt_tokens"]


def test_tokenize_and_detokenize_round_trip(server):
    text = "def f(x):\n    return x + 1  # héllo"
    body = server.http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 3
    back = server.http.post("/detokenize", json={"model": MODEL_NAME, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"prompt": "a", "promt": "b"}, "promt"),
    ("/tokenize", {"prompt": "a", "tools": [WEATHER_TOOL]}, "tools"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "web"}]}, "tools[0].type"),
])
def test_bad_tokenizer_requests_are_400s_naming_the_field(server, path, body, param):
    response = server.http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["param"] == param, error


def test_the_tokenizer_endpoints_need_the_api_key(server):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        response = httpx.post(server.url + path, json=body, timeout=30)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}x"}, timeout=30)
        assert wrong.status_code == 401
