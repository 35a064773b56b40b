"""Logprobs, the logits controls (penalties, logit bias, min-p, stop token ids) and ``n`` through
the official ``openai`` client, against the real server (ngram with greedy verification): each
is lossless under speculation, so the same request with speculation off (``speculative:
{"num_speculative_tokens": 0}``, naive decoding) gives the same tokens, and drafts were
accepted on the way (``usage.speculative``), or the comparison would prove nothing. The
logprobs also with the server's engine switched to suffix, mtp, hybrid and the draft model,
requests batched."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from server_harness import MODEL_NAME, PROMPT, speculative_method
from specdec.workloads import code_edit_prompts

pytestmark = pytest.mark.slow

NAIVE = {"speculative": {"num_speculative_tokens": 0}}
MESSAGES = [{"role": "user", "content": PROMPT}]
#: A logprob computed from the rows of a speculative step may differ from naive decoding's in
#: float rounding only.
TOLERANCE = 1e-4


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE


def _accepted(response) -> int:
    """The drafts the request's verification accepted (``usage.speculative``)."""
    return response.usage.model_extra["speculative"]["num_accepted_tokens"]


def _assert_same_logprobs(spec, naive, label=""):
    """A completion choice's ``logprobs`` (the legacy shape) against naive decoding's: the same
    tokens and offsets, each logprob and each top alternative within TOLERANCE."""
    assert spec.text == naive.text and spec.logprobs.tokens == naive.logprobs.tokens, label
    assert spec.logprobs.text_offset == naive.logprobs.text_offset, label
    for i, (a, b) in enumerate(zip(spec.logprobs.token_logprobs, naive.logprobs.token_logprobs, strict=True)):
        assert a <= 0 and _close(a, b), (label, i, a, b)
    for token, logprob, top_a, top_b in zip(spec.logprobs.tokens, spec.logprobs.token_logprobs,
                                            spec.logprobs.top_logprobs, naive.logprobs.top_logprobs, strict=True):
        assert len(top_a) == len(top_b) and set(top_a) == set(top_b), label
        assert all(_close(top_a[t], top_b[t]) for t in top_a), label
        assert _close(max(top_a.values()), logprob) and token in top_a, label  # greedy: the argmax


def _streamed_completion(client, **fields):
    """A streamed completion put back together: ``(text, tokens, token_logprobs, top_logprobs,
    text_offset, usage)``."""
    text, tokens, logprobs, tops, offsets, usage = "", [], [], [], [], None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **fields):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.text
            if choice.text:  # each chunk with text carries its tokens' logprobs
                assert choice.logprobs is not None and choice.logprobs.tokens
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                logprobs += choice.logprobs.token_logprobs
                tops += choice.logprobs.top_logprobs
                offsets += choice.logprobs.text_offset
    return text, tokens, logprobs, tops, offsets, usage


def test_completion_logprobs_equal_with_and_without_speculation(server):
    client = server.openai()
    fields = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3)
    runs = [client.completions.create(**fields, extra_body=extra) for extra in (None, NAIVE)]
    spec, naive = (run.choices[0] for run in runs)
    assert _accepted(runs[0]) > 0  # rows of accepted drafts
    assert _accepted(runs[1]) == 0 and runs[1].usage.model_extra["speculative"]["num_drafts"] == 0
    _assert_same_logprobs(spec, naive)
    assert "".join(spec.logprobs.tokens) == spec.text and len(spec.logprobs.tokens) == 24
    assert spec.logprobs.text_offset[0] == 0 and spec.logprobs.text_offset[1] == len(spec.logprobs.tokens[0])
    assert all(len(top) == 3 for top in spec.logprobs.top_logprobs)

    # Streamed, chunk by chunk: the same tokens, logprobs and offsets as the whole response.
    text, tokens, logprobs, tops, offsets, usage = _streamed_completion(client, **fields)
    assert usage.model_extra["speculative"]["num_accepted_tokens"] > 0
    assert text == naive.text and tokens == naive.logprobs.tokens and offsets == naive.logprobs.text_offset
    for i, (a, b, top_a, top_b) in enumerate(zip(logprobs, naive.logprobs.token_logprobs, tops,
                                                 naive.logprobs.top_logprobs, strict=True)):
        assert _close(a, b) and set(top_a) == set(top_b) and all(_close(top_a[t], top_b[t]) for t in top_a), i


#: Prompts the methods below draft for (code edits: the answer re-emits the code), sent at once.
SWITCHED_PROMPTS = code_edit_prompts(3)
SWITCHED_MAX_TOKENS = 32


def _switched_completions(server, extra=None) -> list:
    """The completions (logprobs=2) of SWITCHED_PROMPTS, sent at once."""
    client = server.openai()

    def run(prompt):
        return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=SWITCHED_MAX_TOKENS,
                                         temperature=0, logprobs=2, extra_body=extra)

    with ThreadPoolExecutor(len(SWITCHED_PROMPTS)) as pool:
        return list(pool.map(run, SWITCHED_PROMPTS))


@pytest.fixture(scope="module")
def naive_logprobs(server):
    """Naive decoding's completion choices of SWITCHED_PROMPTS."""
    return [response.choices[0] for response in _switched_completions(server, NAIVE)]


#: The other methods, and the keys each needs besides its defaults: the draft model is the
#: default model drafting for itself through int4 kernels (tests/e2e/test_draft_model.py's).
SWITCHED_METHODS = {"suffix": {}, "mtp": {}, "hybrid": {},
                    "draft_model": {"model": "smollm2-135m-instruct", "quantization": "wint4"}}


@pytest.mark.parametrize("method", list(SWITCHED_METHODS))
def test_completion_logprobs_equal_naive_with_every_method_batched(server, naive_logprobs, method):
    """The server's engine switched to another method (its default verify strategy, every draft
    verified), three requests at once: the texts and logprobs of naive decoding."""
    with speculative_method(server, method, adaptive_draft_length=False, **SWITCHED_METHODS[method]):
        responses = _switched_completions(server)
    for i, (response, naive) in enumerate(zip(responses, naive_logprobs)):
        _assert_same_logprobs(response.choices[0], naive, f"{method}, prompt {i}")
    assert sum(_accepted(r) for r in responses) > 0, f"{method}: no draft accepted, the comparison proves nothing"


def test_chat_logprobs_streamed_per_chunk(server):
    client = server.openai()
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=16, temperature=0,
                                           logprobs=True, top_logprobs=2, extra_body=NAIVE).choices[0]
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=16, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert _accepted(chunks[-1]) > 0  # the streamed run's logprobs came from rows of accepted drafts too
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
#: Milder controls: the answer still re-emits much of the prompt's code, which ngram drafts from
#: (CONTROLS keep it off the prompt's tokens: ngram's drafts are then rarely accepted).
MILD_CONTROLS = {"presence_penalty": 0.2, "frequency_penalty": 0.1, "repetition_penalty": 1.05, "min_p": 0.05,
                 "logit_bias": {"29": -3}}


def test_penalties_are_lossless_under_speculation(server):
    client = server.openai()

    def run(extra):
        return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0,
                                              extra_body=extra)

    plain = run(None).choices[0].message.content
    for controls in (CONTROLS, MILD_CONTROLS):
        controlled = run(controls)
        assert controlled.choices[0].message.content != plain, controls  # the controls did something
        assert controlled.choices[0].message.content == run({**controls, **NAIVE}).choices[0].message.content
    assert _accepted(controlled) > 0  # drafts were accepted under the (mild) controls


def test_stop_token_ids_end_the_choice(server):
    client = server.openai()
    first = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)
    tokens = first.choices[0].logprobs.tokens
    target = server.engine_loop.tokenizer.encode(tokens[3])
    stopped = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": target})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens <= 4


def test_a_stop_token_among_accepted_drafts_ends_the_choice_as_naive_decoding_does(server):
    """On the code edit (the answer re-emits the prompt's code) ngram's drafts are accepted: a
    stop token that came as an accepted draft ends the choice at that token, drafts after it
    dropped, with naive decoding's text and token count."""
    client = server.openai()

    def run(extra):
        return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0,
                                              extra_body=extra)

    sources = run({"include_token_sources": True}).choices[0].model_extra["token_sources"]
    texts: dict[int, str] = {}
    for entry in sources:  # a token's text may come in parts
        texts[entry["index"]] = texts.get(entry["index"], "") + entry["text"]
    drafted = {e["index"] for e in sources if e["source"] == "draft"}
    encode = server.engine_loop.tokenizer.encode
    # The first token past the first few, one token by its text and not seen before it, that
    # is an accepted draft followed by another of the same step (a step's tokens are its
    # accepted drafts, then the target's own): the stop cuts that step's accepted drafts.
    index, stop_id = next((i, encode(texts[i], add_special_tokens=False)[0]) for i in sorted(drafted)
                          if i >= 3 and i + 1 in drafted and len(encode(texts[i], add_special_tokens=False)) == 1
                          and texts[i] not in [texts[j] for j in range(i)])
    extra = {"stop_token_ids": [stop_id]}
    stopped, naive = run(extra), run({**extra, **NAIVE})
    expected = "".join(texts[i] for i in range(index + 1))  # the stop token is kept, as EOS is
    for response in (stopped, naive):
        assert response.choices[0].finish_reason == "stop" and response.usage.completion_tokens == index + 1
        assert response.choices[0].message.content == expected
    assert _accepted(stopped) > 0


def test_n_choices_share_the_prompt_and_derive_their_seeds(server):
    client = server.openai()
    pool = server.engine_loop.engine.kv.pool
    prompt = "A story nobody has asked for yet: " + PROMPT  # not in the prefix cache
    shared_blocks = len(server.engine_loop.tokenizer.encode(prompt)) // pool.block_size
    reused = pool.num_reused_blocks
    many = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=1.0, seed=123, n=3)
    # the choices share the prompt's KV: its full blocks are computed once, and taken twice
    assert shared_blocks > 0 and pool.num_reused_blocks - reused >= 2 * shared_blocks
    assert [c.index for c in many.choices] == [0, 1, 2]
    alone = [client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=1.0,
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
