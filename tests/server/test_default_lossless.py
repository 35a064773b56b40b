"""With default settings speculation changes only the speed, through the server too.

A server started with nothing but ``{"method": "ngram"}`` (or ``suffix``) answers greedy
(temperature 0) chat requests with exactly the text that ``specdec generate`` gives with plain
decoding (``naive``): streamed and not, each prompt sent twice (the adaptive draft length has
learned in between, and the prefix cache holds the prompt the second time), and 32 requests
sent at once give the texts they give alone.

A difference is reported with the reference logit margin at the first divergent token (see
``ModelSession.describe_divergence``); the default verify strategy must make it impossible.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from server_harness import MODEL_NAME, running_server

from specdec.workloads import code_edit_prompts

pytestmark = pytest.mark.slow

PROMPTS = code_edit_prompts(5)
CONCURRENT_PROMPTS = code_edit_prompts(32)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def naive_texts(tmp_path_factory):
    """``specdec generate`` (naive, greedy) for PROMPTS, as users run it."""
    prompts_file = tmp_path_factory.mktemp("prompts") / "prompts.json"
    prompts_file.write_text(json.dumps(PROMPTS))
    command = [sys.executable, "-m", "specdec.cli", "generate", "--prompts-file", str(prompts_file),
               "--max-tokens", str(MAX_TOKENS), "--output", "json", "--no-progress"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return [r["text"] for r in json.loads(result.stdout)["results"]]


@pytest.fixture(scope="module", params=["ngram", "suffix"])
def default_server(request):
    """A server with the method alone as its speculative config: every other key at its default."""
    with running_server({"method": request.param}, max_num_seqs=32, max_pending=64) as server:
        yield request.param, server


def _messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def _plain(server, prompt: str) -> str:
    response = server.openai().chat.completions.create(model=MODEL_NAME, messages=_messages(prompt),
                                                       max_tokens=MAX_TOKENS, temperature=0)
    return response.choices[0].message.content


def _streamed(server, prompt: str) -> str:
    chunks = server.openai().chat.completions.create(model=MODEL_NAME, messages=_messages(prompt),
                                                     max_tokens=MAX_TOKENS, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_default_config_gives_naive_text_streamed_or_not(default_server, naive_texts):
    method, server = default_server
    mismatches = []
    for attempt in range(2):
        for i, (prompt, expected) in enumerate(zip(PROMPTS, naive_texts)):
            for kind, send in (("plain", _plain), ("streamed", _streamed)):
                text = send(server, prompt)
                if text != expected:
                    mismatches.append(f"{method}, prompt {i}, {kind}, round {attempt + 1}: {text!r} != naive "
                                      f"{expected!r}")
    assert not mismatches, "\n".join(mismatches)
    metrics = server.metrics()
    accepted = metrics.get(("specdec_spec_decode_num_accepted_tokens_total", ()), 0)
    assert accepted > 0, f"{method}: no draft was accepted, the comparison proves nothing"


def test_concurrent_requests_give_their_solo_text(default_server):
    method, server = default_server
    solo = [_plain(server, prompt) for prompt in CONCURRENT_PROMPTS]

    async def all_at_once():
        client = server.async_openai()
        responses = await asyncio.gather(*(
            client.chat.completions.create(model=MODEL_NAME, messages=_messages(p), max_tokens=MAX_TOKENS,
                                           temperature=0)
            for p in CONCURRENT_PROMPTS))
        await client.close()
        return [r.choices[0].message.content for r in responses]

    together = asyncio.run(all_at_once())
    differ = [i for i, (a, b) in enumerate(zip(solo, together)) if a != b]
    assert not differ, f"{method}: requests {differ} of 32 differ from their solo runs: " + "; ".join(
        f"{solo[i]!r} != {together[i]!r}" for i in differ[:3])
