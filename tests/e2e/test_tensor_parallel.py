"""Tensor parallelism over 2 gloo ranks on the CPU, against one process on the same path.

With ``tensor_parallel_size: 2`` the engine runs the float32 ``paddle`` path split over two
processes (the default model's 3 KV heads go 2 + 1). Greedy tokens must equal one process's
on that same path (``kernels: paddle``) for every method, one request at a time and batched.
A rank that dies makes the requests in flight fail within the documented bound, and the
server started with ``--tensor-parallel-size 2`` answers the official openai client.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import specdec
from specdec.workloads import code_edit_prompts

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of Germany is", *code_edit_prompts(4)]
MAX_TOKENS = 20
METHODS = [None, {"method": "ngram", "num_speculative_tokens": 4}, {"method": "suffix"}, {"method": "mtp"}]
ENGINE = dict(kernels="paddle", num_kv_blocks=96, max_model_len=1024, progress=False)
#: docs/deployment.md: a dead rank is seen within 0.2 s, then replies get 1 s before the
#: process exits; this allows for a loaded machine.
FAILURE_BOUND_S = 5.0


@pytest.fixture(scope="module")
def reference(paddle_llm):
    """One process on the same path: the session's ``paddle`` engine (tests/conftest.py), whose
    settings are ENGINE's."""
    engine = paddle_llm.engine
    assert engine.kernels == "paddle" and engine.max_model_len == ENGINE["max_model_len"]
    assert engine.num_kv_blocks == ENGINE["num_kv_blocks"]
    return paddle_llm


@pytest.fixture(scope="module")
def parallel():
    llm = specdec.LLM(tensor_parallel_size=2, **ENGINE)
    yield llm
    llm.engine.close()


#: When each LLM last generated (time.monotonic()), by id: the idle-group test counts the time
#: the group has already been idle (while the subprocess tests ran) towards its pause.
LAST_USED: dict[int, float] = {}


def _tokens(llm, prompts, speculative=None):
    llm.set_speculative_config(speculative)
    sampling = specdec.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        return [out.token_ids for out in llm.generate(prompts, sampling)]
    finally:
        LAST_USED[id(llm)] = time.monotonic()


@pytest.fixture(scope="module")
def expected(reference):
    return _tokens(reference, PROMPTS)


def test_the_model_is_split_over_two_ranks(parallel):
    engine = parallel.engine
    assert engine.kernels == "paddle" and engine.quantization == "none"
    assert len(engine.tensor_parallel_workers) == 1 and engine.tensor_parallel_workers[0].is_alive()
    assert engine.attention.num_kv_heads == 2 and engine.attention.num_heads == 6  # rank 0's share of 3 / 9


def _tcp_sockets(pid: int) -> list[tuple[str, int, str]]:
    """``(local address, port, state)`` of every TCP socket process ``pid`` holds (its fds'
    socket inodes, looked up in /proc/PID/net/tcp and tcp6; state 0A is LISTEN)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, size in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                address, port = fields[1].split(":")
                raw = b"".join(struct.pack("<I", int(address[i:i + 8], 16)) for i in range(0, 2 * size, 8))
                found.append((str(ipaddress.ip_address(raw)), int(port, 16), fields[3]))
    return found


def test_the_ranks_listen_and_talk_on_loopback_only(parallel):
    """The rendezvous store and the collectives' sockets of a group on one machine: paddle
    would serve the store on every interface, and gloo would use the hostname's address.
    (The store's process is rank 0's child while its ranks are connected.)"""
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
    store = [int(pid) for pid in children if b"rendezvous_store" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    ranks = {"rank 0": os.getpid(), "rank 1": parallel.engine.tensor_parallel_workers[0].pid, "store": store[0]}
    sockets = {rank: _tcp_sockets(pid) for rank, pid in ranks.items()}
    assert sockets["store"] and sockets["rank 1"], "the store's process holds its ranks' connections"
    loopback = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
    for rank, held in sockets.items():
        assert [entry for entry in held if entry[0] not in loopback] == [], rank
    # Once the group is joined, nothing of it listens any more.
    for rank in ("rank 1", "store"):
        assert [entry for entry in sockets[rank] if entry[2] == "0A"] == [], rank


#: The prompts also run one at a time: the short one and a code edit (drafts are accepted on
#: it); a single request takes the same path whatever its prompt.
ALONE = 2


@pytest.mark.parametrize("speculative", METHODS, ids=lambda s: (s or {"method": "naive"})["method"])
def test_greedy_tokens_equal_one_process(parallel, expected, speculative):
    assert _tokens(parallel, PROMPTS, speculative) == expected  # batched
    assert [_tokens(parallel, [prompt], speculative)[0] for prompt in PROMPTS[:ALONE]] == expected[:ALONE]  # alone


def _worker_pid(parent: int, timeout: float = 120.0) -> int:
    """The tensor-parallel worker among ``parent``'s children (multiprocessing's spawn_main)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        for child in children:
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except (FileNotFoundError, ProcessLookupError):  # a short-lived child already gone
                continue
            if b"spawn_main" in cmdline:
                return int(child)
        time.sleep(0.2)
    raise AssertionError("no tensor-parallel worker appeared")


def _env() -> dict:
    env = {name: value for name, value in os.environ.items() if not name.startswith("PADDLE_")}
    env.pop("SPECDEC_API_KEY", None)
    return {**env, "MKL_DEBUG_CPU_TYPE": "5"}


def test_a_killed_rank_fails_generate_within_the_bound():
    # With progress bars (on stderr), so that the test sees when generation has begun rather
    # than sleeping through the model's load.
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "generate", "--tensor-parallel-size", "2",
         "--num-kv-blocks", "96", "--max-tokens", "4000", "--ignore-eos", "--prompt", PROMPTS[1]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    chunks: list[bytes] = []

    def read_stderr():
        while chunk := os.read(process.stderr.fileno(), 65536):
            chunks.append(chunk)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        worker = _worker_pid(process.pid)
        deadline = time.monotonic() + 120
        while b"generating" not in b"".join(chunks) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2)  # a few steps into the generation
        assert process.poll() is None, (process.returncode, b"".join(chunks).decode(errors="replace")[-3000:])
        assert b"generating" in b"".join(chunks), "generation did not begin within 120 s"
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        process.wait(timeout=60)
        elapsed = time.monotonic() - killed
        reader.join(10)
        process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
    stderr = b"".join(chunks).decode(errors="replace")
    assert process.returncode == 3, stderr
    assert "error: tensor-parallel rank 1 died (signal 9); the requests in flight failed" in stderr
    assert elapsed < FAILURE_BOUND_S, f"took {elapsed:.1f} s"


def _start_server():
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "--tensor-parallel-size", "2", "--no-progress",
         "--num-kv-blocks", "96", "--kernels", "paddle", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    deadline = time.monotonic() + 180
    for line in process.stdout:
        if "listening on http://" in line:
            return process, line.split("listening on ")[1].split()[0]
        if time.monotonic() > deadline:
            break
    process.kill()
    raise AssertionError("the server did not start: " + process.stdout.read())


def test_server_with_two_ranks_answers_openai_then_fails_cleanly_when_a_rank_dies(reference):
    from openai import OpenAI

    process, url = _start_server()
    try:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPTS[0], max_tokens=12,
                                           temperature=0)
        want = reference.generate([PROMPTS[0]], specdec.SamplingParams(max_tokens=12, temperature=0.0))[0]
        assert answer.choices[0].text == want.text
        assert httpx.get(url + "/health").status_code == 200

        events: list[str] = []
        ended = threading.Event()

        def stream():
            body = {"model": "smollm2-135m-instruct", "prompt": PROMPTS[1], "max_tokens": 4000, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            ended.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while len(events) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(events) >= 3, "the stream did not start"
        os.kill(_worker_pid(process.pid), signal.SIGKILL)
        killed = time.monotonic()
        assert ended.wait(FAILURE_BOUND_S), "the stream did not end"
        error = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]"
        assert error["message"] == "tensor-parallel rank 1 died (signal 9)"
        process.wait(timeout=FAILURE_BOUND_S)
        assert time.monotonic() - killed < FAILURE_BOUND_S
        assert process.returncode == 3
    finally:
        if process.poll() is None:
            process.kill()


def test_more_ranks_than_kv_heads_is_a_one_line_error():
    result = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "generate", "--tensor-parallel-size", "4", "--no-progress",
         "--prompt", "hi", "--max-tokens", "2"], capture_output=True, text=True, env=_env(), timeout=300)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert errors == ["error: tensor_parallel_size: 4 ranks for a model with 3 KV heads; each rank needs at least "
                      "one (use at most 3)"]


def test_a_fatal_exit_keeps_code_3_when_the_main_thread_finishes_first():
    """The watchdog's exit waits a moment for replies in flight; a main thread whose requests
    just failed may end meanwhile, and must not replace the code 3 with its own."""
    code = ("import sys, threading, time\n"
            "from specdec.engine.tensor_parallel import exit_after_failure\n"
            "threading.Thread(target=exit_after_failure, args=('rank 1 died',), daemon=True).start()\n"
            "time.sleep(0.2)\n"
            "sys.exit(0)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    assert result.stderr.strip() == "error: rank 1 died; the requests in flight failed"


def test_an_idle_group_outlives_gloos_own_timeout(parallel, expected):
    """gloo gives up on a collective after 30 s, and idle workers wait in one: rank 0's
    keep-alive pings must carry them through a longer pause. (Last in this module: the time
    the group has been idle since its last generation, while the tests above ran their own
    processes, counts towards the 35 s.)"""
    idle = time.monotonic() - LAST_USED.get(id(parallel), time.monotonic())
    time.sleep(max(0.0, 35.0 - idle))
    assert time.monotonic() - LAST_USED.get(id(parallel), 0.0) >= 35.0
    assert parallel.engine.tensor_parallel_workers[0].is_alive()
    assert _tokens(parallel, PROMPTS[:1]) == expected[:1]
