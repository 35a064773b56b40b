"""Every error case returns its status and the OpenAI error schema, while a stream runs
undisturbed; a client that goes away frees its request's KV blocks."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_harness import API_KEY, MODEL_NAME, PROMPT

pytestmark = pytest.mark.slow

ERROR_KEYS = {"message", "type", "param", "code"}
STREAM_TOKENS = 96
TOO_LONG = "word " * 9000  # more tokens than the 8192 of the model's context


class Case:
    """A bad request: ``json`` (or raw ``content``) POSTed to ``path``; what must come back."""

    def __init__(self, name, status, param=None, code=None, *, path="/v1/completions", json=None, content=None,
                 headers=None, method="POST", message=None):
        self.name, self.status, self.param, self.code = name, status, param, code
        self.path, self.json, self.content, self.method, self.message = path, json, content, method, message
        self.headers = {"Authorization": f"Bearer {API_KEY}", **(headers or {})}


def completion(**fields):
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, **fields}


def chat(**fields):
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **fields}


CHAT = "/v1/chat/completions"
CASES = [
    Case("negative max_tokens", 400, "max_tokens", "invalid_value", json=completion(max_tokens=-1),
         message="max_tokens: must be >= 0, got -1"),
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
    Case("n > 1", 400, "n", "unsupported_value", json=completion(n=2)),
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


def _stream(server, out: dict, first_chunk: threading.Event) -> None:
    """A greedy streaming chat request, run in a thread; its chunks go to ``out``."""
    chunks = []
    try:
        stream = server.openai().chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=STREAM_TOKENS,
            temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for chunk in stream:
            chunks.append(chunk)
            if chunk.choices and chunk.choices[0].delta.content:
                first_chunk.set()
    except Exception as exc:  # reported by the test
        out["error"] = exc
    finally:
        first_chunk.set()
        out["chunks"] = chunks


def test_errors_leave_a_running_stream_undisturbed(server):
    alone = server.openai().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=STREAM_TOKENS, temperature=0,
        extra_body={"ignore_eos": True})
    rejected_before = server.metrics()

    out, first_chunk = {}, threading.Event()
    thread = threading.Thread(target=_stream, args=(server, out, first_chunk))
    thread.start()
    assert first_chunk.wait(120), "the stream produced nothing"
    problems = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for case in CASES:
            problems += _check_error(_send(http, case), case)
        # The bounded queue: with room for one request only, the next one is refused.
        assert server.health()["num_pending"] == 1, "the stream ended before the error cases ran"
        saved, server.engine_loop.max_pending = server.engine_loop.max_pending, 1
        try:
            full = Case("queue full", 503, None, "queue_full", json=completion())
            problems += _check_error(_send(http, full), full)
        finally:
            server.engine_loop.max_pending = saved
    thread.join(300)
    assert not problems, "\n".join(problems)
    assert "error" not in out, out.get("error")

    *content, usage_chunk = out["chunks"]
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == alone.choices[0].message.content
    assert content[-1].choices[0].finish_reason == "length"
    assert usage_chunk.usage.completion_tokens == STREAM_TOKENS == alone.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == alone.usage.prompt_tokens
    server.wait_idle()

    after = server.metrics()
    rejected = {labels: after[(name, labels)] - rejected_before.get((name, labels), 0)
                for name, labels in after if name == "specdec_requests_rejected_total"}
    assert rejected.get((("status", "400"),)) == sum(c.status == 400 for c in CASES)
    assert rejected.get((("status", "401"),)) == 3 and rejected.get((("status", "503"),)) == 1


def _aborts(server) -> float:
    return server.metrics().get(("specdec_requests_total", (("finish_reason", "abort"),)), 0.0)


def test_a_cancelled_stream_frees_its_blocks(server):
    idle = server.wait_idle()
    aborts = _aborts(server)
    body = {"model": MODEL_NAME, "prompt": "Count from 1 to 1000:", "max_tokens": 2000, "ignore_eos": True,
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
            assert running["num_pending"] == 1 and running["num_free_kv_blocks"] < idle["num_kv_blocks"]
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
