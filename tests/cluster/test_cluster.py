"""A real cluster: ``redis-server`` on loopback and ``specdec serve`` instances as subprocesses,
driven with the official ``openai`` client (docs/deployment.md, "A cluster").

Every completion is compared with the prompt's solo output (one engine, one request at a
time, in this process): a cluster may only change where a request runs, never its tokens.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import openai
import pytest
import redis
from cluster_harness import (MODEL_NAME, solo_outputs, start_instance,
                             start_instances, wait_for_instances)

from specdec.workloads import code_edit_prompts

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
LONG_TOKENS = 400
PROMPTS = code_edit_prompts(32, min_lines=4, max_lines=12)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def solo():
    return solo_outputs(PROMPTS, MAX_TOKENS)


async def _complete(instance, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS,
                    ignore_eos: bool = False) -> str:
    """One greedy completion through the official client; streamed text is joined."""
    client = instance.async_openai()
    extra = {"extra_body": {"ignore_eos": True}} if ignore_eos else {}
    try:
        if not stream:
            response = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                                       temperature=0, **extra)
            return response.choices[0].text
        parts = []
        async for chunk in await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                                           temperature=0, stream=True, **extra):
            if chunk.choices:
                parts.append(chunk.choices[0].text)
        return "".join(parts)
    finally:
        await client.close()


async def _outcomes(calls) -> list:
    """Each call's text, or the exception it raised."""
    return await asyncio.gather(*calls, return_exceptions=True)


async def _disrupted_run(instances, prompts, max_tokens: int, watched, disrupt, routed_first=None) -> list:
    """Send ``prompts`` over ``instances`` in turn (every other one streamed), call
    ``disrupt()`` once ``watched`` have generated 20 tokens, and return each request's
    outcome (its text, or the exception it raised; a request that takes more than 150 s
    raises TimeoutError).

    ``routed_first``: one of ``instances`` whose clients' requests are sent first; the others'
    follow once it has routed all of them, so it routes them while the others are idle (and
    spreads them over the cluster) rather than after a heartbeat reported the others' load."""
    def call(i, prompt):
        return asyncio.wait_for(_complete(instances[i % len(instances)], prompt, stream=i % 4 < 2,
                                          max_tokens=max_tokens), timeout=150)

    first = [i for i in range(len(prompts)) if instances[i % len(instances)] is routed_first]
    tasks = {i: asyncio.ensure_future(call(i, prompts[i])) for i in first}
    deadline = time.monotonic() + 60
    while (routed_first is not None and time.monotonic() < deadline
           and sum(routed_first.metric("specdec_cluster_requests_routed_total", route=route)
                   for route in ("local", "run")) < len(first)):
        await asyncio.sleep(0.05)
    tasks.update({i: asyncio.ensure_future(call(i, prompt)) for i, prompt in enumerate(prompts) if i not in tasks})
    gathered = asyncio.ensure_future(_outcomes([tasks[i] for i in range(len(prompts))]))
    deadline = time.monotonic() + 60
    while sum(i.metric("specdec_generation_tokens_total") for i in watched) < 20 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not gathered.done(), "every request finished before the disruption"
    result = disrupt()
    if asyncio.iscoroutine(result):
        await result
    return await gathered


def test_two_mixed_instances_spread_32_requests_and_match_solo_outputs(directory, redis_server, solo):
    a, b = start_instances(redis_server.url, directory, ("mix-a", {"speculative": NGRAM}),
                           ("mix-b", {"speculative": NGRAM}))
    try:
        wait_for_instances(a, 2)
        wait_for_instances(b, 2)
        calls = [_complete(a if i % 2 == 0 else b, prompt, stream=i % 4 < 2) for i, prompt in enumerate(PROMPTS)]
        texts = asyncio.run(_outcomes(calls))
        assert texts == solo
        # Both instances ran requests, and some crossed over through Redis.
        finished = [sum(v for (name, _), v in i.metrics().items() if name == "specdec_requests_total") for i in (a, b)]
        assert all(count > 0 for count in finished), finished
        assert sum(finished) == len(PROMPTS)  # each request ran once
        remote = sum(i.metric("specdec_cluster_requests_routed_total", route="run") for i in (a, b))
        assert remote > 0
        status = subprocess.run([sys.executable, "-m", "specdec.cli", "cluster", "status", "--scheduler",
                                 redis_server.url, "--output", "json"], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        listed = json.loads(status.stdout)["instances"]
        assert sorted(i["instance_id"] for i in listed) == ["mix-a", "mix-b"]
        assert {i["role"] for i in listed} == {"mixed"}
        table = subprocess.run([sys.executable, "-m", "specdec.cli", "cluster", "status", "--scheduler",
                                redis_server.url], capture_output=True, text=True, timeout=60)
        assert table.returncode == 0, table.stderr
        assert "mix-a" in table.stdout and "mix-b" in table.stdout
        assert "2 instances (2 mixed, 0 prefill, 0 decode)" in table.stdout
    finally:
        a.stop()
        b.stop()


def test_a_stopping_instance_leaves_the_cluster_as_its_shutdown_begins(directory, redis_server):
    # 400 tokens (about 2 s here) outlast the moment the registration goes; the 24 of the other
    # tests can finish first on a fast engine. A loaded 2-core CI runner can take longer than
    # the default 5 s drain for them, so the drain gets 120 s: this test is about leaving the
    # cluster while the request still runs, not about the drain's deadline.
    [expected] = solo_outputs(PROMPTS[:1], LONG_TOKENS, ignore_eos=True)
    instance = start_instance(redis_server.url, directory, "leaving", speculative=NGRAM,
                              extra=("--shutdown-timeout", "120"))
    key = "specdec:instance:leaving"
    store = redis.Redis.from_url(redis_server.url)
    try:
        wait_for_instances(instance, 1)

        async def run():
            request = asyncio.ensure_future(_complete(instance, PROMPTS[0], stream=True, max_tokens=LONG_TOKENS,
                                                      ignore_eos=True))
            while instance.metric("specdec_generation_tokens_total") < 2:
                await asyncio.sleep(0.05)
            instance.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 1.0
            while store.exists(key) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            # Gone from the cluster while the request still runs (the drain lets it finish).
            gone_while_draining = not store.exists(key) and not request.done()
            return gone_while_draining, await request

        gone_while_draining, text = asyncio.run(run())
        assert gone_while_draining
        assert text == expected
        instance.process.wait(60)
    finally:
        instance.stop()


def test_an_instance_killed_mid_run_loses_no_request_silently(directory, redis_server):
    prompts = PROMPTS[:16]
    max_tokens = 64
    expected = solo_outputs(prompts, max_tokens)
    a, b = start_instances(redis_server.url, directory, ("kill-a", {"speculative": NGRAM}),
                           ("kill-b", {"speculative": NGRAM}))
    try:
        wait_for_instances(a, 2)

        def disrupt():
            b.kill()

        # a routes its clients' requests while b is idle, so some run on b and are lost with it.
        outcomes = asyncio.run(_disrupted_run([a, b], prompts, max_tokens, [b], disrupt, routed_first=a))
        assert a.metric("specdec_cluster_requests_routed_total", route="run") >= 1
        for index, outcome in enumerate(outcomes):
            to_survivor, streamed = index % 2 == 0, index % 4 < 2
            if isinstance(outcome, str):
                assert outcome == expected[index], f"request {index} returned another text"
                continue
            assert not isinstance(outcome, asyncio.TimeoutError), f"request {index} hung"
            if not to_survivor:  # the killed instance's own clients lose their connection
                assert isinstance(outcome, openai.APIError), repr(outcome)
                continue
            # The survivor's clients: a request that had streamed nothing was run again there,
            # so only one whose text had begun to stream may fail, and the error says why.
            assert streamed, f"request {index} failed although nothing of it had been sent: {outcome!r}"
            assert "stopped while running this request" in str(outcome), repr(outcome)
        assert any(not isinstance(o, str) for o in outcomes[1::2]), "the kill came after every request had finished"
        # Requests of the survivor's clients that ran on the killed instance were run again.
        assert a.metric("specdec_cluster_requests_routed_total", route="rerun") >= 1
        # And the survivor keeps serving, alone now.
        assert asyncio.run(_complete(a, prompts[0], stream=False, max_tokens=max_tokens)) == expected[0]
    finally:
        a.stop()
        b.stop()


def test_redis_restarted_mid_run_instances_reconnect_and_requests_finish_or_fail_clearly(directory, redis_server):
    prompts = PROMPTS[16:32]
    max_tokens = 48
    expected = solo_outputs(prompts, max_tokens)
    a, b = start_instances(redis_server.url, directory, ("restart-a", {"speculative": NGRAM}),
                           ("restart-b", {"speculative": NGRAM}))
    try:
        wait_for_instances(a, 2)
        wait_for_instances(b, 2)

        async def disrupt():
            redis_server.stop()
            await asyncio.sleep(1.0)
            redis_server.start()

        outcomes = asyncio.run(_disrupted_run([a, b], prompts, max_tokens, [a, b], disrupt))
        print("after the restart:", [o if isinstance(o, str) else repr(o) for o in outcomes])
        for index, outcome in enumerate(outcomes):
            if isinstance(outcome, str):
                assert outcome == expected[index], f"request {index} returned another text"
            else:
                assert not isinstance(outcome, asyncio.TimeoutError), f"request {index} hung"
                assert isinstance(outcome, openai.APIError), outcome
                assert "Redis" in str(outcome) or "lost" in str(outcome), outcome
        # Both came back into the new Redis, and route between each other again.
        wait_for_instances(a, 2)
        wait_for_instances(b, 2)
        assert a.metric("specdec_cluster_redis_reconnects") + b.metric("specdec_cluster_redis_reconnects") >= 1
        calls = [_complete(a if i % 2 == 0 else b, prompt, stream=False, max_tokens=max_tokens)
                 for i, prompt in enumerate(prompts[:6])]
        assert asyncio.run(_outcomes(calls)) == expected[:6]
    finally:
        a.stop()
        b.stop()
