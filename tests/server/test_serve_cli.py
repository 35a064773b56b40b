"""``specdec serve`` run as users run it: a subprocess, talked to over loopback HTTP.

Bad flags end with one ``error:`` line and exit code 2 before the model loads; a key given with
``--api-key`` is warned about (it shows in ``ps``). One real server (API key from
``SPECDEC_API_KEY``, ``--enable-docs``, ``--metrics-require-key``, a bound of one request in
flight, batch of one) answers the openai client, refuses a request without the key (401), one
beyond its bound (503) and one naming another host (421, DNS rebinding), serves its docs, keeps /metrics behind the key, and on SIGTERM ends
the stream in flight with its last chunk and exits 0 within seconds. Another (``--generation-config
PATH`` with ``--override-generation-config``, ngram under the default lossless verify strategy)
shows the merged sampling defaults and applies them to the fields a request leaves out, and
gives the ``n`` choices of a sampled request each its own seed's text.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_harness import MAX_TOKENS, PROMPT, require_model

from specdec.workloads import code_edit_prompts

CLI = [sys.executable, "-m", "specdec.cli", "serve"]
#: A usage error comes back in less than this; loading the model alone takes longer.
FAST_S = 8.0
KEY = "subprocess-key"


def _env() -> dict:
    env = dict(os.environ)
    env.pop("SPECDEC_API_KEY", None)
    env.pop("SPECDEC_DEBUG", None)
    return env


def test_serve_flag_errors_are_one_line_and_fast():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    cases = [
        (["--port", "70000"], "--port: must be between 0 and 65535, got 70000"),
        (["--port", str(port)], f"--port: cannot listen on 127.0.0.1:{port}: Address already in use"),
        (["--max-pending-requests", "0"], "--max-pending-requests: must be >= 1, got 0"),
        (["--speculative-config", '{"method": "ngarm"}'],
         "--speculative-config.method: unknown proposer 'ngarm' (did you mean 'ngram'?); installed: "),
        (["--max-num-seqs", "300"], "--max-num-seqs: must be between 1 and 256, got 300"),
        (["--max-body-bytes", "0"], "--max-body-bytes: must be >= 1, got 0"),
        (["--max-connections", "0"], "--max-connections: must be >= 1, got 0"),
        (["--read-timeout", "0"], "--read-timeout: must be > 0, got 0"),
        (["--step-timeout", "nan"], "--step-timeout: must be >= 0 (0: no watchdog), got nan"),
        (["--body-timeout", "0"], "--body-timeout: must be > 0, got 0"),
        (["--allowed-hosts", "localhost,*evil"],
         "--allowed-hosts: '*evil' is not a host name, an address, '*.domain' or '*'"),
        (["--metrics-require-key"], "--metrics-require-key: needs an API key (--api-key, or $SPECDEC_API_KEY)"),
        (["--override-generation-config", "{temperature: 0.5}"],
         "--override-generation-config: not valid JSON: Expecting property name enclosed in double quotes"),
        (["--generation-config", "/nonexistent/generation_config.json"],
         "--generation-config: /nonexistent/generation_config.json does not exist (auto, none, or a "
         "generation_config.json file or folder)"),
    ]

    def run(args):
        start = time.perf_counter()
        result = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=_env(), check=False)
        return result, time.perf_counter() - start

    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(run, [args for args, _ in cases]))
    finally:
        taken.close()
    for (args, expected), (result, elapsed) in zip(cases, results):
        assert result.returncode == 2, (args, result.stderr)
        [line] = result.stderr.splitlines()
        assert line.startswith("error: " + expected), (args, line)
        assert elapsed < FAST_S, f"{args}: took {elapsed:.1f} s: did the model load before the error?"


def test_an_api_key_on_the_command_line_is_warned_about():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        result = subprocess.run([*CLI, "--api-key", KEY, "--port", str(taken.getsockname()[1])], capture_output=True,
                                text=True, timeout=120, env=_env(), check=False)
    finally:
        taken.close()
    assert result.returncode == 2  # the port is taken: it stops before loading the model
    warning, error = result.stderr.splitlines()
    assert warning == ("warning: --api-key: the key is visible to every user of this machine (ps, /proc); "
                       "set SPECDEC_API_KEY instead")
    assert error.startswith("error: --port: cannot listen on")
    assert KEY not in result.stderr


def _start(log, args: list, env: dict) -> tuple:
    """``specdec serve ARGS`` on a free port, stderr to ``log``; ``(process, url)`` once it listens."""
    with open(log, "w") as stderr:
        process = subprocess.Popen([*CLI, "--port", "0", *args], stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    deadline = time.monotonic() + 300
    while True:
        match = re.search(r"listening on (http://\S+)", log.read_text())
        if match:
            return process, match.group(1)
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"specdec serve did not start: {log.read_text()[-3000:]}")
        time.sleep(0.2)


def _stop(process) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``specdec serve`` on a free port, its key in ``SPECDEC_API_KEY``; yields ``(process, url, log path)``."""
    require_model()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    process, url = _start(log, ["--served-model-name", "tiny", "--max-num-seqs", "1", "--enable-docs",
                                "--metrics-require-key", "--max-pending-requests", "1", "--shutdown-timeout", "1",
                                "--no-progress", "--log-level", "warning"], {**_env(), "SPECDEC_API_KEY": KEY})
    yield process, url, log
    _stop(process)


#: What ``--generation-config auto`` gives the default model (a GGUF): llama.cpp's defaults.
LLAMA_CPP = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


@pytest.mark.slow
def test_fields_left_out_get_the_models_generation_defaults(served, tmp_path):
    """``llm`` (simonw's) sends no temperature: the server fills in the model's recommended
    settings, which keep the small default model on track. (Before ``serve`` stops below.)"""
    import openai

    process, url, log = served
    ready = next(line for line in log.read_text().splitlines() if "listening on" in line)
    assert "sampling defaults temperature 0.8, top_p 0.95, top_k 40, min_p 0.05 (llama.cpp's defaults" in ready
    models = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert models["data"][0]["generation_defaults"] == LLAMA_CPP
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    # Seeded, a request without the fields equals one that sends the defaults.
    texts = [client.completions.create(model="tiny", prompt="My favourite animal is", max_tokens=12, seed=11,
                                       **fields).choices[0].text
             for fields in ({}, {"temperature": 0.8, "top_p": 0.95, "extra_body": {"top_k": 40, "min_p": 0.05}})]
    assert texts[0] == texts[1]

    (tmp_path / "extra-openai-models.yaml").write_text(
        f'- model_id: specdec\n  model_name: tiny\n  api_base: "{url}/v1"\n  api_key_name: specdec\n')
    (tmp_path / "keys.json").write_text(json.dumps({"specdec": KEY}))
    env = {**_env(), "LLM_USER_PATH": str(tmp_path), "LLM_LOAD_PLUGINS": ""}
    result = subprocess.run([os.path.join(os.path.dirname(sys.executable), "llm"), "-m", "specdec", "--no-log",
                             "-o", "seed", "1", "What is the capital of France? One word."],
                            capture_output=True, text=True, timeout=300, env=env, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Paris" in result.stdout, result.stdout


#: A checkpoint's generation_config.json (keys specdec does not read are left alone), and the
#: --override-generation-config over it.
GENERATION_CONFIG = {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "do_sample": True, "max_new_tokens": 64}
OVERRIDE = {"top_p": 0.8, "repetition_penalty": 1.1}
MERGED = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}


@pytest.fixture(scope="module")
def configured(tmp_path_factory):
    """``specdec serve`` with ``--generation-config PATH`` and ``--override-generation-config``,
    ngram under the default (lossless, rejection-sampling) verify strategy, two requests a
    batch; yields ``(url, log path, config path)``."""
    require_model()
    folder = tmp_path_factory.mktemp("configured")
    config = folder / "generation_config.json"
    config.write_text(json.dumps(GENERATION_CONFIG))
    log = folder / "serve.log"
    process, url = _start(log, ["--served-model-name", "tiny", "--max-num-seqs", "2", "--generation-config",
                                str(config), "--override-generation-config", json.dumps(OVERRIDE),
                                "--speculative-config", '{"method": "ngram"}', "--no-progress",
                                "--log-level", "warning"], _env())
    yield url, log, config
    _stop(process)


@pytest.mark.slow
def test_a_generation_config_file_and_its_override_fill_the_fields_left_out(configured):
    import openai

    url, log, config = configured
    ready = next(line for line in log.read_text().splitlines() if "listening on" in line)
    assert ("sampling defaults temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.1 "
            f"({config} + --override-generation-config)") in ready, ready
    assert httpx.get(url + "/v1/models").json()["data"][0]["generation_defaults"] == MERGED
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)

    def text(**fields):
        return client.completions.create(model="tiny", prompt="My favourite animal is", max_tokens=12, seed=11,
                                         **fields).choices[0].text

    explicit = {"temperature": 0.7, "top_p": 0.8, "extra_body": {"top_k": 20, "repetition_penalty": 1.1}}
    left_out = text()
    assert left_out == text(**explicit)
    # the comparison can tell: the API's own defaults (no generation config) sample another text
    assert left_out != text(temperature=1.0, top_p=1.0, extra_body={"top_k": 0, "repetition_penalty": 1.0})


@pytest.mark.slow
def test_n_choices_sample_from_their_own_seeds(configured):
    """Under a lossless verify strategy (the default) a sampled ``n`` = 2 request gives two
    different choices, the same ones again for the same seed, each the text of ``n`` = 1 with
    its own seed (``seed + i``): batched with its sibling or alone, drafts accepted or not."""
    import openai

    url, _, _ = configured
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    # A code edit, whose answer re-emits the prompt's code (ngram's drafts): without the
    # server's default repetition penalty, which keeps the answer off the prompt's tokens.
    messages = [{"role": "user", "content": code_edit_prompts(1)[0]}]

    def run(seed, n):
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=1.0,
                                              seed=seed, n=n, extra_body={"repetition_penalty": 1.0})

    pair = run(21, 2)
    texts = [c.message.content for c in pair.choices]
    assert [c.index for c in pair.choices] == [0, 1] and texts[0] != texts[1]
    assert [c.message.content for c in run(21, 2).choices] == texts
    assert [run(21 + i, 1).choices[0].message.content for i in range(2)] == texts
    assert pair.usage.model_extra["speculative"]["num_accepted_tokens"] > 0  # sampled through accepted drafts


@pytest.mark.slow
def test_serve_subprocess(served, generate_reference):
    import openai

    process, url, log = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    response = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].message.content == generate_reference["chat"]["text"]
    assert response.usage.completion_tokens == generate_reference["chat"]["num_generated_tokens"]
    assert response.model == "tiny"

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(url + "/health").json()["max_pending"] == 1  # /health needs no key
    assert httpx.get(url + "/metrics").status_code == 401  # --metrics-require-key
    assert "specdec_requests_total" in httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert httpx.get(url + "/openapi.json").json()["info"]["title"] == "specdec"  # --enable-docs
    assert httpx.get(url + "/docs").status_code == 200
    assert "warning: --api-key" not in log.read_text()  # the key came from the environment
    # DNS rebinding: bound to loopback, it answers only to loopback names (--allowed-hosts' default).
    port = url.rsplit(":", 1)[1]
    rebound = httpx.get(url + "/health", headers={"Host": f"attacker.example:{port}"})
    assert rebound.status_code == 421 and rebound.json()["error"]["code"] == "host_not_allowed"
    assert httpx.get(url + "/health", headers={"Host": f"localhost:{port}"}).status_code == 200

    # A long stream holds the one place; another request gets 503. Then SIGTERM mid-stream.
    chunks, started = [], threading.Event()

    def stream():
        for chunk in client.completions.create(model="tiny", prompt="Count from 1 to 1000:", max_tokens=4000,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True}):
            chunks.append(chunk)
            started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(120)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert refused.value.status_code == 503
    assert refused.value.body["code"] == "queue_full"

    process.send_signal(signal.SIGTERM)
    start = time.monotonic()
    returncode = process.wait(timeout=30)
    elapsed = time.monotonic() - start
    thread.join(30)
    assert returncode == 0, log.read_text()[-3000:]
    assert elapsed < 10, f"took {elapsed:.1f} s to shut down"
    assert chunks[-1].choices[0].finish_reason == "abort"  # the stream ended cleanly, not cut off
    assert 0 < sum(len(c.choices[0].text) for c in chunks)
    assert "Traceback" not in log.read_text()
