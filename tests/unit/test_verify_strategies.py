"""The four built-in verify strategies on hand-made logits and drafts, with exact expectations.

Conventions of the hand cases: ``P`` below is the target distribution of every row, and
``UNIFORM_TOKENS`` maps a sampling uniform to the token it draws from ``P`` at temperature 1.
"""

from __future__ import annotations

import importlib

import attrs
import numpy as np
import pluggy
import pytest

from specdec import BatchSampling, Drafts, VerifyInputs, hookspecs
from specdec import probs as probs_module
from specdec.plugins.verify.greedy import GreedyVerify
from specdec.plugins.verify.rejection import RejectionVerify
from specdec.plugins.verify.target_match import TargetMatchVerify
from specdec.plugins.verify.topp import ToppVerify

PAD = -1
#: cdf 0.1, 0.3, 0.6, 1.0: u in [0, .1) -> 0, [.1, .3) -> 1, [.3, .6) -> 2, [.6, 1) -> 3.
P = np.array([0.1, 0.2, 0.3, 0.4])


def make_inputs(logits, drafts, temperature=0.0, top_p=1.0, top_k=0, uniforms=None, draft_probs=None):
    """Verify inputs from ``[B, k+1, V]`` logits and one draft list per request.

    ``temperature``, ``top_p`` and ``top_k`` are one value for all or one per request;
    ``uniforms`` defaults to zeros ``[B, k+1, 2]``.
    """
    logits = np.asarray(logits, dtype=np.float32)
    batch, rows, _ = logits.shape
    token_ids = np.full((batch, rows - 1), PAD, dtype=np.int64)
    for b, draft in enumerate(drafts):
        token_ids[b, : len(draft)] = draft
    lengths = np.array([len(d) for d in drafts], dtype=np.int64)
    per_request = lambda value, dtype: np.broadcast_to(np.asarray(value, dtype=dtype), (batch,)).copy()
    sampling = BatchSampling(
        temperature=per_request(temperature, np.float32),
        top_p=per_request(top_p, np.float32),
        top_k=per_request(top_k, np.int64),
        uniforms=np.zeros((batch, rows, 2)) if uniforms is None else np.asarray(uniforms, dtype=np.float64),
    )
    return VerifyInputs(logits=logits, drafts=Drafts(token_ids, lengths, draft_probs), sampling=sampling)


def peaked(tokens, vocab=8):
    """Rows of logits whose argmax is each of ``tokens`` (``None``: a padding row of NaN)."""
    rows = []
    for token in tokens:
        if token is None:
            rows.append(np.full(vocab, np.nan))
        else:
            row = -0.01 * np.arange(vocab)
            row[token] = 5.0
            rows.append(row)
    return rows


def uniforms_for(sample_u, accept_u=None):
    """``[B, R, 2]`` uniforms from per-row sampling (and optional accept) uniforms."""
    sample_u = np.asarray(sample_u, dtype=np.float64)
    accept_u = np.zeros_like(sample_u) if accept_u is None else np.asarray(accept_u, dtype=np.float64)
    return np.stack([accept_u, sample_u], axis=-1)


def assert_result(result, accepted, output, target=None):
    np.testing.assert_array_equal(result.accepted_lengths, accepted)
    np.testing.assert_array_equal(result.output_tokens, output)
    if target is not None:
        np.testing.assert_array_equal(result.target_tokens, target)
    assert result.accepted_lengths.dtype == np.int64 and result.output_tokens.dtype == np.int64


ALL_STRATEGIES = [GreedyVerify, TargetMatchVerify, ToppVerify, RejectionVerify]


def greedy_batch():
    """Mixed lengths, a zero-length draft and NaN padding rows."""
    logits = [peaked([2, 3, 4, 5]), peaked([6, None, None, None]), peaked([1, 1, 7, None])]
    return make_inputs(logits, [[2, 3, 1], [], [1, 1]])


GREEDY_EXPECTED = dict(
    accepted=[2, 0, 2],
    output=[[2, 3, 4, PAD], [6, PAD, PAD, PAD], [1, 1, 7, PAD]],
    target=[[2, 3, 4, 5], [6, PAD, PAD, PAD], [1, 1, 7, PAD]],
)


class TestGreedy:
    def test_hand_case(self):
        assert_result(GreedyVerify().verify(greedy_batch()), **GREEDY_EXPECTED)

    def test_ignores_temperature_and_uniforms(self):
        inputs = greedy_batch()
        inputs.sampling.temperature[:] = 1.3
        inputs.sampling.top_p[:] = 0.5
        inputs.sampling.uniforms = np.random.default_rng(0).random(inputs.sampling.uniforms.shape)
        assert_result(GreedyVerify().verify(inputs), **GREEDY_EXPECTED)


@pytest.mark.parametrize("strategy", [RejectionVerify, TargetMatchVerify, ToppVerify])
def test_greedy_requests_follow_greedy_hand_case(strategy):
    """At temperature 0 the candidate set of topp is the argmax alone: no draft here is a top-2."""
    assert_result(strategy().verify(greedy_batch()), **GREEDY_EXPECTED)


@pytest.mark.parametrize("strategy", [RejectionVerify, TargetMatchVerify])
def test_temperature_zero_equals_greedy(strategy):
    rng = np.random.default_rng(7)
    batch, width, vocab = 64, 4, 50
    logits = rng.standard_normal((batch, width + 1, vocab)).astype(np.float32)
    argmax = logits.argmax(-1)
    lengths = rng.integers(0, width + 1, size=batch)
    # Drafts that follow the argmax for a random while, then guess.
    follow = rng.integers(0, width + 1, size=batch)
    drafts = [
        [int(argmax[b, j]) if j < follow[b] else int(rng.integers(vocab)) for j in range(lengths[b])]
        for b in range(batch)
    ]
    uniforms = rng.random((batch, width + 1, 2))
    probs = rng.dirichlet(np.ones(vocab), size=(batch, width)).astype(np.float32)
    for draft_probs in (None, probs):
        inputs = make_inputs(logits, drafts, temperature=0.0, top_p=0.7, top_k=5, uniforms=uniforms, draft_probs=draft_probs)
        expected = GreedyVerify().verify(inputs)
        got = strategy().verify(inputs)
        assert_result(got, expected.accepted_lengths, expected.output_tokens, expected.target_tokens)
    assert 0 < expected.accepted_lengths.sum() < lengths.sum()


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_no_drafts_at_all(strategy):
    logits = [peaked([4]), peaked([1])]
    result = strategy().verify(make_inputs(logits, [[], []]))
    assert_result(result, [0, 0], [[4], [1]], [[4], [1]])


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_logits_must_have_one_row_more_than_drafts(strategy):
    inputs = make_inputs([peaked([1, 2, 3])], [[1, 2]])
    inputs.logits = inputs.logits[:, :2]
    with pytest.raises(ValueError, match="expected \\(1, 3, vocab\\)"):
        strategy().verify(inputs)


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_all_greedy_batch_never_computes_a_softmax(strategy, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("softmax computed for an all-greedy batch")

    monkeypatch.setattr(probs_module, "processed_probs", forbidden)
    monkeypatch.setattr(probs_module, "_softmax_inplace", forbidden)
    inputs = greedy_batch()
    inputs.drafts.probs = np.full((3, 3, 8), 1 / 8, dtype=np.float32)
    assert_result(strategy().verify(inputs), **GREEDY_EXPECTED)


class TestTargetMatch:
    def batch(self, uniforms=None):
        logits = np.log(np.broadcast_to(P, (4, 4, 4)))
        drafts = [[1, 2, 0], [3, 1], [], [2, 2, 2]]
        if uniforms is None:
            uniforms = uniforms_for([[0.2, 0.5, 0.95, 0.05], [0.9, 0.9, 0.9, 0.9], [0.5] * 4, [0.2, 0.2, 0.5, 0.9]])
        return make_inputs(
            logits, drafts, temperature=[1.0, 0.0, 1.0, 1.0], top_k=[0, 0, 2, 0], top_p=[1.0, 1.0, 1.0, 0.5], uniforms=uniforms
        )

    def test_hand_case(self):
        # 0: samples 1, 2, 3, 0 -> keeps [1, 2], emits 3.
        # 1: greedy, argmax 3 everywhere -> keeps [3], emits 3.
        # 2: top_k 2 leaves {2: 3/7, 3: 4/7}; u .5 -> 3.
        # 3: top_p .5 leaves {3: 4/7, 2: 3/7}; u .2 -> 2, .5 -> 3.
        assert_result(
            TargetMatchVerify().verify(self.batch()),
            accepted=[2, 1, 0, 2],
            output=[[1, 2, 3, PAD], [3, 3, PAD, PAD], [3, PAD, PAD, PAD], [2, 2, 3, PAD]],
            target=[[1, 2, 3, 0], [3, 3, 3, PAD], [3, PAD, PAD, PAD], [2, 2, 3, 3]],
        )

    def test_accept_uniforms_play_no_part(self):
        inputs = self.batch()
        expected = TargetMatchVerify().verify(inputs)
        inputs.sampling.uniforms[..., 0] = 0.999
        got = TargetMatchVerify().verify(inputs)
        np.testing.assert_array_equal(got.output_tokens, expected.output_tokens)

    def test_reproducible_under_a_seed(self):
        rng = np.random.default_rng(3)
        logits = rng.standard_normal((128, 4, 6)).astype(np.float32)
        drafts = [list(rng.integers(0, 6, size=3)) for _ in range(128)]

        def run(seed):
            uniforms = np.random.default_rng(seed).random((128, 4, 2))
            return TargetMatchVerify().verify(make_inputs(logits, drafts, temperature=1.0, uniforms=uniforms))

        first, again, other = run(11), run(11), run(12)
        np.testing.assert_array_equal(first.output_tokens, again.output_tokens)
        np.testing.assert_array_equal(first.target_tokens, again.target_tokens)
        assert not np.array_equal(first.target_tokens, other.target_tokens)


#: topp hand cases: every row ranks 5 (.5), 2 (.2), 7 (.15), 0 (.1), then 1, 3, 4, 6 (.0125 each).
TOPP_P = np.full(8, 0.0125)
TOPP_P[[5, 2, 7, 0]] = [0.5, 0.2, 0.15, 0.1]
#: Request name -> (temperature, top_p, drafts). With top_p .8 the nucleus is {5, 2, 7}; with
#: top_p .3 and at temperature 0 it is {5}. The second most likely token is 2 everywhere.
TOPP_REQUESTS = {
    "nucleus": (1.0, 0.8, [2, 7, 0]),
    "window_then_top1": (0.0, 1.0, [2, 5, 5, 5, 1]),
    "window_then_stop": (0.0, 1.0, [2, 5, 5, 1, 1]),
    "window_past_drafts": (0.0, 1.0, [2, 5]),
    "third_token": (0.0, 1.0, [7, 5, 5]),
    "no_drafts": (0.0, 1.0, []),
    "small_nucleus": (1.0, 0.3, [2, 5, 5, 0]),
}


def topp_batch():
    batch = len(TOPP_REQUESTS)
    logits = np.log(np.broadcast_to(TOPP_P, (batch, 6, 8)))
    temperature, top_p, drafts = zip(*TOPP_REQUESTS.values())
    # Sampling uniform .5: with the nucleus {5, 2, 7} (ids in order 2: .235, 5: .588, 7: .176)
    # it draws 5; with {5} it is 5 anyway.
    uniforms = uniforms_for(np.full((batch, 6), 0.5))
    return make_inputs(logits, list(drafts), temperature=temperature, top_p=top_p, uniforms=uniforms)


def topp_accepted(**config):
    result = ToppVerify(ToppVerify.Config(**config)).verify(topp_batch())
    return dict(zip(TOPP_REQUESTS, result.accepted_lengths.tolist())), result


class TestTopp:
    def test_defaults(self):
        config = ToppVerify().config
        assert (config.max_candidate_len, config.verify_window) == (5, 2)

    @pytest.mark.parametrize("field", ["max_candidate_len", "verify_window"])
    @pytest.mark.parametrize("value", [0, -1, 2.5])
    def test_config_rejects_bad_values(self, field, value):
        with pytest.raises((ValueError, TypeError)):
            ToppVerify.Config(**{field: value})

    def test_config_fields_are_the_flat_keys(self):
        assert [f.name for f in attrs.fields(ToppVerify.Config)] == ["max_candidate_len", "verify_window"]

    def test_hand_cases_with_defaults(self):
        accepted, result = topp_accepted()
        assert accepted == {
            "nucleus": 2,  # 2 and 7 in the nucleus; 0 is neither in it nor the top-2
            "window_then_top1": 4,  # top-2 + two top-1 drafts, then 5 is the top-1, then 1 stops
            "window_then_stop": 3,  # top-2 + two top-1 drafts, then 1 stops
            "window_past_drafts": 0,  # the window needs two drafts after the top-2; there is one
            "third_token": 0,  # 7 is outside {5} and not the top-2
            "no_drafts": 0,
            "small_nucleus": 3,  # 2 is outside {5} but top-2 with a full window; 0 stops
        }
        np.testing.assert_array_equal(
            result.output_tokens,
            [
                [2, 7, 5, PAD, PAD, PAD],
                [2, 5, 5, 5, 5, PAD],
                [2, 5, 5, 5, PAD, PAD],
                [5, PAD, PAD, PAD, PAD, PAD],
                [5, PAD, PAD, PAD, PAD, PAD],
                [5, PAD, PAD, PAD, PAD, PAD],
                [2, 5, 5, 5, PAD, PAD],
            ],
        )

    def test_longer_window(self):
        accepted, _ = topp_accepted(verify_window=3)
        assert accepted["window_then_top1"] == 4  # 5, 5, 5 after the top-2: still a full window
        assert accepted["window_then_stop"] == 0  # 5, 5, 1 after the top-2
        assert accepted["small_nucleus"] == 0  # 5, 5, 0 after the top-2
        assert accepted["nucleus"] == 2

    def test_window_of_one(self):
        accepted, _ = topp_accepted(verify_window=1)
        assert accepted["window_past_drafts"] == 2  # top-2 then one top-1 draft

    def test_max_candidate_len_caps_the_nucleus(self):
        assert topp_accepted(max_candidate_len=3)[0]["nucleus"] == 2
        assert topp_accepted(max_candidate_len=2)[0]["nucleus"] == 1  # 7 is the third candidate

    def test_one_candidate_turns_the_window_off(self):
        accepted, _ = topp_accepted(max_candidate_len=1)
        assert accepted == dict.fromkeys(TOPP_REQUESTS, 0)

    def test_emitted_token_is_a_top_p_sample(self):
        # Same nucleus {5, 2, 7}; the sampling uniform at the stop row picks the token.
        inputs = make_inputs(np.log(np.broadcast_to(TOPP_P, (3, 2, 8))), [[0]] * 3, temperature=1.0, top_p=0.8,
                             uniforms=uniforms_for([[0.1, 0], [0.5, 0], [0.9, 0]]))
        result = ToppVerify().verify(inputs)
        np.testing.assert_array_equal(result.output_tokens, [[2, PAD], [5, PAD], [7, PAD]])

    def test_not_lossless(self):
        assert ToppVerify.LOSSLESS is False


class TestRejection:
    def test_deterministic_drafts_hand_case(self):
        logits = np.log(np.broadcast_to(P, (4, 4, 4)))
        drafts = [[3, 3, 3], [0], [3, 0, 1], []]
        uniforms = uniforms_for(
            sample_u=[[0.05, 0.2, 0.4, 0.95], [0.5, 0.95, 0, 0], [0.5] * 4, [0.7, 0, 0, 0]],
            accept_u=[[0.39, 0.39, 0.41, 0], [0.05, 0, 0, 0], [0.99] * 4, [0] * 4],
        )
        result = RejectionVerify().verify(make_inputs(logits, drafts, temperature=[1.0, 1.0, 0.0, 1.0], uniforms=uniforms))
        # 0: p(3) = .4 accepts u .39 twice, rejects .41; residual {0: 1/6, 1: 1/3, 2: 1/2}, u .4 -> 1
        #    (the plain sample with u .4 would be 2).
        # 1: p(0) = .1 accepts u .05; the bonus from p with u .95 is 3.
        # 2: greedy: 3 is the argmax, 0 is not; emits 3.
        # 3: no drafts: a sample from p with u .7 -> 3.
        assert_result(
            result,
            accepted=[2, 1, 1, 0],
            output=[[3, 3, 1, PAD], [0, 3, PAD, PAD], [3, 3, PAD, PAD], [3, PAD, PAD, PAD]],
            target=[[0, 1, 2, 3], [2, 3, PAD, PAD], [3, 3, 3, 3], [3, PAD, PAD, PAD]],
        )

    def test_draft_probs_hand_case(self):
        logits = np.log(np.broadcast_to(P, (3, 3, 4)))
        q = np.full((3, 2, 4), 0.25, dtype=np.float32)
        drafts = [[0, 3], [0], [0]]
        uniforms = uniforms_for(
            sample_u=[[0, 0, 0.05], [0.2, 0, 0], [0.3, 0, 0]],
            accept_u=[[0.3, 0.99, 0], [0.5, 0, 0], [0.5, 0, 0]],
        )
        result = RejectionVerify().verify(make_inputs(logits, drafts, temperature=1.0, uniforms=uniforms, draft_probs=q))
        # 0: p/q = .4 for 0 accepts u .3; 1.6 for 3 always accepts; bonus u .05 -> 0.
        # 1, 2: u .5 rejects 0; residual max(0, p - q) = {2: .05, 3: .15}: u .2 -> 2, u .3 -> 3.
        assert_result(result, accepted=[2, 0, 0], output=[[0, 3, 0], [2, PAD, PAD], [3, PAD, PAD]])

    def test_draft_outside_the_nucleus_is_always_rejected(self):
        logits = np.log(np.broadcast_to(P, (1, 2, 4)))
        inputs = make_inputs(logits, [[0]], temperature=1.0, top_k=2, uniforms=uniforms_for([[0.0, 0.0]]))
        result = RejectionVerify().verify(inputs)
        assert result.accepted_lengths[0] == 0 and result.output_tokens[0, 0] == 2

    def test_lossless_flags(self):
        assert TargetMatchVerify.LOSSLESS and RejectionVerify.LOSSLESS
        assert not GreedyVerify.LOSSLESS  # greedy decoding at every temperature: not sampling


@pytest.mark.parametrize(
    "module, cls",
    [
        ("specdec.plugins.verify.greedy", GreedyVerify),
        ("specdec.plugins.verify.topp", ToppVerify),
        ("specdec.plugins.verify.target_match", TargetMatchVerify),
        ("specdec.plugins.verify.rejection", RejectionVerify),
    ],
)
def test_each_module_registers_its_strategy(module, cls):
    manager = pluggy.PluginManager("specdec")
    manager.add_hookspecs(hookspecs)
    manager.register(importlib.import_module(module))
    registered = []
    manager.hook.specdec_register_verify_strategies(register=registered.append)
    assert registered == [cls]
    assert {GreedyVerify.NAME, ToppVerify.NAME, TargetMatchVerify.NAME, RejectionVerify.NAME} == {
        "greedy", "topp", "target_match", "rejection"
    }


@pytest.mark.parametrize("strategy", [GreedyVerify, RejectionVerify, TargetMatchVerify, ToppVerify])
def test_inputs_given_as_picked_rows_verify_as_the_padded_array(strategy):
    """The engine may pass a step's unpadded rows and an index instead of ``[B, k+1, V]``
    logits: every strategy returns the same result, and ``argmax`` never builds the array."""
    rng = np.random.default_rng(3)
    rows = rng.normal(size=(9, 12)).astype(np.float32)  # request 0: 3 drafts, 1: none, 2: 4 drafts
    index = np.array([[0, 1, 2, 3, 3], [4, 4, 4, 4, 4], [5, 6, 7, 8, 8]])
    drafts = [[int(rows[0].argmax()), 5, 7], [], [int(rows[5].argmax()), int(rows[6].argmax()), 1, 2]]
    for temperature in (0.0, [0.0, 0.7, 0.0]):
        uniforms = rng.random((3, 5, 2))
        padded = make_inputs(rows[index], drafts, temperature=temperature, uniforms=uniforms)
        picked = VerifyInputs(None, padded.drafts, padded.sampling, rows=rows, row_index=index)
        assert picked.logits_shape == (3, 5, 12)
        expected, got = strategy().verify(padded), strategy().verify(picked)
        for field in ("accepted_lengths", "output_tokens", "target_tokens"):
            np.testing.assert_array_equal(getattr(got, field), getattr(expected, field))
    lazy = VerifyInputs(None, padded.drafts, padded.sampling, rows=rows, row_index=index)
    np.testing.assert_array_equal(lazy.argmax(), rows[index].argmax(axis=-1))
    assert lazy._logits is None  # the argmax alone built no padded array
