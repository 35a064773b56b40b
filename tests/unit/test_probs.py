"""specdec.probs: processed distributions, inverse-CDF sampling, the target's own choice."""

from __future__ import annotations

import numpy as np
import pytest

from specdec import BatchSampling
from specdec import probs as probs_module
from specdec.probs import greedy_tokens, processed_probs, sample_tokens, target_choice, top_tokens


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """One row, the textbook way: full sort, no shortcuts."""
    logits = logits.astype(np.float64)
    if temperature <= 0:
        return np.eye(len(logits))[np.argmax(logits)]
    scaled = logits / temperature
    order = np.argsort(-scaled, kind="stable")
    if 0 < top_k < len(logits):
        scaled[order[top_k:]] = -np.inf
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_p < 1.0:
        cumulative = np.cumsum(probs[order])
        kept = 1 + np.count_nonzero(cumulative[:-1] < top_p)
        probs[order[kept:]] = 0.0
        probs /= probs.sum()
    return probs


def logits_from_probs(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def sampling(temperature, top_p=None, top_k=None, uniforms=None, rows=1) -> BatchSampling:
    temperature = np.asarray(temperature, dtype=np.float32)
    batch = len(temperature)
    return BatchSampling(
        temperature=temperature,
        top_p=np.asarray(top_p if top_p is not None else [1.0] * batch, dtype=np.float32),
        top_k=np.asarray(top_k if top_k is not None else [0] * batch, dtype=np.int64),
        uniforms=uniforms if uniforms is not None else np.zeros((batch, rows, 2)),
    )


class TestProcessedProbs:
    def test_temperature_scales_the_softmax(self):
        logits = np.array([[[1.0, 2.0, 3.0, 0.5]]], dtype=np.float32)
        got = processed_probs(logits, np.array([0.5]), np.array([0]), np.array([1.0]))
        expected = np.exp(logits[0, 0] / 0.5)
        np.testing.assert_allclose(got[0, 0], expected / expected.sum(), rtol=1e-5)

    def test_temperature_zero_is_one_hot_argmax(self):
        logits = np.array([[[1.0, 5.0, 3.0]], [[4.0, 1.0, 3.0]]], dtype=np.float32)
        got = processed_probs(logits, np.array([0.0, 1.0]), np.array([0, 0]), np.array([1.0, 1.0]))
        np.testing.assert_array_equal(got[0, 0], [0.0, 1.0, 0.0])
        assert got[1, 0, 0] == pytest.approx(np.exp(4) / np.exp([4.0, 1.0, 3.0]).sum(), rel=1e-5)

    def test_top_k_keeps_exactly_k_renormalised(self):
        logits = logits_from_probs([0.05, 0.4, 0.1, 0.3, 0.15])[None, None]
        got = processed_probs(logits, np.array([1.0]), np.array([2]), np.array([1.0]))[0, 0]
        np.testing.assert_allclose(got, [0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7, 0.0], rtol=1e-5)

    def test_top_p_keeps_the_token_that_crosses_it(self):
        # Sorted: 0.5 (id 3), 0.2 (id 0), 0.15 (id 4), 0.1 (id 1), 0.05 (id 2). Masses before
        # each: 0, .5, .7, .85, .95, so top_p = 0.8 keeps ids 3, 0, 4.
        logits = logits_from_probs([0.2, 0.1, 0.05, 0.5, 0.15])[None, None]
        got = processed_probs(logits, np.array([1.0]), np.array([0]), np.array([0.8]))[0, 0]
        np.testing.assert_allclose(got, [0.2 / 0.85, 0.0, 0.0, 0.5 / 0.85, 0.15 / 0.85], rtol=1e-5)

    def test_top_p_applies_to_what_top_k_left(self):
        # top_k = 3 leaves 0.5, 0.2, 0.15 -> renormalised .588, .235, .176; top_p = 0.8 then
        # keeps the first two (mass before the third is .824 >= .8).
        logits = logits_from_probs([0.2, 0.1, 0.05, 0.5, 0.15])[None, None]
        got = processed_probs(logits, np.array([1.0]), np.array([3]), np.array([0.8]))[0, 0]
        np.testing.assert_allclose(got, [0.2 / 0.7, 0.0, 0.0, 0.5 / 0.7, 0.0], rtol=1e-5)

    def test_top_p_one_keeps_every_token_despite_rounding(self):
        # Float32 probabilities rarely sum to exactly 1: a cumulative sum that reaches 1 early
        # must not cut the last tokens when top-p is off.
        logits = (np.random.default_rng(5).standard_normal((200, 2, 50)) * 10).astype(np.float32)
        got = processed_probs(logits, np.full(200, 1.0), np.full(200, 49), np.full(200, 1.0))
        assert (np.count_nonzero(got, axis=-1) == 49).all()

    def test_top_k_at_or_above_vocab_is_off(self):
        logits = np.array([[[0.0, 1.0, 2.0]]], dtype=np.float32)
        off = processed_probs(logits, np.array([1.0]), np.array([0]), np.array([1.0]))
        for top_k in (3, 10):
            got = processed_probs(logits, np.array([1.0]), np.array([top_k]), np.array([1.0]))
            np.testing.assert_allclose(got, off, rtol=1e-6)

    @pytest.mark.parametrize("vocab", [7, 300, 3000])
    def test_mixed_batch_matches_the_reference(self, vocab):
        rng = np.random.default_rng(vocab)
        batch, rows = 24, 3
        # Wide logits for a small nucleus, narrow ones for a nucleus beyond the first windows.
        scale = np.where(np.arange(batch) % 2 == 0, 4.0, 0.3)[:, None, None]
        logits = (rng.standard_normal((batch, rows, vocab)) * scale).astype(np.float32)
        temperature = rng.choice([0.0, 0.5, 1.0, 1.7], size=batch)
        top_k = rng.choice([0, 1, 3, 50, vocab + 5], size=batch)
        top_p = rng.choice([1.0, 0.95, 0.6, 0.1], size=batch)
        got = processed_probs(logits, temperature, top_k, top_p)
        assert got.dtype == np.float32 and got.shape == (batch, rows, vocab)
        for b in range(batch):
            for r in range(rows):
                expected = reference_probs(logits[b, r], temperature[b], top_k[b], top_p[b])
                np.testing.assert_allclose(got[b, r], expected, atol=2e-6, rtol=1e-4, err_msg=f"row {b},{r}")

    def test_large_nucleus_takes_the_full_sort(self):
        # Nearly uniform over 4000 tokens: the nucleus of 0.9 needs ~3600 of them.
        logits = np.random.default_rng(1).uniform(0, 0.01, size=(1, 1, 4000)).astype(np.float32)
        got = processed_probs(logits, np.array([1.0]), np.array([0]), np.array([0.9]))[0, 0]
        expected = reference_probs(logits[0, 0], 1.0, 0, 0.9)
        assert np.count_nonzero(got) == np.count_nonzero(expected) > 3000
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-9)


class TestSampleTokens:
    def test_inverse_cdf_on_a_hand_case(self):
        probs = np.array([[[0.1, 0.2, 0.3, 0.4]]] * 5, dtype=np.float32)
        u = np.array([[0.0], [0.05], [0.15], [0.5], [0.99]])
        np.testing.assert_array_equal(sample_tokens(probs, u)[:, 0], [0, 0, 1, 2, 3])

    def test_unnormalised_weights(self):
        weights = np.array([[[1.0, 3.0]]], dtype=np.float32)
        assert sample_tokens(weights, np.array([[0.2]]))[0, 0] == 0
        assert sample_tokens(weights, np.array([[0.3]]))[0, 0] == 1

    def test_never_returns_a_zero_weight_token(self):
        weights = np.array([[[0.0, 0.0, 0.5, 0.0, 0.5, 0.0]]] * 2, dtype=np.float32)
        u = np.array([[0.0], [np.nextafter(1.0, 0.0)]])
        np.testing.assert_array_equal(sample_tokens(weights, u)[:, 0], [2, 4])

    @pytest.mark.parametrize("vocab", [5, 256, 1000, 49152])
    def test_matches_a_plain_cumsum_search(self, vocab):
        rng = np.random.default_rng(vocab)
        weights = rng.random((8, 3, vocab)).astype(np.float32)
        weights[weights < 0.5] = 0.0
        weights[..., vocab // 2] = 0.7  # no row without mass
        weights[0, 0, :] = 0.0
        weights[0, 0, vocab - 1] = 1.0  # all the mass in the last token of the last block
        u = rng.random((8, 3))
        cdf = np.cumsum(weights, axis=-1, dtype=np.float64)
        target = np.minimum(u * cdf[..., -1], np.nextafter(cdf[..., -1], 0.0))
        expected = np.count_nonzero(cdf <= target[..., None], axis=-1)
        np.testing.assert_array_equal(sample_tokens(weights, u), expected)


class TestTargetChoice:
    def test_argmax_for_greedy_and_sample_for_the_rest(self):
        logits = logits_from_probs([[[0.1, 0.2, 0.3, 0.4]] * 2] * 2)
        uniforms = np.array([[0.05, 0.05], [0.05, 0.5]])
        got = target_choice(logits, sampling([0.0, 1.0], rows=2), uniforms)
        np.testing.assert_array_equal(got, [[3, 3], [0, 2]])

    def test_samples_follow_the_processed_distribution(self):
        rng = np.random.default_rng(0)
        logits = rng.standard_normal((4, 2, 50)).astype(np.float32)
        batch_sampling = sampling([0.7, 0.0, 1.2, 1.0], top_p=[0.9, 1.0, 1.0, 0.5], top_k=[0, 0, 10, 0], rows=2)
        uniforms = rng.random((4, 2))
        got = target_choice(logits, batch_sampling, uniforms)
        probs = processed_probs(logits, batch_sampling.temperature, batch_sampling.top_k, batch_sampling.top_p)
        np.testing.assert_array_equal(got, sample_tokens(probs, uniforms))

    def test_greedy_batch_never_computes_a_softmax(self, monkeypatch):
        def forbidden(*args, **kwargs):
            raise AssertionError("softmax computed for an all-greedy batch")

        monkeypatch.setattr(probs_module, "processed_probs", forbidden)
        monkeypatch.setattr(probs_module, "_softmax_inplace", forbidden)
        logits = np.random.default_rng(0).standard_normal((3, 4, 20)).astype(np.float32)
        got = target_choice(logits, sampling([0.0, 0.0, 0.0], rows=4), np.full((3, 4), 0.5))
        np.testing.assert_array_equal(got, greedy_tokens(logits))


@pytest.mark.parametrize("count", [1, 2, 5, 9, 40])
def test_top_tokens_best_first(count):
    logits = np.random.default_rng(count).standard_normal((3, 2, 100)).astype(np.float32)
    np.testing.assert_array_equal(top_tokens(logits, count), np.argsort(-logits, axis=-1)[..., :count])


def test_greedy_tokens_of_a_large_batch_split_between_threads_equal_numpys_argmax():
    """Above a million logits the rows are split between two threads: the same ids, ties to
    the lowest, any shape."""
    from specdec.probs import _PARALLEL_ARGMAX_ELEMENTS

    rng = np.random.default_rng(5)
    logits = rng.normal(size=(33, 3, 16384)).astype(np.float32)
    assert logits.size >= _PARALLEL_ARGMAX_ELEMENTS
    logits[7, 1, [10, 900]] = 50.0  # a tie: the lower id wins
    tokens = greedy_tokens(logits)
    assert tokens.dtype == np.int64 and tokens.shape == (33, 3)
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    assert tokens[7, 1] == 10
    np.testing.assert_array_equal(greedy_tokens(logits.reshape(99, 16384)), np.argmax(logits, axis=-1).reshape(99))
