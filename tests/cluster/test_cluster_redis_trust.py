"""The cluster's Redis as an attacker sees it: one real ``redis-server`` with a password and a TLS
port, two real instances of one cluster reaching it two ways, and records written into it by hand.

* ``fd-prefill``: FastDeploy's PD command line as its documentation writes it (``--splitwise-role
  prefill --scheduler-name splitwise --scheduler-host ... --scheduler-topic mtp --scheduler-password
  scheduler_mtp --metrics-port``);
* ``mix``: ``--scheduler rediss://`` (TLS, ``--scheduler-ca-file``) in the same topic, the password
  from ``--scheduler-password-file``.

Both share a cluster secret (``$SPECDEC_CLUSTER_SECRET``, so that FastDeploy's line stays as
written). A prefill instance hands whole requests to the mixed one (there is no decode instance),
so every request sent to it crosses the cluster.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest
from cluster_harness import (MODEL_NAME, SCHEMAS, RedisServer, check_json_chat, free_port, json_chat,
                             launch_instance, ready, wait_for_instances)

from specdec.cluster.secret import seal

pytestmark = pytest.mark.slow

PASSWORD = "scheduler_mtp"  # FastDeploy's example
SECRET = "a-cluster-secret-of-32-characters"
PROMPTS = ["def add(a, b):", "The capital of France is", "for i in range(10):", "import numpy as np"]


@pytest.fixture(scope="module")
def redis_server(directory):
    """A redis-server with FastDeploy's example password and a TLS port (a self-signed certificate
    for 127.0.0.1, which is also the CA file the instances trust)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("openssl is not installed: `make install-test` installs Debian's package")
    certificate, key = directory / "redis.crt", directory / "redis.key"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(certificate), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    server = RedisServer(directory, password=PASSWORD, tls=(certificate, key))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(directory, redis_server):
    """``{name: Instance}`` of the two instances (see the module docstring)."""
    (directory / "password").write_text(PASSWORD + "\n")
    env = {"SPECDEC_CLUSTER_SECRET": SECRET}
    metrics_port = free_port()
    launched = [
        launch_instance(None, directory, "fd-prefill", role=None, env=env, extra=(
            "--splitwise-role", "prefill", "--scheduler-name", "splitwise", "--scheduler-host", "127.0.0.1",
            "--scheduler-port", str(redis_server.port), "--scheduler-ttl", "9000", "--scheduler-topic", "mtp",
            "--scheduler-password", PASSWORD, "--metrics-port", str(metrics_port))),
        launch_instance(f"rediss://127.0.0.1:{redis_server.tls_port}/0", directory, "mix", env=env, extra=(
            "--scheduler-ca-file", str(redis_server.tls[0]), "--scheduler-topic", "mtp",
            "--scheduler-password-file", str(directory / "password"))),
    ]
    instances = {}
    try:
        for item in launched:
            instances[item[0]] = ready(item)
        instances["fd-prefill"].metrics_port = metrics_port
        yield instances
    finally:
        for instance in instances.values():
            instance.stop()
        for _, process, _ in launched:
            if process.poll() is None:
                process.kill()


def _registration(name: str, **fields) -> dict:
    """A registration as an instance writes it: an idle mixed instance, unless ``fields`` say otherwise."""
    record = {"instance_id": name, "role": "mixed", "model": MODEL_NAME, "url": "http://127.0.0.1:9",
              "transfer": "", "num_pending": 0, "max_pending": 1024, "num_free_kv_blocks": 100,
              "num_kv_blocks": 100, "needs_hidden_states": False, "kv_layout": {}, "method": "ngram", "pid": 1,
              "started_at": time.time(), "heartbeat_at": time.time()}
    record.update(fields)
    return record


def _signed(key: str, record: dict) -> bytes:
    return seal(SECRET.encode(), f"registration {key}", record)


async def _complete(instance, prompt: str) -> str:
    client = instance.async_openai()
    try:
        response = await asyncio.wait_for(client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0), timeout=60)
        assert response.choices[0].finish_reason in ("length", "stop")
        return response.choices[0].text
    finally:
        await client.close()


def _bad_records(instance) -> dict:
    return {reason: instance.metric("specdec_cluster_bad_records_total", kind="registration", reason=reason)
            for reason in ("malformed", "signature", "field", "expiry")}


def test_bad_registrations_are_skipped_counted_once_and_requests_still_complete(cluster, redis_server):
    prefill, mix = cluster["fd-prefill"], cluster["mix"]
    wait_for_instances(prefill, 2)
    wait_for_instances(mix, 2)
    store = redis_server.client()
    # Each would black-hole requests (an idle instance at a dead address) or, before the fix, make
    # every heartbeat raise. Signed ones are what a holder of the secret, or a buggy instance, writes.
    forged = {
        "garbage": (b"\xff{not json", 3000),
        "mistyped": (_signed("mtp:instance:mistyped", _registration("mistyped", num_pending="x")), 3000),
        "negative": (_signed("mtp:instance:negative", _registration("negative", num_pending=-1000)), 3000),
        "forever": (_signed("mtp:instance:forever", _registration("forever")), None),  # no TTL
        "unsigned": (json.dumps(_registration("unsigned")).encode(), 3000),
        "moved": (_signed("mtp:instance:mix", _registration("moved")), 3000),  # a signature for another key
    }
    for name, (value, ttl_ms) in forged.items():
        store.set(f"mtp:instance:{name}", value, px=ttl_ms)
    expected = {"malformed": 1, "field": 2, "expiry": 1, "signature": 2}
    deadline = time.monotonic() + 10  # both read the registrations at their next heartbeat
    while (_bad_records(prefill), _bad_records(mix)) != (expected, expected) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _bad_records(prefill) == expected == _bad_records(mix)
    assert prefill.health()["cluster"]["instances"] == mix.health()["cluster"]["instances"] == 2

    async def run():
        return await asyncio.gather(*[_complete(prefill if i % 2 else mix, prompt)
                                      for i, prompt in enumerate(PROMPTS * 2)])

    texts = asyncio.run(run())
    assert texts[:4] == texts[4:]  # the same prompt, either way in, the same greedy text
    assert prefill.metric("specdec_cluster_requests_routed_total", route="run") == 4
    # Read at every heartbeat since, each bad record was counted, and logged, once.
    assert _bad_records(prefill) == expected == _bad_records(mix)
    log = mix.log.read_text(errors="replace")
    assert log.count("skipped a bad registration in Redis, mtp:instance:garbage") == 1
    # The operator's view: the same two instances, the bad ones counted (over TLS, secrets from the env).
    status = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "cluster", "status", "--scheduler",
         f"rediss://127.0.0.1:{redis_server.tls_port}/0", "--scheduler-ca-file", str(redis_server.tls[0]),
         "--scheduler-topic", "mtp", "--output", "json"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "SPECDEC_SCHEDULER_PASSWORD": PASSWORD, "SPECDEC_CLUSTER_SECRET": SECRET})
    assert status.returncode == 0, status.stderr
    listed = json.loads(status.stdout)
    assert [i["instance_id"] for i in listed["instances"]] == ["fd-prefill", "mix"]
    assert listed["bad_registrations"] >= 1  # "forever"; the others may have expired by now


def _wait_for_heartbeats(store, key: str, after: float, count: int = 2) -> None:
    """Wait until the instance registered under ``key`` has registered ``count`` times since
    ``after`` (a Unix time): by then it has read the registry at least once since."""
    seen, deadline = set(), time.monotonic() + 10
    while len(seen) < count:
        assert time.monotonic() < deadline, f"{key}: no heartbeat"
        heartbeat = json.loads(json.loads(store.get(key))["p"])["heartbeat_at"]
        if heartbeat > after:
            seen.add(heartbeat)
        time.sleep(0.1)


def test_a_cluster_does_not_see_another_topics_instances(cluster, redis_server):
    prefill = cluster["fd-prefill"]
    store = redis_server.client()
    bad_before = _bad_records(prefill)
    key = "specdec:instance:stranger"  # a sane, signed, live registration of an idle instance, in the default topic
    store.set(key, _signed(key, _registration("stranger")), px=60_000)
    _wait_for_heartbeats(store, "mtp:instance:fd-prefill", after=time.time())
    assert prefill.health()["cluster"]["instances"] == 2
    assert _bad_records(prefill) == bad_before  # not even read
    assert store.exists("mtp:instance:fd-prefill", "mtp:instance:mix") == 2
    assert not store.exists("specdec:instance:fd-prefill", "specdec:instance:mix")


def test_the_fastdeploy_pd_command_line_runs_without_its_password_in_ps(cluster):
    prefill = cluster["fd-prefill"]
    command_line = open(f"/proc/{prefill.process.pid}/cmdline", "rb").read().split(b"\0")
    assert b"--scheduler-name" in command_line and b"--metrics-port" in command_line
    assert PASSWORD.encode() not in b" ".join(command_line)  # yet it reached the password-protected Redis
    assert prefill.health()["cluster"]["role"] == "prefill"
    # --metrics-port: /metrics alone, on a port of its own.
    metrics = httpx.get(f"http://127.0.0.1:{prefill.metrics_port}/metrics", timeout=10)
    assert metrics.status_code == 200 and "specdec_cluster_instances" in metrics.text
    assert httpx.get(f"http://127.0.0.1:{prefill.metrics_port}/v1/models", timeout=10).status_code == 404


def test_structured_output_and_token_sources_cross_the_cluster_in_run_jobs(cluster):
    """The prefill instance sends whole requests to the mixed one: their grammars (compiled
    again there) and token sources go with them, streamed and not."""
    prefill = cluster["fd-prefill"]
    routed = prefill.metric("specdec_cluster_requests_routed_total", route="run")

    async def run():
        return await asyncio.gather(*(json_chat(prefill, entry, stream=i % 2 == 0) for i, entry in enumerate(SCHEMAS)))

    for entry, output in zip(SCHEMAS, asyncio.run(run())):
        check_json_chat(entry, *output)
    assert prefill.metric("specdec_cluster_requests_routed_total", route="run") == routed + len(SCHEMAS)


def test_a_wrong_password_or_an_unknown_ca_is_one_line_that_never_shows_the_password(redis_server):
    def status(*args):
        return subprocess.run([sys.executable, "-m", "specdec.cli", "cluster", "status", *args],
                              capture_output=True, text=True, timeout=60)

    wrong = status("--scheduler", f"redis://:not-{PASSWORD}@127.0.0.1:{redis_server.port}/0")
    assert wrong.returncode == 2
    [line] = wrong.stderr.strip().splitlines()
    assert "refused the password" in line and "not-" not in line
    untrusted = status("--scheduler", f"rediss://127.0.0.1:{redis_server.tls_port}/0")  # the system's CAs
    assert untrusted.returncode == 2
    [line] = untrusted.stderr.strip().splitlines()
    assert line.startswith(f"error: --scheduler: cannot reach rediss://127.0.0.1:{redis_server.tls_port}/0")
    assert "certificate" in line
