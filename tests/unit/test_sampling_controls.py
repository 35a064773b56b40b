"""The sampling controls (penalties, logit bias, min-p) as a row processor: the bounds of their
fields, the row rule (row ``j`` is processed as if ``drafts[:j]`` were emitted), and the
rejection strategy's statistical test with the controls on (speculation stays lossless)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from specdec import BatchSampling, Drafts, SamplingParams, VerifyInputs
from specdec.engine.sampling_processors import SamplingControls, sampling_processors
from specdec.errors import RequestError
from specdec.plugins.verify.rejection import RejectionVerify
from specdec.probs import processed_probs

VOCAB = 6
PROMPT = np.array([5, 5, 1], dtype=np.int64)
#: Tokens generated before the step: token 3 once.
OUTPUT = np.array([3], dtype=np.int64)
TARGET_LOGITS = np.log(
    np.array([[0.30, 0.25, 0.18, 0.12, 0.09, 0.06], [0.10, 0.15, 0.20, 0.25, 0.20, 0.10]])
).astype(np.float32)
DRAFT_Q = np.array([0.10, 0.35, 0.05, 0.30, 0.05, 0.15])
N = 300_000
CONTROLS = dict(temperature=0.9, top_k=5, top_p=0.95, presence_penalty=0.6, frequency_penalty=0.4,
                repetition_penalty=1.3, logit_bias={"2": 1.5}, min_p=0.12)


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("presence_penalty", "1"), ("frequency_penalty", -2.01),
    ("repetition_penalty", 0), ("repetition_penalty", float("inf")), ("min_p", 1.5), ("min_p", -0.1),
    ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"5": "1"}), ("logit_bias", [1, 2]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("logprobs", 21), ("logprobs", True),
])
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(RequestError) as caught:
        SamplingParams(**{field: value})
    assert caught.value.param == field


def test_defaults_need_no_processor():
    assert sampling_processors(SamplingParams(), PROMPT) == []
    # min-p does nothing at temperature 0 (the argmax always survives)
    assert sampling_processors(SamplingParams(min_p=0.5), PROMPT) == []
    assert len(sampling_processors(SamplingParams(presence_penalty=0.1), PROMPT)) == 1


def processed_row(controls: SamplingControls, tokens, row: int) -> np.ndarray:
    """Row ``row`` of the target logits, processed after ``tokens`` with no drafts."""
    rows = np.array(TARGET_LOGITS[row: row + 1], copy=True)
    controls.process(rows, np.asarray(tokens, dtype=np.int64), np.empty(0, dtype=np.int64))
    return rows


def test_row_j_counts_the_drafts_before_it():
    controls = SamplingControls(SamplingParams(**CONTROLS), PROMPT)
    tokens = np.concatenate([PROMPT, OUTPUT])
    both = np.array(TARGET_LOGITS, copy=True)
    controls.process(both, tokens, np.array([4]))
    # row 1 is what plain decoding would have had after emitting the draft
    alone = np.array(TARGET_LOGITS[1:2], copy=True)
    controls.process(alone, np.concatenate([tokens, [4]]), np.empty(0, dtype=np.int64))
    np.testing.assert_array_equal(both[1], alone[0])
    row0 = np.array(TARGET_LOGITS[:1], copy=True)
    controls.process(row0, tokens, np.empty(0, dtype=np.int64))
    np.testing.assert_array_equal(both[0], row0[0])
    # and the penalty did something: the draft (token 4) is penalized at row 1, not at row 0
    presence = SamplingControls(SamplingParams(presence_penalty=0.6), PROMPT)
    both = np.array(TARGET_LOGITS, copy=True)
    presence.process(both, tokens, np.array([4]))
    assert both[1, 4] == pytest.approx(TARGET_LOGITS[1, 4] - 0.6) and both[0, 4] == TARGET_LOGITS[0, 4]
    assert both[0, 3] == pytest.approx(TARGET_LOGITS[0, 3] - 0.6)  # the output token, at every row


def test_min_p_cuts_below_the_fraction_of_the_best():
    controls = SamplingControls(SamplingParams(temperature=1.0, min_p=0.5), PROMPT)
    rows = np.array(TARGET_LOGITS, copy=True)
    controls.process(rows, PROMPT, np.array([0]))
    probs = TARGET_LOGITS[0] - TARGET_LOGITS[0].max()
    assert (np.isinf(rows[0]) == (probs < np.log(0.5))).all()


def expected(probs_logits: np.ndarray, sampling: SamplingParams) -> np.ndarray:
    return processed_probs(probs_logits[None, None], np.array([sampling.temperature]), np.array([sampling.top_k]),
                           np.array([sampling.top_p]))[0, 0].astype(np.float64)


def p_value(tokens: np.ndarray, distribution: np.ndarray) -> float:
    counts = np.bincount(tokens.astype(np.int64), minlength=VOCAB)
    support = distribution > 0
    assert counts[~support].sum() == 0, f"tokens outside the support: {counts}"
    return chisquare(counts[support], distribution[support] / distribution[support].sum() * counts.sum()).pvalue


def verify_with_controls(sampling: SamplingParams, ignore_drafts: bool):
    """``N`` one-draft requests verified by the rejection strategy on logits processed by
    the controls (``ignore_drafts``: a wrong processor that leaves the drafts out of row 1)."""
    rng = np.random.default_rng(9)
    controls = SamplingControls(sampling, PROMPT)
    tokens = np.concatenate([PROMPT, OUTPUT])
    by_draft = np.empty((VOCAB, 2, VOCAB), dtype=np.float32)
    for d in range(VOCAB):  # the processed rows depend on the draft only
        if ignore_drafts:
            rows = np.concatenate([processed_row(controls, tokens, 0), processed_row(controls, tokens, 1)])
        else:
            rows = np.array(TARGET_LOGITS, copy=True)
            controls.process(rows, tokens, np.array([d]))
        by_draft[d] = rows
    drafts = rng.choice(VOCAB, size=N, p=DRAFT_Q)
    batch = Drafts(token_ids=drafts[:, None].astype(np.int64), lengths=np.ones(N, dtype=np.int64),
                   probs=np.broadcast_to(DRAFT_Q.astype(np.float32), (N, 1, VOCAB)))
    settings = BatchSampling(temperature=np.full(N, sampling.temperature, dtype=np.float32),
                             top_p=np.full(N, sampling.top_p, dtype=np.float32),
                             top_k=np.full(N, sampling.top_k, dtype=np.int64), uniforms=rng.random((N, 2, 2)))
    result = RejectionVerify().verify(VerifyInputs(logits=by_draft[drafts], drafts=batch, sampling=settings))
    return drafts, result.accepted_lengths == 1, result.output_tokens


@pytest.fixture(scope="module")
def sampling():
    return SamplingParams(**CONTROLS)


def test_rejection_stays_lossless_with_the_controls(sampling):
    controls = SamplingControls(sampling, PROMPT)
    tokens = np.concatenate([PROMPT, OUTPUT])
    drafts, kept, output = verify_with_controls(sampling, ignore_drafts=False)
    assert p_value(output[:, 0], expected(processed_row(controls, tokens, 0)[0], sampling)) > 1e-3
    tested = 0
    for d in range(VOCAB):  # the bonus token after draft d follows plain decoding after emitting d
        picked = kept & (drafts == d)
        if picked.sum() < 5000:  # a draft the controls make (nearly) impossible is seldom kept
            continue
        after = expected(processed_row(controls, np.concatenate([tokens, [d]]), 1)[0], sampling)
        assert p_value(output[picked, 1], after) > 1e-3, d
        tested += 1
    assert tested >= 2


def test_a_processor_that_ignores_the_drafts_fails_the_same_test(sampling):
    controls = SamplingControls(sampling, PROMPT)
    tokens = np.concatenate([PROMPT, OUTPUT])
    drafts, kept, output = verify_with_controls(sampling, ignore_drafts=True)
    d = 2  # the biased token: the penalty after it moves much of row 1's mass
    picked = kept & (drafts == d)
    after = expected(processed_row(controls, np.concatenate([tokens, [d]]), 1)[0], sampling)
    counts = np.bincount(output[picked, 1], minlength=VOCAB)
    support = after > 0
    # either a token the true distribution rules out occurs, or the chi-square fails
    assert counts[~support].sum() > 0 or p_value(output[picked, 1], after) < 1e-6
