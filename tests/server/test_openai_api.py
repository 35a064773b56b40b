"""The OpenAI endpoints through the official ``openai`` client, against the real server.

Greedy outputs must equal ``specdec generate`` for the same request (the server runs ngram with
greedy verification, the CLI plain decoding), and usage counts must be exactly the engine's.
"""

from __future__ import annotations

import pytest

import specdec

from server_harness import MAX_TOKENS, MODEL_NAME, PROMPT

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": PROMPT}]


def _check_usage(usage, reference: dict) -> None:
    assert usage.prompt_tokens == reference["num_prompt_tokens"]
    assert usage.completion_tokens == reference["num_generated_tokens"] == MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    spec = usage.model_extra["speculative"]
    assert set(spec) == {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
                         "mean_acceptance_length", "accepted_per_position", "num_proposer_off_steps"}
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert spec["mean_acceptance_length"] >= 1.0


def test_health_version_models(server):
    health = server.health()
    assert health["status"] == "ok" and health["running"] is True
    assert health["num_free_kv_blocks"] == health["num_kv_blocks"] > 0
    assert server.http.get("/version").json() == {"version": specdec.__version__}
    [model] = server.openai().models.list().data
    assert model.id == MODEL_NAME and model.object == "model"


def test_chat_equals_specdec_generate(server, generate_reference):
    reference = generate_reference["chat"]
    response = server.openai().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                       temperature=0)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    assert response.model == MODEL_NAME and response.created > 0
    [choice] = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == reference["text"]
    assert choice.finish_reason == "length"
    _check_usage(response.usage, reference)
    assert response.usage.model_extra["speculative"]["num_drafts"] > 0  # ngram drafted


def test_chat_stream_equals_specdec_generate(server, generate_reference):
    reference = generate_reference["chat"]
    chunks = list(server.openai().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.id.startswith("chatcmpl-") for c in chunks)
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL_NAME for c in chunks)
    *content_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert [c.choices[0].finish_reason for c in content_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert all(c.usage is None for c in content_chunks)
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == reference["text"]
    assert len(content_chunks) > 3  # streamed piece by piece, not in one go
    _check_usage(usage_chunk.usage, reference)


def test_completion_equals_specdec_generate(server, generate_reference):
    reference = generate_reference["plain"]
    client = server.openai()
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    [choice] = response.choices
    assert choice.text == reference["text"] and choice.finish_reason == "length"
    _check_usage(response.usage, reference)

    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True))
    assert all(c.usage is None and c.choices for c in chunks)  # no usage chunk without include_usage
    assert "".join(c.choices[0].text for c in chunks) == reference["text"]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_stream_usage_and_token_prompt(server, generate_reference):
    reference = generate_reference["plain"]
    client = server.openai()
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    _check_usage(chunks[-1].usage, reference)
    # the same prompt as token ids
    ids = server.engine_loop.tokenizer.encode(PROMPT)
    response = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].text == reference["text"]
    assert response.usage.prompt_tokens == len(ids) == reference["num_prompt_tokens"]


def test_per_request_speculation(server, generate_reference):
    reference = generate_reference["chat"]
    client = server.openai()

    def run(speculative):
        return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body={"speculative": speculative})

    off = run({"num_speculative_tokens": 0})
    assert off.choices[0].message.content == reference["text"]
    spec = off.usage.model_extra["speculative"]
    assert spec["num_drafts"] == spec["num_draft_tokens"] == spec["num_accepted_tokens"] == 0
    assert spec["mean_acceptance_length"] == 1.0

    limited = run({"num_speculative_tokens": 2})
    assert limited.choices[0].message.content == reference["text"]
    spec = limited.usage.model_extra["speculative"]
    assert 0 < spec["num_draft_tokens"] <= 2 * spec["num_drafts"]
    assert len(spec["accepted_per_position"]) <= 2


def test_stop_strings(server, generate_reference):
    """A stop string ends the text before it, streamed or not (no piece of it leaks out)."""
    reference = generate_reference["chat"]["text"]
    stop = reference[len(reference) // 2: len(reference) // 2 + 6]
    expected = reference[: reference.index(stop)]
    client = server.openai()
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                              temperature=0, stop=[stop, "never-appears-xyz"])
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(server):
    client = server.openai()

    def sample():
        return client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12,
                                         temperature=0.9, top_p=0.95, seed=1234,
                                         extra_body={"top_k": 40, "ignore_eos": True})

    first, second = sample(), sample()
    assert first.choices[0].text == second.choices[0].text
    assert first.usage.completion_tokens == second.usage.completion_tokens == 12
