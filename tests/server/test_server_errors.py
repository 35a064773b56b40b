"""Every bad input returns its status and the OpenAI error schema while four streams run
undisturbed (the table of docs/server.md, "Limits and bad input"); OpenAI fields at their
defaults are accepted; a request the engine fails on gets ``engine_error`` and fails alone; a
client that goes away frees its request's KV blocks."""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import pytest
from server_harness import API_KEY, MODEL_NAME

from specdec.workloads import code_edit_prompts

pytestmark = pytest.mark.slow

ERROR_KEYS = {"message", "type", "param", "code"}
STREAM_TOKENS = 96
TOO_LONG = "word " * 9000  # more tokens than the 8192 of the model's context


class Case:
    """A bad request: ``json`` (or raw ``content``) POSTed to ``path``; what must come back."""

    def __init__(self, name, status, param=None, code=None, *, path="/v1/completions", json=None, content=None,
                 headers=None, method="POST", message=None):
        if json is not None and "max_tokens" in json and json["max_tokens"] is None:
            json = {k: v for k, v in json.items() if k != "max_tokens"}
        self.name, self.status, self.param, self.code = name, status, param, code
        self.path, self.json, self.content, self.method, self.message = path, json, content, method, message
        self.headers = {"Authorization": f"Bearer {API_KEY}", **(headers or {})}


def completion(**fields):
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, **fields}


def chat(**fields):
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **fields}


def raw(text: str) -> dict:
    """A body written as JSON text (NaN, Infinity and lone surrogates, which json= cannot send)."""
    return {"content": text.encode(), "headers": {"Content-Type": "application/json"}}


def raw_completion(fields: str) -> dict:
    return raw(f'{{"model": "{MODEL_NAME}", "prompt": "Hello", "max_tokens": 4, {fields}}}')


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

CHAT = "/v1/chat/completions"
CASES = [
    Case("negative max_tokens", 400, "max_tokens", "invalid_value", json=completion(max_tokens=-1),
         message="max_tokens: must be an integer >= 1, got -1"),
    Case("temperature below 0", 400, "temperature", "invalid_value", json=chat(temperature=-0.5), path=CHAT),
    Case("top_p above 1", 400, "top_p", "invalid_value", json=completion(top_p=1.5)),
    Case("negative seed", 400, "seed", "invalid_value", json=completion(seed=-1)),
    Case("prompt longer than the context", 400, "prompt", "context_length_exceeded",
         json=completion(prompt=TOO_LONG)),
    Case("chat longer than the context", 400, "messages", "context_length_exceeded", path=CHAT,
         json=chat(messages=[{"role": "user", "content": TOO_LONG}])),
    Case("malformed JSON", 400, None, "json_invalid", content=b'{"prompt": "hi",',
         headers={"Content-Type": "application/json"}),
    Case("body not an object", 400, None, "invalid_type", json=[1, 2]),
    Case("string for int", 400, "max_tokens", "invalid_type", json=completion(max_tokens="5"),
         message="max_tokens: expected int, got str '5'"),
    Case("float for int", 400, "max_tokens", "invalid_type", json=completion(max_tokens=2.5)),
    Case("string for bool", 400, "stream", "invalid_type", json=completion(stream="yes")),
    Case("wrong prompt type", 400, "prompt", "invalid_value", json=completion(prompt=5)),
    Case("wrong content type", 400, "messages[0].content", "invalid_value", path=CHAT,
         json=chat(messages=[{"role": "user", "content": 5}])),
    Case("no messages", 400, "messages", "invalid_value", path=CHAT, json=chat(messages=[])),
    Case("missing prompt", 400, "prompt", "missing_field", json={"model": MODEL_NAME}),
    Case("misspelt field", 400, "max_token", "unknown_field", json=completion(max_token=5),
         message="max_token: unknown field (did you mean 'max_tokens'?)"),
    Case("n 129", 400, "n", "invalid_value", json=completion(n=129)),
    # The logits controls and logprobs: SamplingParams' bounds, then the vocabulary.
    Case("presence_penalty false", 400, "presence_penalty", "invalid_value",
         json=completion(presence_penalty=False)),
    Case("presence_penalty 2.5", 400, "presence_penalty", "invalid_value", json=completion(presence_penalty=2.5)),
    Case("frequency_penalty a string", 400, "frequency_penalty", "invalid_value", path=CHAT,
         json=chat(frequency_penalty="1")),
    Case("repetition_penalty 0", 400, "repetition_penalty", "invalid_value", json=completion(repetition_penalty=0)),
    Case("min_p 1.5", 400, "min_p", "invalid_value", json=chat(min_p=1.5), path=CHAT),
    Case("logit_bias key not an id", 400, "logit_bias", "invalid_value", json=completion(logit_bias={"x": 1})),
    Case("logit_bias 101", 400, "logit_bias", "invalid_value", json=completion(logit_bias={"5": 101})),
    Case("logit_bias beyond the vocabulary", 400, "logit_bias", "invalid_value",
         json=completion(logit_bias={"49152": 1})),
    Case("logit_bias a list", 400, "logit_bias", "invalid_value", json=completion(logit_bias=[1, 2])),
    Case("stop_token_ids beyond the vocabulary", 400, "stop_token_ids", "invalid_value",
         json=completion(stop_token_ids=[49152])),
    Case("stop_token_ids not a list", 400, "stop_token_ids", "invalid_value", json=completion(stop_token_ids=5)),
    Case("completions logprobs 21", 400, "logprobs", "invalid_value", json=completion(logprobs=21)),
    Case("completions logprobs true", 400, "logprobs", "invalid_value", json=completion(logprobs=True)),
    Case("chat logprobs 1", 400, "logprobs", "invalid_value", json=chat(logprobs=1), path=CHAT),
    Case("chat top_logprobs 21", 400, "top_logprobs", "invalid_value", path=CHAT,
         json=chat(logprobs=True, top_logprobs=21)),
    Case("chat top_logprobs without logprobs", 400, "top_logprobs", "invalid_value", path=CHAT,
         json=chat(top_logprobs=2)),
    Case("stream_options without stream", 400, "stream_options", None,
         json=completion(stream_options={"include_usage": True})),
    Case("speculative: float k", 400, "speculative.num_speculative_tokens", "invalid_value",
         json=completion(speculative={"num_speculative_tokens": 2.5}),
         message="speculative.num_speculative_tokens: expected int, got float 2.5"),
    Case("speculative: unknown key", 400, "speculative", "invalid_value",
         json=completion(speculative={"num_speculative_token": 2}),
         message="speculative: unknown key 'num_speculative_token' (did you mean 'num_speculative_tokens'?)"),
    Case("speculative: above the server's k", 400, "speculative.num_speculative_tokens", "invalid_value",
         json=completion(speculative={"num_speculative_tokens": 9})),
    Case("speculative: negative k", 400, "speculative.num_speculative_tokens", "invalid_value",
         json=chat(speculative={"num_speculative_tokens": -1}), path=CHAT),
    # Sampling values: SamplingParams' bounds, then the engine's (vocabulary, stop limits, context).
    Case("top_k 2**63", 400, "top_k", "invalid_value", json=completion(top_k=2**63)),
    Case("top_k 1e30", 400, "top_k", "invalid_type", json=completion(top_k=1e30)),
    Case("top_k above the vocabulary", 400, "top_k", "invalid_value", json=completion(top_k=49153)),
    Case("top_k -2", 400, "top_k", "invalid_value", json=completion(top_k=-2)),
    Case("temperature NaN", 400, "temperature", "invalid_value", **raw_completion('"temperature": NaN')),
    Case("temperature Infinity", 400, "temperature", "invalid_value", **raw_completion('"temperature": Infinity')),
    Case("temperature -Infinity", 400, "temperature", "invalid_value",
         **raw_completion('"temperature": -Infinity')),
    Case("temperature 1e-40", 400, "temperature", "invalid_value", json=completion(temperature=1e-40)),
    Case("temperature 1000", 400, "temperature", "invalid_value", json=chat(temperature=1000), path=CHAT),
    Case("temperature a string", 400, "temperature", "invalid_type", json=completion(temperature="hot")),
    Case("top_p 0", 400, "top_p", "invalid_value", json=completion(top_p=0)),
    Case("top_p NaN", 400, "top_p", "invalid_value", **raw_completion('"top_p": NaN')),
    Case("seed 2**64", 400, "seed", "invalid_value", json=completion(seed=2**64)),
    Case("seed a float", 400, "seed", "invalid_type", json=completion(seed=1.5)),
    Case("empty stop string", 400, "stop", "invalid_value", json=completion(stop=[""])),
    Case("empty stop", 400, "stop", "invalid_value", json=chat(stop=""), path=CHAT),
    Case("17 stop strings", 400, "stop", "invalid_value", json=completion(stop=[f"s{i}" for i in range(17)])),
    Case("257-character stop", 400, "stop", "invalid_value", json=completion(stop=["x" * 257])),
    Case("200k stop strings", 400, "stop", "invalid_value", json=completion(stop=["ab"] * 200_000)),
    Case("stop of ints", 400, "stop", "invalid_value", json=completion(stop=[1])),
    Case("max_tokens 1e30", 400, "max_tokens", "invalid_type", json=completion(max_tokens=1e30)),
    Case("max_tokens 10**30", 400, "max_tokens", "context_length_exceeded", json=completion(max_tokens=10**30)),
    Case("max_tokens 0", 400, "max_tokens", "invalid_value", json=completion(max_tokens=0)),
    Case("prompt + max_tokens over the context", 400, "max_tokens", "context_length_exceeded",
         json=completion(max_tokens=8192)),
    Case("chat + max_completion_tokens over the context", 400, "max_tokens", "context_length_exceeded",
         json=chat(max_tokens=None, max_completion_tokens=9000), path=CHAT),
    # Text that is no valid Unicode (a lone surrogate from a JSON escape), token ids out of range.
    Case("surrogate in the prompt", 400, "prompt", "invalid_value",
         **raw(f'{{"model": "{MODEL_NAME}", "prompt": "a\\ud800b", "max_tokens": 4}}')),
    Case("surrogate in a message", 400, "messages[0].content", "invalid_value", path=CHAT,
         **raw(f'{{"model": "{MODEL_NAME}", "messages": [{{"role": "user", "content": "a\\udfffb"}}]}}')),
    Case("surrogate in a stop string", 400, "stop", "invalid_value", **raw_completion('"stop": ["\\ud800"]')),
    Case("token id above the vocabulary", 400, "prompt", "invalid_value", json=completion(prompt=[1, 49152])),
    Case("token id 2**70", 400, "prompt", "invalid_value", json=completion(prompt=[1, 2**70])),
    Case("negative token id", 400, "prompt", "invalid_value", json=completion(prompt=[-1])),
    Case("empty prompt", 400, "prompt", "invalid_value", json=completion(prompt="")),
    Case("empty token list", 400, "prompt", "invalid_value", json=completion(prompt=[])),
    Case("n 0", 400, "n", "invalid_value", json=completion(n=0)),
    Case("role not a string", 400, "messages[0].role", "invalid_type", path=CHAT,
         json=chat(messages=[{"role": 5, "content": "hi"}])),
    Case("image part", 400, "messages[0].content", "invalid_value", path=CHAT,
         json=chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])),
    Case("speculative not an object", 400, "speculative", "invalid_type", json=completion(speculative="x")),
    Case("include_usage not a bool", 400, "stream_options.include_usage", "invalid_type",
         json=completion(stream=True, stream_options={"include_usage": "yes"})),
    Case("user not a string", 400, "user", "invalid_type", json=completion(user=5)),
    # OpenAI fields specdec does not act on: accepted at their defaults only.
    Case("best_of 2", 400, "best_of", "unsupported_value", json=completion(best_of=2)),
    Case("echo", 400, "echo", "unsupported_value", json=completion(echo=True)),
    Case("suffix", 400, "suffix", "unsupported_value", json=completion(suffix="}")),
    # Structured output and tools (tests/server/test_structured_output.py has more).
    Case("tool name", 400, "tools[0].function.name", "invalid_value", path=CHAT,
         json=chat(tools=[{"type": "function", "function": {"name": "f g"}}])),
    Case("tool_choice required without tools", 400, "tool_choice", "invalid_value", path=CHAT,
         json=chat(tool_choice="required")),
    Case("tool_choice of no tool", 400, "tool_choice.function.name", "invalid_value", path=CHAT,
         json=chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}})),
    Case("schema that does not compile", 400, "response_format.json_schema.schema.properties.a", "invalid_value",
         path=CHAT, json=chat(response_format={"type": "json_schema", "json_schema": {
             "name": "s", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}})),
    Case("message tool_calls", 400, "messages[0].tool_calls[0].function", "missing_field", path=CHAT,
         json=chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}])),
    Case("tool message without its call id", 400, "messages[0].tool_call_id", "invalid_value", path=CHAT,
         json=chat(messages=[{"role": "tool", "content": "4"}])),
    Case("unknown model", 404, "model", "model_not_found", json=completion(model="gpt-4")),
    Case("unknown route", 404, path="/v1/embeddings", json={}),
    Case("missing API key", 401, None, "invalid_api_key", json=completion(), headers={"Authorization": ""}),
    Case("wrong API key", 401, None, "invalid_api_key", path=CHAT, json=chat(),
         headers={"Authorization": "Bearer not-the-key"}),
    Case("models without API key", 401, None, "invalid_api_key", path="/v1/models", method="GET",
         headers={"Authorization": ""}),
]


def _send(http: httpx.Client, case: Case) -> httpx.Response:
    headers = {k: v for k, v in case.headers.items() if v}
    if case.method == "GET":
        return http.get(case.path, headers=headers)
    if case.content is not None:
        return http.post(case.path, content=case.content, headers=headers)
    return http.post(case.path, json=case.json, headers=headers)


def _check_error(response: httpx.Response, case: Case) -> list[str]:
    problems = []
    if response.status_code != case.status:
        problems.append(f"{case.name}: status {response.status_code}, expected {case.status}: {response.text}")
    try:
        body = response.json()
    except json.JSONDecodeError:
        return problems + [f"{case.name}: not JSON: {response.text!r}"]
    error = body.get("error") if isinstance(body, dict) else None
    if set(body) != {"error"} or not isinstance(error, dict) or set(error) != ERROR_KEYS:
        return problems + [f"{case.name}: not the OpenAI error schema: {body}"]
    if (error["param"], error["code"]) != (case.param, case.code):
        problems.append(f"{case.name}: param/code {error['param']!r}/{error['code']!r}, "
                        f"expected {case.param!r}/{case.code!r}")
    if not error["message"] or "\n" in error["message"] or not error["type"]:
        problems.append(f"{case.name}: bad message/type {error}")
    if case.message is not None and error["message"] != case.message:
        problems.append(f"{case.name}: message {error['message']!r}, expected {case.message!r}")
    return problems


#: The requests that stream while the bad ones are sent: two chats, two completions.
STREAM_PROMPTS = [code_edit_prompts(5)[i] for i in (2, 0, 1, 3)]


def _stream_kwargs(i: int) -> dict:
    common = dict(model=MODEL_NAME, max_tokens=STREAM_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    if i % 2 == 0:
        return dict(common, messages=[{"role": "user", "content": STREAM_PROMPTS[i]}])
    return dict(common, prompt=STREAM_PROMPTS[i])


def _solo_text(server, i: int) -> str:
    client = server.openai()
    if i % 2 == 0:
        return client.chat.completions.create(**_stream_kwargs(i)).choices[0].message.content
    return client.completions.create(**_stream_kwargs(i)).choices[0].text


def _stream(server, i: int, out: dict, first_chunk: threading.Event) -> None:
    """Stream request ``i``, run in a thread; its text, finish reason and usage go to ``out``."""
    texts, finish, usage = [], None, None
    try:
        client = server.openai()
        create = client.chat.completions.create if i % 2 == 0 else client.completions.create
        for chunk in create(**_stream_kwargs(i), stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text = choice.delta.content if i % 2 == 0 else choice.text
                if text:
                    texts.append(text)
                    first_chunk.set()
                finish = choice.finish_reason or finish
    except Exception as exc:  # reported by the test
        out["error"] = exc
    finally:
        first_chunk.set()
        out.update(text="".join(texts), finish_reason=finish, usage=usage)


def test_bad_input_leaves_running_streams_undisturbed(server):
    """Every bad request gets its 4xx in the OpenAI schema while four streams run; the streams
    then hold exactly the text they give alone."""
    assert len(CASES) >= 49
    alone = [_solo_text(server, i) for i in range(len(STREAM_PROMPTS))]
    rejected_before = server.metrics()

    outs = [{} for _ in STREAM_PROMPTS]
    started = [threading.Event() for _ in STREAM_PROMPTS]
    threads = [threading.Thread(target=_stream, args=(server, i, outs[i], started[i]))
               for i in range(len(STREAM_PROMPTS))]
    for thread in threads:
        thread.start()
    assert all(event.wait(120) for event in started), "a stream produced nothing"
    problems = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for case in CASES:
            problems += _check_error(_send(http, case), case)
        # The bounded queue: with room for the streams only, the next request is refused.
        assert server.health()["num_pending"] == len(STREAM_PROMPTS), "a stream ended before the error cases ran"
        saved, server.engine_loop.max_pending = server.engine_loop.max_pending, len(STREAM_PROMPTS)
        try:
            full = Case("queue full", 503, None, "queue_full", json=completion())
            problems += _check_error(_send(http, full), full)
        finally:
            server.engine_loop.max_pending = saved
    for thread in threads:
        thread.join(300)
    assert not problems, "\n".join(problems)
    for i, out in enumerate(outs):
        assert "error" not in out, out.get("error")
        assert out["text"] == alone[i], f"stream {i} differs from its solo run"
        assert out["finish_reason"] == "length" and out["usage"].completion_tokens == STREAM_TOKENS
    server.wait_idle()

    after = server.metrics()
    rejected = {labels: after[(name, labels)] - rejected_before.get((name, labels), 0)
                for name, labels in after if name == "specdec_requests_rejected_total"}
    assert rejected.get((("status", "400"),)) == sum(c.status == 400 for c in CASES)
    assert rejected.get((("status", "401"),)) == 3 and rejected.get((("status", "503"),)) == 1


@pytest.mark.parametrize("path, fields", [
    ("/v1/completions", {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u-1",
                         "logprobs": None, "best_of": 1, "echo": False, "suffix": None, "n": 1, "top_k": -1,
                         "metadata": {"trace": "x"}, "store": False, "service_tier": "auto"}),
    (CHAT, {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "logprobs": False,
            "top_logprobs": 0, "tools": [], "tool_choice": "none", "parallel_tool_calls": True,
            "response_format": {"type": "text"}, "modalities": ["text"], "user": "u-2", "seed": 2**64 - 1}),
], ids=["completions", "chat"])
def test_openai_fields_at_their_defaults_are_accepted(server, path, fields):
    """Clients send these on every request (the official SDKs' defaults, LangChain's, ...)."""
    body = (completion if path != CHAT else chat)(**fields)
    response = server.http.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def _aborts(server) -> float:
    return server.metrics().get(("specdec_requests_total", (("finish_reason", "abort"),)), 0.0)


def test_a_cancelled_stream_frees_its_blocks(server):
    idle = server.wait_idle()
    aborts = _aborts(server)
    # 8000 tokens take this engine about a minute: still running when the third event arrives,
    # however slow the machine (2000, about 12 s here, once finished first on a loaded CI box)
    body = {"model": MODEL_NAME, "prompt": "Count from 1 to 1000:", "max_tokens": 8000, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break
            running = server.health()
            assert running["num_pending"] == 1 and running["num_free_kv_blocks"] < idle["num_kv_blocks"], running
        # leaving the block closes the connection mid-stream
    health = server.wait_idle(timeout=15)
    assert health["num_free_kv_blocks"] == idle["num_free_kv_blocks"] == idle["num_kv_blocks"]
    assert _aborts(server) == aborts + 1


def test_a_client_gone_before_a_plain_response_frees_its_blocks(server):
    server.wait_idle()
    aborts = _aborts(server)
    body = {"model": MODEL_NAME, "prompt": "Count from 1 to 1000:", "max_tokens": 2000, "ignore_eos": True}
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0),
                   headers={"Authorization": f"Bearer {API_KEY}"})
    server.wait_idle(timeout=15)
    assert _aborts(server) == aborts + 1
    assert time.monotonic() - start < 15  # aborted, not run to its 2000 tokens


def test_a_request_the_engine_fails_on_gets_engine_error_and_the_others_go_on(server, monkeypatch):
    """A verify strategy that raises for one request (found by its top_p): that request gets a
    500 ``engine_error`` (plain) or an error event with the code (streamed), no exception text,
    and finish reason ``error`` in /metrics; a request beside it finishes with its solo text."""
    verifier = server.engine_loop.engine.verifier
    real_verify = verifier.verify

    def verify(inputs):
        if np.any(np.isclose(inputs.sampling.top_p, 0.999)):
            raise OverflowError("Python int too large to convert to C long")
        return real_verify(inputs)

    healthy = dict(model=MODEL_NAME, prompt=STREAM_PROMPTS[1], max_tokens=STREAM_TOKENS, temperature=0,
                   extra_body={"ignore_eos": True})
    alone = server.openai().completions.create(**healthy).choices[0].text
    errors_before = server.metrics().get(("specdec_requests_total", (("finish_reason", "error"),)), 0)
    monkeypatch.setattr(verifier, "verify", verify)

    out = {}
    beside = threading.Thread(target=lambda: out.update(text=server.openai().completions.create(**healthy)
                                                        .choices[0].text))
    beside.start()
    plain = server.http.post("/v1/completions", json=completion(top_p=0.999, temperature=0))
    assert plain.status_code == 500
    assert plain.json()["error"]["code"] == "engine_error"
    assert "Overflow" not in plain.text and "C long" not in plain.text
    with server.http.stream("POST", "/v1/completions", json=completion(top_p=0.999, stream=True)) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_error" and error["type"] == "server_error"
    assert "Overflow" not in error["message"]
    beside.join(300)
    assert out["text"] == alone
    after = server.metrics().get(("specdec_requests_total", (("finish_reason", "error"),)), 0)
    assert after == errors_before + 2
