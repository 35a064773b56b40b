"""Trust at the HTTP edge (docs/deployment.md, "Security", "HTTP"): the attacks of the issue,
sent the way an attacker sends them, at a server built as ``specdec serve`` builds it on
loopback, while a stream runs.

- Bodies trickled a byte at a time, never pausing long enough for ``--read-timeout``: each
  gets 408 at ``--body-timeout`` and lets go of its connection.
- A prompt of two million token ids: refused before the engine thread sees it.
- A giant chat ``role`` or ``name``, and a chat of 200,000 empty messages: within the prompt
  limits now, refused before they are rendered or tokenized.
- DNS rebinding (``Host: attacker.example``, even with the key): 421.
- A client that stops reading its stream: cut off at ``--send-timeout``, its request aborted.

The server's deadlines are short (seconds) so that the slow attacks take seconds; the stream
completes with the text of plain (naive) decoding, and the process's RSS stays within 10% of
its value before the attacks.
"""

from __future__ import annotations

import gc
import json
import re
import threading
import time

import httpx
import pytest
from server_harness import API_KEY, ERROR_KEYS, MODEL_NAME, raw_error, read_until_closed, serving

from specdec.server.hosts import default_allowed_hosts, parse_allowed_hosts
from specdec.server.limits import ServerLimits
from specdec.workloads import code_edit_prompts

pytestmark = pytest.mark.slow

EDGE_LIMITS = ServerLimits(read_timeout=0.5, body_timeout=1.5, send_timeout=1.0)
SLACK = 2.0
SLOW_BODIES = 20
#: Long enough for the stream to outlast the attacks (about 2 s).
STREAM_TOKENS = 256
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def edge(server):
    """The edge server: short deadlines, and small socket send buffers, so that a client that
    stops reading fills them in a few hundred events."""
    with serving(server.engine_loop, limits=EDGE_LIMITS, send_buffer=4096) as served:
        yield served


def _rss_kib() -> int:
    """The resident memory of this process (the server runs in it), in KiB."""
    with open("/proc/self/status") as status:
        return int(re.search(r"VmRSS:\s+(\d+) kB", status.read()).group(1))


def _error(response: httpx.Response, status: int, code: str, param=None) -> str:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and (error["code"], error["param"]) == (code, param), error
    assert error["message"] and "\n" not in error["message"]
    return error["message"]


class _Trickler(threading.Thread):
    """Sends a byte to each socket every ``interval`` seconds (well within the read timeout,
    so no pause is ever long enough to be refused for), until told to stop."""

    def __init__(self, socks, interval: float):
        super().__init__(name="trickler")
        self.socks, self.interval, self.stop = list(socks), interval, threading.Event()

    def run(self):
        while self.socks and not self.stop.wait(self.interval):
            for sock in list(self.socks):
                try:
                    sock.send(b" ")
                except OSError:  # the server has let go
                    self.socks.remove(sock)


def _post_built(http: httpx.Client, path: str, opening: bytes, piece: bytes, count: int, closing: bytes):
    """POST a JSON body of ``opening``, ``count`` times ``piece`` and ``closing``, written as it
    is sent, as an attacker writes it: the body is never whole in this process (the server
    runs here too, and the test measures the memory it keeps)."""

    def body():
        yield opening
        for _ in range(count):
            yield piece
        yield closing

    length = len(opening) + count * len(piece) + len(closing)
    return http.post(path, content=body(), headers={"Content-Type": "application/json",
                                                     "Content-Length": str(length)})


def _stream(edge, out: dict, first: threading.Event) -> None:
    texts = []
    try:
        client = edge_openai(edge)
        for chunk in client.completions.create(model=MODEL_NAME, prompt=code_edit_prompts(5)[1],
                                               max_tokens=STREAM_TOKENS, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}):
            for choice in chunk.choices:
                texts.append(choice.text)
                out["finish_reason"] = choice.finish_reason or out.get("finish_reason")
            first.set()
    except Exception as exc:  # reported by the test
        out["error"] = exc
    finally:
        first.set()
        out["text"] = "".join(texts)


def edge_openai(edge):
    import openai

    return openai.OpenAI(base_url=edge.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _two_million_ids(http: httpx.Client) -> httpx.Response:
    """A prompt of two million token ids (4 MB, within the body limit)."""
    return _post_built(http, "/v1/completions", b'{"model":"%s","max_tokens":4,"prompt":[1' % MODEL_NAME.encode(),
                       b",1" * 1000, 1999, b",1" * 999 + b"]}")


def test_edge_attacks_leave_a_stream_its_naive_text(edge, server, monkeypatch):
    naive = edge_openai(edge).completions.create(
        model=MODEL_NAME, prompt=code_edit_prompts(5)[1], max_tokens=STREAM_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "speculative": {"num_speculative_tokens": 0}}).choices[0].text
    # Parsing one 4 MB JSON array leaves CPython's allocators some 20-30 MB larger for good
    # (measured; a second parse reuses it): any long-running server has parsed such a body.
    # The RSS is measured after one, so that what the attacks make the server keep shows.
    with httpx.Client(base_url=edge.url, headers=AUTH, timeout=60) as http:
        assert _two_million_ids(http).status_code == 400
    engine = server.engine_loop.engine
    max_model_len = engine.max_model_len
    reached_engine = []  # the prompt lengths the engine thread was given
    add_request = engine.add_request
    monkeypatch.setattr(engine, "add_request",
                        lambda ids, *args, **kwargs: reached_engine.append(len(ids)) or add_request(ids, *args, **kwargs))
    gc.collect()
    rss_before = _rss_kib()

    out, first = {}, threading.Event()
    streaming = threading.Thread(target=_stream, args=(edge, out, first))
    streaming.start()
    assert first.wait(120) and "error" not in out, out.get("error")

    # 1. Slow bodies: heads complete, then a byte every 0.2 s of a 100 kB body.
    start = time.monotonic()
    slow = [edge.connect() for _ in range(SLOW_BODIES)]
    for sock in slow:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + API_KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
    trickler = _Trickler(slow, 0.2)
    trickler.start()
    answers = {}  # read as they come, while the other attacks run
    reader = threading.Thread(target=lambda: answers.update(
        zip(("received", "closed"), read_until_closed(slow, EDGE_LIMITS.body_timeout + SLACK + 10))))
    reader.start()
    try:
        with httpx.Client(base_url=edge.url, headers=AUTH, timeout=60) as http:
            # 2. DNS rebinding: the browser names the attacker's host; the key does not help it.
            for method, path in (("POST", "/v1/completions"), ("GET", "/health"), ("GET", "/metrics")):
                response = http.request(method, path, headers={"Host": f"attacker.example:{edge.port}"},
                                        json={"model": MODEL_NAME, "prompt": "hi"} if method == "POST" else None)
                message = _error(response, 421, "host_not_allowed")
            assert message.startswith("host: 'attacker.example:") and "--allowed-hosts" in message
            assert http.get("/health", headers={"Host": f"localhost:{edge.port}"}).status_code == 200
            assert http.get("/health", headers={"Host": f"[::1]:{edge.port}"}).status_code == 200

            # 3. Two million token ids (4 MB, within the body limit): refused before the engine thread.
            message = _error(_two_million_ids(http), 400, "context_length_exceeded", "prompt")
            assert message == f"prompt: 2000000 tokens do not fit the context of {max_model_len} tokens"

            # 4. A giant role, a giant name, 200,000 empty messages: counted, refused before rendering.
            for field in ("role", "name"):
                given = b'"role":"' if field == "role" else b'"role":"user","name":"'
                opening = b'{"model":"%s","messages":[{"content":"hi",%s' % (MODEL_NAME.encode(), given)
                started = time.perf_counter()
                response = _post_built(http, "/v1/chat/completions", opening, b"x" * 1000, 3000, b'"}]}')
                error = _error(response, 400, "context_length_exceeded", "messages")
                num_chars = 3_000_000 + len("hi") + (len("user") if field == "name" else 0)
                assert error.startswith(f"messages: {num_chars} characters in all messages (roles, names, contents) "
                                        "is more than this server takes"), error
                assert time.perf_counter() - started < 2.0, "was it tokenized?"
            response = _post_built(http, "/v1/chat/completions", b'{"model":"%s","messages":[{"role":"user"}'
                                   % MODEL_NAME.encode(), b',{"role":"user"}' * 1000, 200, b"]}")
            error = _error(response, 400, "context_length_exceeded", "messages")
            assert error == f"messages: 200001 messages do not fit the context of {max_model_len} tokens"

        attacks_done = time.monotonic()  # the big bodies above hold the event loop (for seconds on a busy box)
        reader.join(EDGE_LIMITS.body_timeout + SLACK + 15)
        assert streaming.is_alive(), "the stream ended before the attacks did: raise STREAM_TOKENS"
    finally:
        trickler.stop.set()
        trickler.join(10)
        reader.join(30)
        for sock in slow:
            sock.close()
    received, closed = answers["received"], answers["closed"]
    assert len(closed) == SLOW_BODIES, f"{SLOW_BODIES - len(closed)} slow bodies still hold their connection"
    for sock in slow:
        assert start + EDGE_LIMITS.body_timeout * 0.9 <= closed[sock] <= max(start + EDGE_LIMITS.body_timeout,
                                                                                 attacks_done) + SLACK
        error = raw_error(received[sock], 408, "request_timeout")
    assert error["message"] == "the request body: not complete within 1.5 s (--body-timeout)"

    streaming.join(120)
    assert "error" not in out, out.get("error")
    assert out["text"] == naive and out["finish_reason"] == "length"
    assert reached_engine and max(reached_engine) < max_model_len
    gc.collect()
    rss_after = _rss_kib()
    assert rss_after <= rss_before * 1.1, f"RSS {rss_before} -> {rss_after} KiB"
    server.wait_idle()


def _aborts(server) -> float:
    return server.metrics().get(("specdec_requests_total", (("finish_reason", "abort"),)), 0.0)


def test_a_client_that_stops_reading_is_cut_off_and_its_request_aborted(edge, server):
    """A stream of 8000 tokens (about a minute here) whose client reads its first event and
    then nothing: once the buffers are full, ``--send-timeout`` later, the server cuts the
    connection, and the request is aborted (not finished), its batch slot and KV blocks freed.
    Without the send timeout it ran to its 8000 tokens, and its connection stayed open."""
    idle = server.wait_idle()
    aborts = _aborts(server)
    sock = edge.connect(SO_RCVBUF=4096)
    try:
        body = json.dumps({"model": MODEL_NAME, "prompt": "Count from 1 to 1000:", "max_tokens": 8000,
                           "ignore_eos": True, "stream": True, "temperature": 0}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (API_KEY.encode(), len(body), body))
        received = b""
        while b"data: " not in received:
            received += sock.recv(256)
        assert received.startswith(b"HTTP/1.1 200 ")
        assert server.health()["num_pending"] == 1
        health = server.wait_idle(timeout=60)
        assert _aborts(server) == aborts + 1, "the request was not aborted"
        assert health["num_free_kv_blocks"] == idle["num_kv_blocks"]
        deadline = time.monotonic() + 5
        while edge.num_connections:
            assert time.monotonic() < deadline, "the server still holds the connection"
            time.sleep(0.01)
    finally:
        sock.close()


def test_allowed_hosts_defaults_and_patterns():
    """The default follows the bind address: loopback names on loopback, any name elsewhere."""
    assert default_allowed_hosts("127.0.0.1") == ("localhost", "127.0.0.1", "::1")
    assert default_allowed_hosts("::1") == ("localhost", "127.0.0.1", "::1")
    assert default_allowed_hosts("127.0.0.2")[-1] == "127.0.0.2"
    assert default_allowed_hosts("0.0.0.0") == default_allowed_hosts("10.1.2.3") == ("*",)
    assert parse_allowed_hosts("api.example.com, [::1],*.internal,10.0.0.1") == (
        "api.example.com", "::1", "*.internal", "10.0.0.1")
    for bad in ("", "a b", "*foo", "a/b", "x:y", "a.*.b"):
        with pytest.raises(Exception, match="--allowed-hosts"):
            parse_allowed_hosts(bad)
