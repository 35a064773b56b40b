"""Predicted Outputs on the real model: a prediction changes only the speed.

Three code edits (``code_edit_tasks``: the answer re-emits the code the client passes as the
prediction), greedy, with every method, batched (the three at once) and, for naive, the first
alone: the tokens equal naive decoding's without a prediction, token for token. One of the
three predictions is another function's code (mostly wrong: its drafts are rejected, and the
re-alignment must cope); the good ones must get prediction drafts accepted, or the comparison
would prove nothing.

With the default settings (the adaptive draft length on): where the policy judges the
prediction's drafts not worth their rows (a prior, against rows that a busy machine makes look
dear), the controller's probes verify them uncut now and then, learn their acceptance, and
take them from then on. Each run starts from a fresh controller (``ModelSession.run``'s
default): what earlier tests taught it, timings under another load, once cut every draft here.

While the prediction's draft wins over anything the method could draft, the method's proposer
is not called at all.
"""

from __future__ import annotations

import pytest

import specdec
from specdec import SamplingParams
from specdec.plugin_manager import load_plugins
from specdec.workloads import code_edit_tasks

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
#: Each method with its defaults; the draft model's is tests/e2e/test_draft_model.py's: the
#: default model drafting for itself through int4 kernels (its drafts mostly, not always, right).
METHODS = {
    "naive": {"method": "naive"},
    "ngram": {"method": "ngram"},
    "suffix": {"method": "suffix"},
    "mtp": {"method": "mtp"},
    "hybrid": {"method": "hybrid"},
    "draft_model": {"method": "draft_model", "model": "smollm2-135m-instruct", "quantization": "wint4",
                    "num_speculative_tokens": 4},
}


@pytest.fixture(scope="module")
def tasks(llm):
    """Prompt ids and prediction ids of the three requests (the last one's prediction is the
    first one's code: wrong for it)."""
    tokenizer = llm.tokenizer
    edits = code_edit_tasks(3, max_lines=14)
    prompts = tuple(tuple(tokenizer.encode_chat(messages)) for messages, _ in edits)
    predictions = [tokenizer.encode(prediction, add_special_tokens=False) for _, prediction in edits]
    predictions[2] = predictions[0]
    return prompts, predictions


def _spec(method: str) -> dict:
    return METHODS[method]


def _sampling(prediction=()) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, prediction=prediction)


@pytest.fixture(scope="module")
def reference(model_session, tasks):
    prompts, _ = tasks
    return [o.token_ids for o in model_session.run(None, prompts, _sampling(), chat=False, max_num_seqs=3)]


@pytest.mark.parametrize("method", list(METHODS))
def test_a_prediction_is_lossless_with_every_method_batched(model_session, tasks, reference, method):
    prompts, predictions = tasks
    outputs = model_session.run(_spec(method), prompts, [_sampling(p) for p in predictions], chat=False, max_num_seqs=3,
                                cache=False)
    for i, (output, expected) in enumerate(zip(outputs, reference)):
        assert output.token_ids == expected, \
            model_session.describe_divergence(prompts[i], expected, output.token_ids, label=f"{method}, request {i}")
    metrics = [o.metrics for o in outputs]
    # The right predictions draft, and most of what they draft is the answer.
    for m in metrics[:2]:
        assert m.num_prediction_accepted > m.num_prediction_rejected, (method, m)
    if method == "naive":  # with a method's own drafts, a short prediction match gives way to them
        assert metrics[2].num_prediction_rejected > 0, (method, metrics[2])
        # naive drafts nothing of its own: every accepted draft is the prediction's
        assert all(m.num_accepted_tokens == m.num_prediction_accepted for m in metrics), metrics
    # Drafted and verified tokens include the prediction's.
    for m in metrics:
        assert m.num_accepted_tokens >= m.num_prediction_accepted
        assert m.num_draft_tokens >= m.num_prediction_accepted + m.num_prediction_rejected


def test_a_prediction_alone_is_lossless_and_faster_per_step(model_session, tasks, reference):
    prompts, predictions = tasks
    [output] = model_session.run(_spec("naive"), prompts[:1], _sampling(predictions[0]), chat=False, cache=False)
    assert output.token_ids == reference[0]
    # Naive decoding takes a step per token: the prediction saved steps.
    assert output.metrics.num_steps < MAX_TOKENS * 0.75, output.metrics


def test_a_seeded_sampled_request_with_a_prediction_gives_its_tokens_batched_or_alone(model_session, tasks):
    """A seeded request at temperature > 0 keeps its proposer's calls (its random stream)
    whatever its prediction leads: batched or alone, the same tokens."""
    prompts, predictions = tasks
    sampling = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7 + i, ignore_eos=True, prediction=p)
                for i, p in enumerate(predictions)]
    batched = model_session.run(_spec("mtp"), prompts, sampling, chat=False, max_num_seqs=3, cache=False)
    alone = [model_session.run(_spec("mtp"), [p], s, chat=False, cache=False)[0] for p, s in zip(prompts, sampling)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert sum(o.metrics.num_prediction_accepted for o in batched) > 0


class CountingGarbage(specdec.Proposer):
    """Counts its calls and drafts token 0 (never the answer)."""

    NAME = "test_counting_garbage"
    calls = 0

    def propose(self, batch: specdec.ProposalBatch) -> specdec.Drafts:
        type(self).calls += 1
        return specdec.Drafts.from_lists([[0] * r.max_draft_len for r in batch.requests])


def test_a_leading_prediction_leaves_the_method_s_proposer_uncalled(model_session, tasks, reference, monkeypatch):
    plugins = load_plugins()
    plugins.proposers.register(CountingGarbage, "tests/e2e/test_prediction_lossless.py")
    monkeypatch.setattr(model_session.llm.engine, "plugins", plugins)
    prompts, _ = tasks
    # The answer itself as the prediction: it leads at every step until fewer tokens are left
    # of it than the method's k (3).
    spec = {"method": CountingGarbage.NAME, "num_speculative_tokens": 3}
    try:
        [output] = model_session.run(spec, prompts[:1], _sampling(reference[0]), chat=False, cache=False)
    finally:
        model_session.llm.set_speculative_config(None)
    assert output.token_ids == reference[0]
    assert output.metrics.num_prediction_accepted >= MAX_TOKENS - 2 * output.metrics.num_steps
    assert output.metrics.num_proposer_off_steps == 0  # not called for a better draft: not "off"
    assert CountingGarbage.calls <= 2, CountingGarbage.calls
