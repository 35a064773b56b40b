"""``rejection`` with a model proposer that supplies draft probabilities: at temperature > 0
the ``mtp`` head samples its drafts from its own processed distribution and hands it over as
``Drafts.probs``; the tokens the engine emits must still follow the target's distribution.

The check runs the real default model: ``N`` requests of one prompt, each with its own seed,
generate three tokens. The second token was drafted by the head and then accepted or replaced
by the residual sample, so, among the requests whose first token is the most common one, its
counts must fit the target's processed distribution after ``prompt + first token`` (computed
from the target's logits) by a chi-square test. A control proposer that reports the same
probabilities but always drafts the head's argmax (so its drafts do not come from them) must
fail the very same test: that shows the test can tell.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from specdec import SamplingParams
from specdec.plugin_manager import load_plugins
from specdec.plugins.mtp import MtpProposer
from specdec.probs import processed_probs

pytestmark = pytest.mark.slow

PROMPT = "My favourite animal is the"  # first token and the one after it both spread out
N = 1024
TEMPERATURE, TOP_K, TOP_P = 1.0, 6, 1.0
PASS_P_VALUE = 1e-3
FAIL_P_VALUE = 1e-6


class ArgmaxDraftsWithProbs(MtpProposer):
    """Control: reports the head's sampling distribution as ``probs`` but drafts its argmax."""

    NAME = "test_argmax_drafts_with_probs"

    def _choose(self, state, requests):
        _, probs = super()._choose(state, requests)
        return self.head.draft_tokens(state), probs


@pytest.fixture(scope="module")
def engine_plugins(model_session):
    plugins = load_plugins()
    plugins.proposers.register(ArgmaxDraftsWithProbs, "tests/e2e/test_mtp_sampling.py")
    engine = model_session.llm.engine
    saved = engine.plugins
    engine.plugins = plugins
    yield plugins
    engine.plugins = saved
    model_session.llm.set_speculative_config(None)


def second_tokens(model_session, method: str) -> tuple[np.ndarray, np.ndarray, object]:
    """``(first tokens [N], second tokens [N], summed metrics)`` of ``N`` seeded requests."""
    spec = {"method": method, "num_model_steps": 1, "adaptive_draft_length": False}
    # Three tokens: the step after the prefill may draft one (a draft is never made for the last).
    sampling = [SamplingParams(max_tokens=3, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, seed=seed,
                               ignore_eos=True) for seed in range(N)]
    outputs = model_session.run(spec, [PROMPT] * N, sampling, max_num_seqs=256, chat=False, cache=False)
    tokens = np.array([o.token_ids for o in outputs])
    metrics = outputs[0].metrics
    for output in outputs[1:]:
        metrics = metrics + output.metrics
    return tokens[:, 0], tokens[:, 1], metrics


def fit_p_value(model_session, first: np.ndarray, second: np.ndarray) -> float:
    """Chi-square p-value of the second tokens after the most common first token against the
    target's processed distribution there; tokens it rules out must not occur."""
    values, counts = np.unique(first, return_counts=True)
    top = int(values[np.argmax(counts)])
    observed = second[first == top]
    assert len(observed) >= 300, f"only {len(observed)} requests share the first token"
    logits = model_session.next_token_logits(model_session.prompt_ids(PROMPT, chat=False) + [top])
    p = processed_probs(logits[None, None], np.array([TEMPERATURE]), np.array([TOP_K]), np.array([TOP_P]))[0, 0]
    support = np.flatnonzero(p > 0)
    assert np.isin(observed, support).all(), "a token outside the target's top-k was emitted"
    counts = np.array([np.count_nonzero(observed == token) for token in support])
    kept = p[support].astype(np.float64)
    expected = kept / kept.sum() * len(observed)
    value = chisquare(counts, expected).pvalue
    print(f"{len(observed)} second tokens after {top}: counts {counts.tolist()}, expected "
          f"{expected.round(1).tolist()}, p-value {value:.3g}")
    return value


def test_sampled_mtp_drafts_keep_the_target_distribution(model_session, engine_plugins):
    first, second, metrics = second_tokens(model_session, "mtp")
    # The head drafted for every request, and its sampled drafts were accepted and rejected.
    assert metrics.num_draft_tokens == N
    assert 0.05 * N < metrics.num_accepted_tokens < 0.95 * N
    assert fit_p_value(model_session, first, second) > PASS_P_VALUE


def test_drafts_not_drawn_from_their_probs_fail_the_same_test(model_session, engine_plugins):
    first, second, _ = second_tokens(model_session, ArgmaxDraftsWithProbs.NAME)
    assert fit_p_value(model_session, first, second) < FAIL_P_VALUE


def test_a_seeded_sampled_request_repeats_its_tokens(model_session):
    """Also when its prompt is in the prefix cache the second time (a model proposer then
    computes the prompt anyway: its drafts depend on the states of every position)."""
    prompts = ["Write a short story about a dragon.", "Explain recursion.", "Add a docstring: def f(x): return x*2"]
    sampling = [SamplingParams(max_tokens=48, temperature=t, seed=1) for t in (0.8, 0.0, 1.0)]
    llm = model_session.llm
    llm.set_speculative_config({"method": "mtp", "mtp_strategy": "with_ngram", "num_model_steps": 2,
                                "num_speculative_tokens": 5})
    try:
        first = llm.generate(prompts, sampling, use_chat_template=True)
        second = llm.generate(prompts, sampling, use_chat_template=True)  # the prompts' prefix now cached
    finally:
        llm.set_speculative_config(None)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert sum(o.metrics.num_draft_tokens for o in first) > 0
