"""64 concurrent streaming requests: all complete, with the right token counts and greedy outputs
identical to running each alone, and the /metrics counters add up to the totals."""

from __future__ import annotations

import asyncio

import pytest
from server_harness import MAX_NUM_SEQS, MODEL_NAME

pytestmark = pytest.mark.slow

NUM_REQUESTS = 64
MAX_TOKENS = 8
# Short plain prompts (completions, no chat template): a prompt's prefill costs little, so the
# time goes to the batched decode steps this test is about. Half of them repeat themselves, so
# that ngram finds drafts.
TOPICS = ["The sea", "A cat", "Rain", "The moon", "Bread", "A river", "Snow", "A clock"]
PROMPTS = ([f"{topic} is" for topic in TOPICS]
           + ["1, 2, 3, 1, 2, 3, 1, 2,", "a b c d a b c d a", "red green blue red green blue red",
              "10 20 30 10 20 30 10", "x = 1\ny = 2\nx = 1\ny =", "do re mi do re mi do", "A B A B A B A",
              "one two one two one two one"])


def _request(i: int) -> dict:
    return {"model": MODEL_NAME, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "temperature": 0,
            "extra_body": {"ignore_eos": True}}


async def _stream(client, i: int) -> dict:
    chunks = [c async for c in await client.completions.create(
        **_request(i), stream=True, stream_options={"include_usage": True})]
    *content, last = chunks
    return {"text": "".join(c.choices[0].text for c in content),
            "finish_reason": content[-1].choices[0].finish_reason, "usage": last.usage}


async def _burst(server) -> list[dict]:
    async with server.async_openai() as client:
        return await asyncio.gather(*(_stream(client, i) for i in range(NUM_REQUESTS)))


def _delta(before: dict, after: dict, name: str, labels: tuple = ()) -> float:
    return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)


def test_64_concurrent_streams(server):
    assert NUM_REQUESTS > MAX_NUM_SEQS  # most of them wait for a batch slot
    client = server.openai()
    alone = [client.completions.create(**_request(i)) for i in range(len(PROMPTS))]
    server.wait_idle()
    before = server.metrics()

    results = asyncio.run(_burst(server))

    after = server.metrics()
    problems = []
    for i, result in enumerate(results):
        reference = alone[i % len(PROMPTS)]
        usage = result["usage"]
        if result["text"] != reference.choices[0].text:
            problems.append(f"request {i}: {result['text']!r} != alone {reference.choices[0].text!r}")
        if (usage.completion_tokens, usage.prompt_tokens) != (MAX_TOKENS, reference.usage.prompt_tokens):
            problems.append(f"request {i}: usage {usage}")
        if result["finish_reason"] != "length":
            problems.append(f"request {i}: finish_reason {result['finish_reason']}")
    assert not problems, "\n".join(problems)
    server.wait_idle()

    usages = [r["usage"] for r in results]
    spec = [u.model_extra["speculative"] for u in usages]
    assert sum(s["num_accepted_tokens"] for s in spec) > 0  # the speculative counters are exercised
    assert _delta(before, after, "specdec_requests_total", (("finish_reason", "length"),)) == NUM_REQUESTS
    assert _delta(before, after, "specdec_generation_tokens_total") == NUM_REQUESTS * MAX_TOKENS
    assert _delta(before, after, "specdec_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    for metric, key in (("drafts", "num_drafts"), ("draft_tokens", "num_draft_tokens"),
                        ("accepted_tokens", "num_accepted_tokens")):
        assert _delta(before, after, f"specdec_spec_decode_num_{metric}_total") == sum(s[key] for s in spec), metric
    per_position = [_delta(before, after, "specdec_spec_decode_num_accepted_tokens_per_pos_total",
                           (("position", str(p)),)) for p in range(8)]
    assert sum(per_position) == sum(s["num_accepted_tokens"] for s in spec)
    for p in range(8):
        assert per_position[p] == sum(s["accepted_per_position"][p] for s in spec
                                      if p < len(s["accepted_per_position"]))
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "time_per_output_token_seconds"):
        assert _delta(before, after, f"specdec_{histogram}_count") == NUM_REQUESTS, histogram
    accepted = after[("specdec_spec_decode_num_accepted_tokens_total", ())]
    drafted = after[("specdec_spec_decode_num_draft_tokens_total", ())]
    assert after[("specdec_spec_decode_acceptance_rate", ())] == pytest.approx(accepted / drafted if drafted else 0)
