"""The server's limits (docs/server.md, "Server limits"), against real servers on loopback.

Each server here is built as ``specdec serve`` builds it (``server_harness.serving``), with a
short ``read_timeout`` where a test waits for it. They share the engine loop of the session's
test server (conftest ``server``). Clients are raw sockets (for half-sent requests) and httpx.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_harness import API_KEY, ERROR_KEYS, MODEL_NAME, Served, raw_error, read_until_closed, serving

from specdec.server import build_app
from specdec.server.limits import DEFAULT_MAX_BODY_BYTES, ServerLimits
from specdec.workloads import code_edit_prompts

pytestmark = pytest.mark.slow

#: The read timeout of the test servers (``--read-timeout``), and the slack allowed past it.
READ_TIMEOUT = 1.0
SLACK = 2.0
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl"


@pytest.fixture(scope="module")
def limited(server):
    """Default limits but a read timeout of READ_TIMEOUT; the API key; /metrics behind it."""
    with serving(server.engine_loop, limits=ServerLimits(read_timeout=READ_TIMEOUT),
                 metrics_require_key=True) as served:
        yield served


def _wait_connections(served: Served, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while served.num_connections < count:
        assert time.monotonic() < deadline, f"the server holds {served.num_connections} connections, not {count}"
        time.sleep(0.01)


def _get_health(sock: socket.socket) -> bytes:
    """``GET /health`` on a raw socket, keeping it open; the whole response."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += sock.recv(65536)
    head, _, body = raw.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return raw


def _assert_error(response: httpx.Response, status: int, code: str, param=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS
    assert (error["code"], error["param"]) == (code, param), error
    assert error["message"] and "\n" not in error["message"]
    return error


def _completion(url: str, **fields) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0, **fields}
    return httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60)


def _rejected(server, status: int) -> float:
    return server.metrics().get(("specdec_requests_rejected_total", (("status", str(status)),)), 0.0)


# -- slowloris: the request-head timeout -------------------------------------------------------


def test_half_open_connections_are_closed_and_others_served(limited, server):
    """200 connections that send half a request head and then nothing are answered 408 and
    closed once the read timeout has passed, while a real client is served meanwhile. So are a
    connection that sends nothing (closed without a word), one that trickles its head a byte at
    a time (the timeout counts the whole head), and a keep-alive connection whose next head
    stops halfway."""
    rejected_before = _rejected(server, 408)
    start = time.monotonic()  # no timer starts before this
    half_open = [limited.connect() for _ in range(200)]
    for sock in half_open:
        sock.sendall(HALF_HEAD)
    silent = limited.connect()
    keep_alive = limited.connect()
    assert _get_health(keep_alive).startswith(b"HTTP/1.1 200 ")
    keep_alive.sendall(b"GET /health HTTP/1.1\r\nHo")
    keep_alive_start = time.monotonic()
    trickler = limited.connect()
    stop_trickling = threading.Event()

    def trickle():
        for byte in HALF_HEAD:
            if stop_trickling.wait(0.1):
                return
            try:
                trickler.send(bytes([byte]))
            except OSError:  # closed by the server
                return

    trickling = threading.Thread(target=trickle)
    trickling.start()
    try:
        _wait_connections(limited, 203)
        # While they are open, a real client is served.
        response = _completion(limited.url)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(limited.url + "/health", timeout=10).status_code == 200
        assert limited.num_connections >= 203, "the real request was not served while they were all open"

        socks = [*half_open, silent, keep_alive, trickler]
        received, closed = read_until_closed(socks, READ_TIMEOUT + SLACK + 1)
    finally:
        stop_trickling.set()
        trickling.join(10)
        for sock in [*half_open, silent, keep_alive, trickler]:
            sock.close()

    assert len(closed) == len(socks), f"{len(socks) - len(closed)} connections still open"
    for sock in half_open + [trickler]:
        assert start + READ_TIMEOUT * 0.9 <= closed[sock] <= start + READ_TIMEOUT + SLACK
        error = raw_error(received[sock], 408, "request_timeout")
    assert error["message"] == "the request head did not arrive within 1 s (--read-timeout)"
    assert received[silent] == b""  # nothing sent, nothing said
    assert start + READ_TIMEOUT * 0.9 <= closed[silent] <= start + READ_TIMEOUT + SLACK
    raw_error(received[keep_alive], 408, "request_timeout")
    assert keep_alive_start + READ_TIMEOUT * 0.9 <= closed[keep_alive] <= keep_alive_start + READ_TIMEOUT + SLACK
    assert _rejected(server, 408) - rejected_before == 202  # the 200, the trickler, the keep-alive one
    deadline = time.monotonic() + 5
    while limited.num_connections and time.monotonic() < deadline:
        time.sleep(0.01)
    assert limited.num_connections == 0


def test_a_stalled_body_gets_408(limited):
    """A body that stops arriving is refused once the read timeout has passed."""
    sock = limited.connect()
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + API_KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        start = time.monotonic()
        received, closed = read_until_closed([sock], READ_TIMEOUT + SLACK + 1)
    finally:
        sock.close()
    assert sock in closed
    assert start + READ_TIMEOUT * 0.9 <= closed[sock] <= start + READ_TIMEOUT + SLACK
    error = raw_error(received[sock], 408, "request_timeout")
    assert error["message"] == "the request body: nothing arrived for 1 s (--read-timeout)"


def test_unparsable_requests_get_400_in_the_error_schema(limited, server):
    rejected_before = _rejected(server, 400)
    garbage, huge_head = limited.connect(), limited.connect()
    try:
        garbage.sendall(b"HELLO THERE\r\n\r\n")
        # h11 refuses a head that grows past 16 KiB before it is complete.
        huge_head.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: " + b"x" * 20000)
        received, closed = read_until_closed([garbage, huge_head], SLACK)
    finally:
        garbage.close()
        huge_head.close()
    for sock in (garbage, huge_head):
        error = raw_error(received[sock], 400, "invalid_http_request")
        assert sock in closed
    assert error["message"] == "the request is not valid HTTP/1.1, or its head is larger than 16 KiB"
    assert _rejected(server, 400) - rejected_before == 2


# -- request bodies ----------------------------------------------------------------------------


def _chunks(total: int, size: int = 65536):
    sent = 0
    while sent < total:
        yield b"x" * min(size, total - sent)
        sent += size


def test_an_oversize_body_gets_413_and_the_next_request_is_served(limited, server):
    rejected_before = _rejected(server, 413)
    big_prompt = "x" * (5 * 1024 * 1024)
    with httpx.Client(base_url=limited.url, headers=AUTH, timeout=60) as client:
        for _ in range(3):  # the client reads the 413, not a reset, every time
            response = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": big_prompt})
            error = _assert_error(response, 413, "request_too_large")
            assert str(DEFAULT_MAX_BODY_BYTES) in error["message"] and "--max-body-bytes" in error["message"]
            assert response.headers["connection"] == "close"
        # Chunked, without Content-Length: refused once it grows past the limit.
        response = client.post("/v1/completions", content=_chunks(6 * 1024 * 1024),
                               headers={"Content-Type": "application/json"})
        assert "content-length" not in response.request.headers
        _assert_error(response, 413, "request_too_large")
        # A body just within the limit is read (and parsed: this one is not JSON).
        response = client.post("/v1/completions", content=b"x" * DEFAULT_MAX_BODY_BYTES,
                               headers={"Content-Type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["code"] == "json_invalid"
        assert client.get("/health").status_code == 200
    assert _completion(limited.url).status_code == 200
    assert _rejected(server, 413) - rejected_before == 4


def test_an_oversize_body_is_refused_without_reading_it(limited):
    """A Content-Length over the limit is answered at once, before any of the body is sent;
    a chunked body is answered when it passes the limit, though it never ends. The server
    then half-closes (FIN after the response) and goes on reading for the read timeout (a
    lingering close: a client still sending reads the 413, not a reset), then lets go."""
    headers = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + API_KEY.encode()
               + b"\r\nContent-Type: application/json\r\n")
    declared, chunked = limited.connect(), limited.connect()
    try:
        declared.sendall(headers + b"Content-Length: 100000000\r\n\r\n")
        chunked.sendall(headers + b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        for _ in range(DEFAULT_MAX_BODY_BYTES // len(chunk) + 2):
            chunked.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        received, half_closed = read_until_closed([declared, chunked], SLACK)
        answered = time.monotonic()
        for sock in (declared, chunked):
            raw_error(received[sock], 413, "request_too_large")
            assert sock in half_closed
        assert b"100000000 bytes" in received[declared]
        declared.sendall(b"more of the body")  # still read: no reset
        while limited.num_connections:
            assert time.monotonic() < answered + READ_TIMEOUT + SLACK, "the server did not let go"
            time.sleep(0.01)
        assert time.monotonic() > answered + READ_TIMEOUT * 0.8, "no lingering close"
    finally:
        declared.close()
        chunked.close()


# -- prompts -----------------------------------------------------------------------------------


def _maximal_prompt(num_chars: int) -> str:
    text = "\n".join(code_edit_prompts(20))
    return (text * (num_chars // len(text) + 1))[:num_chars]


def test_an_oversize_prompt_gets_400_before_tokenizing(limited):
    max_chars = limited.app.state.max_prompt_chars
    # 8192 tokens of context times the 81 characters of SmolLM2's longest token.
    assert max_chars == server_max_model_len(limited) * 81 == 663_552
    digits = "7" * (max_chars + 1)  # tokenizing this would take about a second
    start = time.perf_counter()
    response = _completion(limited.url, prompt=digits)
    elapsed = time.perf_counter() - start
    error = _assert_error(response, 400, "context_length_exceeded", "prompt")
    assert error["message"].startswith(f"prompt: {max_chars + 1} characters is more than this server takes "
                                       f"({max_chars}, --max-prompt-chars")
    assert elapsed < 0.25, f"took {elapsed:.2f} s: was it tokenized?"

    half = "7" * (max_chars // 2 + 1)
    response = httpx.post(limited.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": MODEL_NAME, "messages": [{"role": "system", "content": half}, {"role": "user", "content": half}]})
    error = _assert_error(response, 400, "context_length_exceeded", "messages")
    num_chars = 2 * len(half) + len("system") + len("user")  # the roles count too
    assert error["message"].startswith(f"messages: {num_chars} characters in all messages (roles, names, contents) "
                                       "is more")

    # At the limit the prompt is tokenized, and then found too long in tokens.
    response = _completion(limited.url, prompt=digits[:-1])
    error = _assert_error(response, 400, "context_length_exceeded", "prompt")
    assert error["message"] == f"prompt: {max_chars} tokens do not fit the context of 8192 tokens"


def server_max_model_len(served: Served) -> int:
    return served.app.state.engine_loop.max_model_len


#: Polls /health from a process of its own (in this process it would share the GIL with the
#: server): prints "ready", then, once a line arrives on stdin, [[monotonic time, seconds, status]...].
POLLER = """
import http.client, json, select, sys, time
connection = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=30)
def health():
    connection.request("GET", "/health")
    response = connection.getresponse()
    response.read()
    return response.status
health()
print("ready", flush=True)
samples = []
while not select.select([sys.stdin], [], [], 0)[0]:
    start = time.monotonic()
    status = health()
    samples.append((start, time.monotonic() - start, status))
    time.sleep(0.01)
print(json.dumps(samples), flush=True)
"""


def test_health_stays_fast_while_a_maximal_prompt_is_tokenized(limited):
    """The largest prompt the character limit admits takes 0.2-0.5 s to tokenize (0.19 s on a
    2-core AMD Zen 5); meanwhile /health, asked by another process every 10 ms, answers within
    100 ms every time."""
    prompt = _maximal_prompt(limited.app.state.max_prompt_chars)
    poller = subprocess.Popen([sys.executable, "-c", POLLER, limited.host, str(limited.port)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert poller.stdout.readline().strip() == "ready"
        time.sleep(0.05)
        start = time.monotonic()
        response = _completion(limited.url, prompt=prompt)
        done = time.monotonic()
        time.sleep(0.05)
        output, _ = poller.communicate("stop\n", timeout=30)
    finally:
        if poller.poll() is None:
            poller.kill()
    error = _assert_error(response, 400, "context_length_exceeded", "prompt")
    assert "tokens do not fit the context" in error["message"]  # it was tokenized, whole
    assert done - start > 0.1, "the maximal prompt took no time: was it tokenized?"
    samples = json.loads(output)
    assert {status for _, _, status in samples} == {200}
    during = [seconds for at, seconds, _ in samples if start <= at + seconds and at <= done]
    assert during and max(during) < 0.1, f"/health took {max(during) * 1000:.0f} ms while the prompt was tokenized"
    assert len(during) >= 10, f"/health was asked only {len(during)} times"


# -- connections -------------------------------------------------------------------------------


def test_connections_beyond_the_limit_get_503_until_some_close(server):
    with serving(server.engine_loop, limits=ServerLimits(max_connections=4)) as limited4:
        held = [limited4.connect() for _ in range(4)]
        try:
            for sock in held:  # served, then kept open (keep-alive)
                assert _get_health(sock).startswith(b"HTTP/1.1 200 ")
            assert limited4.num_connections == 4
            response = httpx.get(limited4.url + "/health", timeout=10)
            error = _assert_error(response, 503, "too_many_connections")
            assert "--max-connections" in error["message"] and response.headers["connection"] == "close"
            response = _completion(limited4.url)
            _assert_error(response, 503, "too_many_connections")
        finally:
            for sock in held[:2]:
                sock.close()
        deadline = time.monotonic() + 5
        while limited4.num_connections > 2:
            assert time.monotonic() < deadline, "closed connections were not let go"
            time.sleep(0.01)
        assert _completion(limited4.url).status_code == 200
        for sock in held[2:]:
            sock.close()


# -- what is exposed ---------------------------------------------------------------------------


def test_docs_are_off_unless_enabled(limited, server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(limited.url + path, headers=AUTH).status_code == 404, path
    with serving(server.engine_loop, api_key=None, enable_docs=True) as documented:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(documented.url + path).status_code == 200, path
        assert "/v1/chat/completions" in httpx.get(documented.url + "/openapi.json").json()["paths"]


def test_metrics_can_require_the_key(limited):
    _assert_error(httpx.get(limited.url + "/metrics"), 401, "invalid_api_key")
    response = httpx.get(limited.url + "/metrics", headers=AUTH)
    assert response.status_code == 200 and "specdec_requests_rejected_total" in response.text
    assert httpx.get(limited.url + "/health").status_code == 200  # /health stays open
    with pytest.raises(ValueError, match="api_key"):
        build_app(limited.app.state.engine_loop, served_model_name=MODEL_NAME, metrics_require_key=True)
