"""Row processors on the real model: the mechanism (``specdec.engine.logits_processing``) shows
every verified row the drafts before it, and the sampling controls (penalties, logit bias)
keep speculation lossless: at temperature 0 every method gives naive decoding's tokens, and
the same raw logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from specdec import SamplingParams
from specdec.engine.logits_processing import RowProcessor
from specdec.workloads import code_edit_prompts

pytestmark = pytest.mark.slow

PROMPTS = tuple(code_edit_prompts(3))
PLAIN = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
CONTROLLED = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, presence_penalty=0.2,
                            frequency_penalty=0.1, repetition_penalty=1.05, logit_bias={"29": -3.0}, logprobs=2)
#: Each with the default verify strategy (rejection: greedy at temperature 0).
METHODS = {
    "ngram": {"method": "ngram", "adaptive_draft_length": False},
    "suffix": {"method": "suffix", "adaptive_draft_length": False},
    "mtp": {"method": "mtp", "adaptive_draft_length": False},
    "hybrid": {"method": "hybrid", "adaptive_draft_length": False},
    # tests/e2e/test_draft_model.py's: the default model drafting for itself through int4
    # kernels (most of its drafts are accepted, some rejected)
    "draft_model": {"method": "draft_model", "model": "smollm2-135m-instruct", "quantization": "wint4",
                    "num_speculative_tokens": 4, "adaptive_draft_length": False},
}


@pytest.fixture(scope="module")
def reference(model_session):
    return model_session.run(None, PROMPTS, CONTROLLED, max_num_seqs=len(PROMPTS))


def test_the_controls_change_the_output(model_session, reference):
    plain = model_session.run(None, PROMPTS, PLAIN, max_num_seqs=len(PROMPTS))
    assert any(p.token_ids != r.token_ids for p, r in zip(plain, reference))


@pytest.mark.parametrize("label", list(METHODS))
def test_penalties_keep_speculation_lossless(model_session, reference, label):
    outputs = model_session.run(METHODS[label], PROMPTS, CONTROLLED, max_num_seqs=len(PROMPTS))
    messages = [model_session.describe_divergence(prompt, ref.token_ids, out.token_ids, label=label)
                for prompt, ref, out in zip(PROMPTS, reference, outputs)]
    assert not any(messages), "\n".join(m for m in messages if m)
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0, f"{label}: no draft accepted"
    # the raw logprobs, from the rows of accepted drafts too, equal naive decoding's
    for ref, out in zip(reference, outputs):
        assert [e.token_id for e in out.logprobs] == out.token_ids
        for a, b in zip(out.logprobs, ref.logprobs):
            assert abs(a.logprob - b.logprob) <= 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(abs(x - y) <= 1e-4 for (_, x), (_, y) in zip(a.top, b.top))


class ForceSequence(RowProcessor):
    """A grammar in miniature: only ``sequence[i]`` may be the i-th output token. Row ``j``
    must be shown ``drafts[:j]`` for the forced token to be the right one."""

    def __init__(self, sequence, num_prompt_tokens):
        self.sequence, self.num_prompt_tokens = list(sequence), num_prompt_tokens
        self.emitted: list[int] = []

    def process(self, logits, tokens, drafts):
        assert logits.shape[0] == len(drafts) + 1
        position = len(tokens) - self.num_prompt_tokens
        for j in range(logits.shape[0]):
            allowed = self.sequence[min(position + j, len(self.sequence) - 1)]
            keep = logits[j, allowed]
            logits[j] = -np.inf
            logits[j, allowed] = keep

    def on_emitted(self, tokens):
        self.emitted.extend(int(t) for t in tokens)


def test_a_processor_forces_its_tokens_through_accepted_drafts(model_session):
    llm = model_session.llm
    engine = llm.engine
    # a repetitive target the ngram proposer drafts from the prompt itself
    sequence = llm.tokenizer.encode(" one two three one two three one two three one two three")[:20]
    prompt = llm.tokenizer.encode("Count: one two three one two three one two three one two three")
    llm.set_speculative_config({"method": "ngram", "adaptive_draft_length": False})
    try:
        request = engine.add_request(prompt, SamplingParams(max_tokens=len(sequence), temperature=0.0,
                                                            ignore_eos=True))
        processor = ForceSequence(sequence, len(prompt))
        request.row_processors.append(processor)
        output, = engine.run([request])
    finally:
        llm.set_speculative_config(None)
    assert output.token_ids == sequence
    assert processor.emitted == sequence
    assert output.metrics.num_accepted_tokens > 0
