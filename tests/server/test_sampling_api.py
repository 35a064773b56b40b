"""Logprobs, the logits controls (penalties, logit bias, min-p) and ``n`` through the official
``openai`` client, against the real server (ngram with greedy verification): each is lossless
under speculation, so the same request with speculation off (``speculative:
{"num_speculative_tokens": 0}``, naive decoding) gives the same tokens."""

from __future__ import annotations

import pytest

from server_harness import MODEL_NAME, PROMPT

pytestmark = pytest.mark.slow

NAIVE = {"speculative": {"num_speculative_tokens": 0}}
MESSAGES = [{"role": "user", "content": PROMPT}]
#: A logprob computed from the rows of a speculative step may differ from naive decoding's in
#: float rounding only.
TOLERANCE = 1e-4


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE


def test_completion_logprobs_equal_with_and_without_speculation(server):
    client = server.openai()
    runs = [client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3,
                                      extra_body=extra) for extra in (None, NAIVE)]
    spec, naive = (run.choices[0] for run in runs)
    assert runs[0].usage.model_extra["speculative"]["num_accepted_tokens"] > 0  # rows of accepted drafts
    assert spec.text == naive.text and spec.logprobs.tokens == naive.logprobs.tokens
    assert "".join(spec.logprobs.tokens) == spec.text and len(spec.logprobs.tokens) == 24
    assert spec.logprobs.text_offset[0] == 0 and spec.logprobs.text_offset[1] == len(spec.logprobs.tokens[0])
    for i, (a, b) in enumerate(zip(spec.logprobs.token_logprobs, naive.logprobs.token_logprobs)):
        assert a <= 0 and _close(a, b), (i, a, b)
    for token, logprob, top_a, top_b in zip(spec.logprobs.tokens, spec.logprobs.token_logprobs,
                                            spec.logprobs.top_logprobs, naive.logprobs.top_logprobs):
        assert len(top_a) == 3 and set(top_a) == set(top_b)
        assert all(_close(top_a[t], top_b[t]) for t in top_a)
        assert _close(max(top_a.values()), logprob) and token in top_a  # greedy: the argmax


def test_chat_logprobs_streamed_per_chunk(server):
    client = server.openai()
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=16, temperature=0,
                                           logprobs=True, top_logprobs=2, extra_body=NAIVE).choices[0]
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=16, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = []
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.delta.content:  # each chunk with text carries its tokens' logprobs
                assert choice.logprobs is not None and choice.logprobs.content
            if choice.logprobs is not None:
                streamed.extend(choice.logprobs.content)
    content = whole.logprobs.content
    assert len(content) == len(streamed) == 16
    assert "".join(c.token for c in content) == whole.message.content
    for a, b in zip(streamed, content):
        assert a.token == b.token and _close(a.logprob, b.logprob)
        assert bytes(a.bytes) == a.token.encode()
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs] and len(a.top_logprobs) == 2
        assert a.top_logprobs[0].logprob >= a.top_logprobs[1].logprob


CONTROLS = {"presence_penalty": 0.8, "frequency_penalty": 0.6, "repetition_penalty": 1.2, "min_p": 0.1,
            "logit_bias": {"29": -5}}


def test_penalties_are_lossless_under_speculation(server):
    client = server.openai()

    def text(extra):
        return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0,
                                              extra_body=extra).choices[0].message.content

    plain = text(None)
    controlled = text(CONTROLS)
    assert controlled != plain  # the controls did something
    assert controlled == text({**CONTROLS, **NAIVE})


def test_stop_token_ids_end_the_choice(server):
    client = server.openai()
    first = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)
    tokens = first.choices[0].logprobs.tokens
    target = server.engine_loop.tokenizer.encode(tokens[3])
    stopped = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": target})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens <= 4


def test_n_choices_share_the_prompt_and_derive_their_seeds(server):
    client = server.openai()
    many = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                     seed=123, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    alone = [client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                       seed=123 + i) for i in range(3)]
    # choice i is the request with seed 123 + i (this server verifies greedily, so the texts
    # agree anyway: test_choice_seeds shows the seeds)
    assert [c.text for c in many.choices] == [a.choices[0].text for a in alone]
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens  # the prompt is counted once
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, temperature=1.0, seed=7, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    texts, finished = {0: "", 1: ""}, set()
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    whole = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=6, temperature=1.0, seed=7, n=2)
    assert finished == {0, 1} and [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_choice_seeds():
    from specdec import SamplingParams
    from specdec.sampling import MAX_SEED
    from specdec.server.app import choice_samplings

    assert [s.seed for s in choice_samplings(SamplingParams(seed=123, temperature=1.0), 3)] == [123, 124, 125]
    assert [s.seed for s in choice_samplings(SamplingParams(seed=MAX_SEED), 2)] == [MAX_SEED, 0]
    # without a seed every choice gets the engine's own stream (a seed per request number)
    assert [s.seed for s in choice_samplings(SamplingParams(), 2)] == [None, None]
