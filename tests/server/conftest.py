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

import pytest
from server_harness import MAX_TOKENS, PROMPT, SPECULATIVE, require_model, running_server


@pytest.fixture(scope="session")
def server():
    """The real model behind a real HTTP server on a free loopback port (one per session)."""
    with running_server(SPECULATIVE) as running:
        yield running


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
