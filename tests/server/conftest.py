"""The real server, for the tests of tests/server.

``server`` (session scope) loads the default model into one engine (ngram, greedy verification,
8 requests per batch) and serves it with uvicorn in a background thread, listening on a free
loopback port: the tests talk to it over HTTP, with the official ``openai`` client or httpx,
and can read the engine loop's state directly. ``generate_reference`` runs ``specdec generate``
(a subprocess, as users run it) for the requests the tests compare against.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from server_harness import (API_KEY, MAX_NUM_SEQS, MAX_PENDING, MAX_TOKENS, MODEL_NAME, PROMPT, SPECULATIVE,
                            RunningServer, require_model)


@pytest.fixture(scope="session")
def server():
    """The real model behind a real HTTP server on a free loopback port (one per session)."""
    require_model()
    import uvicorn

    from specdec.config import build_engine_config
    from specdec.engine import Engine
    from specdec.plugin_manager import get_plugins
    from specdec.server import EngineLoop, build_app
    from specdec.server.serve import Server, bind_socket

    plugins = get_plugins()
    config = build_engine_config(None, {"max_num_seqs": MAX_NUM_SEQS}, SPECULATIVE, plugins)
    engine = Engine(config, plugins=plugins, progress=False)
    engine_loop = EngineLoop(engine, max_pending=MAX_PENDING)
    app = build_app(engine_loop, served_model_name=MODEL_NAME, api_key=API_KEY)
    sock = bind_socket("127.0.0.1", 0)
    host, port = sock.getsockname()[:2]
    uvicorn_server = Server(uvicorn.Config(app, log_config=None), engine_loop, drain_timeout=1.0)
    thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]}, name="test-uvicorn",
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uvicorn_server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail("the test server did not start")
        time.sleep(0.02)
    running = RunningServer(f"http://{host}:{port}", engine_loop, uvicorn_server)
    yield running
    running.http.close()
    uvicorn_server.should_exit = True
    thread.join(30)
    assert not thread.is_alive(), "the test server did not shut down"
    assert not engine_loop.running, "the engine loop outlived the server"


@pytest.fixture(scope="session")
def generate_reference():
    """``specdec generate --output json`` for PROMPT, greedy, MAX_TOKENS tokens, with the chat
    template (``chat``) and without (``plain``): the result dicts of the CLI."""
    require_model()
    results = {}
    for name, flags in (("chat", []), ("plain", ["--no-chat"])):
        command = [sys.executable, "-m", "specdec.cli", "generate", "--prompt", PROMPT, "--max-tokens",
                   str(MAX_TOKENS), "--output", "json", "--no-progress", *flags]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        [results[name]] = json.loads(result.stdout)["results"]
    return results
