"""Lossless strategies, checked statistically: the tokens they emit follow the target.

Each test pushes ``N`` independent requests through one ``verify`` call (a batch of ``N``) and
compares the emitted tokens with the processed target distribution by a chi-square test. ``N``
is large enough that a strategy moving 2% of the probability mass (``BiasedAccept``) fails the
very same test by a wide margin, and the seeds are fixed, so the outcome is deterministic.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from scipy.stats import chisquare

from specdec import BatchSampling, Drafts, VerifyInputs
from specdec.plugins.verify.rejection import RejectionVerify
from specdec.plugins.verify.target_match import TargetMatchVerify
from specdec.probs import processed_probs

N = 300_000
VOCAB = 6
#: The target's logits after the context (row 0) and after the first draft (row 1).
TARGET_LOGITS = np.log(
    np.array([[0.30, 0.25, 0.18, 0.12, 0.09, 0.06], [0.10, 0.15, 0.20, 0.25, 0.20, 0.10]])
).astype(np.float32)
#: The draft distribution: unlike the target, with mass on tokens top-k/top-p remove.
DRAFT_Q = np.array([0.10, 0.35, 0.05, 0.30, 0.05, 0.15])
#: The token a deterministic proposer always drafts.
FIXED_DRAFT = 0
#: (temperature, top_k, top_p): plain, and two that cut the target to four tokens.
VARIANTS = [(1.0, 0, 1.0), (0.7, 5, 0.9), (1.3, 4, 0.85)]
#: The real strategies must pass with a p-value above this; the biased control must not come close.
PASS_P_VALUE = 1e-3
FAIL_P_VALUE = 1e-6


class BiasedAccept(RejectionVerify):
    """Control: accepts with min(1, 1.02 p/q), which moves about 2% of the mass of some tokens."""

    @staticmethod
    def accept(p_draft, q_draft, u):
        return u * q_draft < 1.02 * p_draft


def target_distribution(row: int, variant) -> np.ndarray:
    temperature, top_k, top_p = variant
    probs = processed_probs(TARGET_LOGITS[None, row : row + 1], np.array([temperature]), np.array([top_k]), np.array([top_p]))
    return probs[0, 0].astype(np.float64)


@functools.lru_cache(maxsize=None)
def run(strategy, variant, with_draft_probs: bool, seed: int):
    """Verify ``N`` one-draft requests; drafts come from ``DRAFT_Q`` or are ``FIXED_DRAFT``.

    :returns: ``(accepted [N] bool, output_tokens [N, 2] int8)``, kept small for the cache.
    """
    rng = np.random.default_rng(seed)
    temperature, top_k, top_p = variant
    if with_draft_probs:
        tokens = rng.choice(VOCAB, size=N, p=DRAFT_Q)
        draft_probs = np.broadcast_to(DRAFT_Q.astype(np.float32), (N, 1, VOCAB))
    else:
        tokens = np.full(N, FIXED_DRAFT)
        draft_probs = None
    drafts = Drafts(token_ids=tokens[:, None].astype(np.int64), lengths=np.ones(N, dtype=np.int64), probs=draft_probs)
    sampling = BatchSampling(
        temperature=np.full(N, temperature, dtype=np.float32),
        top_p=np.full(N, top_p, dtype=np.float32),
        top_k=np.full(N, top_k, dtype=np.int64),
        uniforms=rng.random((N, 2, 2)),
    )
    logits = np.broadcast_to(TARGET_LOGITS, (N, 2, VOCAB))
    result = strategy().verify(VerifyInputs(logits=logits, drafts=drafts, sampling=sampling))
    return result.accepted_lengths == 1, result.output_tokens.astype(np.int8)


def p_value(tokens: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square p-value of ``tokens`` against ``expected``; tokens it rules out must not occur."""
    counts = np.bincount(tokens.astype(np.int64), minlength=VOCAB)
    support = expected > 0
    assert counts[~support].sum() == 0, f"tokens outside the target's support: {counts}"
    return chisquare(counts[support], expected[support] / expected[support].sum() * counts.sum()).pvalue


VARIANT_IDS = ["plain", "t0.7-k5-p0.9", "t1.3-k4-p0.85"]
DRAFT_MODES = pytest.mark.parametrize("with_draft_probs", [True, False], ids=["drafts-from-q", "fixed-draft"])


@DRAFT_MODES
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
class TestRejectionIsLossless:
    def test_first_token_follows_the_target(self, variant, with_draft_probs):
        kept_draft, output = run(RejectionVerify, variant, with_draft_probs, seed=1)
        # The first token is the accepted draft or the residual sample: both paths are in here.
        assert 0.1 < kept_draft.mean() < 0.9
        assert p_value(output[:, 0], target_distribution(0, variant)) > PASS_P_VALUE

    def test_biased_control_fails_the_same_test(self, variant, with_draft_probs):
        _, output = run(BiasedAccept, variant, with_draft_probs, seed=1)
        assert p_value(output[:, 0], target_distribution(0, variant)) < FAIL_P_VALUE

    def test_bonus_token_follows_the_target(self, variant, with_draft_probs):
        kept_draft, output = run(RejectionVerify, variant, with_draft_probs, seed=1)
        assert p_value(output[kept_draft, 1], target_distribution(1, variant)) > PASS_P_VALUE


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_target_match_follows_the_target_for_a_fixed_draft(variant):
    kept_draft, output = run(TargetMatchVerify, variant, with_draft_probs=False, seed=3)
    assert p_value(output[:, 0], target_distribution(0, variant)) > PASS_P_VALUE
    assert p_value(output[kept_draft, 1], target_distribution(1, variant)) > PASS_P_VALUE
