"""The cluster flags' bad input: one line on stderr and exit code 2, before any model loads."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cluster_harness import free_port


def _specdec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["serve", "--role", "decode"], "--role decode: needs --scheduler (a cluster)"),
    (["serve", "--scheduler", "localhost:6379"], "--scheduler: expected redis://HOST:PORT/DB"),
    (["serve", "--scheduler", "redis://127.0.0.1:6379/0", "--role", "both"], "--role: must be one of mixed, prefill, decode"),
    (["serve", "--scheduler", "redis://127.0.0.1:6379/0", "--kv-transfer-port", "70000"], "--kv-transfer-port: must be"),
    (["serve", "--scheduler", "redis://127.0.0.1:6379/0", "--kv-transfer-tls-cert", "c.pem"],
     "--kv-transfer-tls-cert and --kv-transfer-tls-key go together"),
    (["serve", "--scheduler", "redis://127.0.0.1:6379/0", "--kv-transfer-tls-cert", "/nonexistent/c.pem",
      "--kv-transfer-tls-key", "/nonexistent/k.pem"], "--kv-transfer-tls-cert/-key/-ca: cannot load /nonexistent/c.pem"),
])
def test_bad_cluster_flags_are_one_line(args, message):
    result = _specdec(*args)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {message}")


@pytest.mark.parametrize("command", [["serve"], ["cluster", "status"]])
def test_an_unreachable_redis_is_one_line_at_once(command):
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = _specdec(*command, "--scheduler", url)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --scheduler: cannot reach {url}")
