"""Conformance kits of verify strategies and accept policies (re-exported by :mod:`specdec.testing`).

    from specdec.testing import check_accept_policy, check_verify_strategy

    def test_contract():
        check_verify_strategy(MyStrategy)
        check_accept_policy(MyPolicy)

Both run the class on synthetic batches and raise ``AssertionError`` with a one-line message
naming the plugin and the broken rule.
"""

from __future__ import annotations

from typing import Callable, NoReturn, Optional

import numpy as np

from .sdk import (DRAFT_PAD, AcceptPolicy, BatchSampling, Drafts, VerifyInputs, VerifyResult, VerifyStrategy,
                  assemble_output, at_positions, greedy_tokens, pad_beyond_drafts, prefix_match_result,
                  processed_probs, sample_tokens)

#: Vocabulary size of the synthetic logits and drafts.
DEFAULT_VOCAB_SIZE = 512

#: The statistical check of ``LOSSLESS`` strategies: the target's distribution after the context
#: (small, so that a few thousand rows estimate it well), the distribution drafts that carry
#: ``probs`` are sampled from (unlike the target, with mass on tokens top-k/top-p remove), the
#: sampling settings tried (plain, and one that cuts the target to a few tokens), and the rows.
STAT_TARGET = np.array([0.26, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05, 0.04])
STAT_DRAFT_Q = np.array([0.05, 0.30, 0.05, 0.10, 0.05, 0.15, 0.20, 0.10])
STAT_SETTINGS = ((1.0, 0, 1.0), (0.8, 5, 0.9))  # (temperature, top_k, top_p)
STAT_ROWS = 4000
#: Standard normal quantile of the chi-square limit: a correct strategy fails with p < 1e-6.
STAT_Z = 4.75

Fail = Callable[[str], NoReturn]


def _failer(prefix: str) -> Fail:
    def fail(message: str) -> NoReturn:
        raise AssertionError(f"{prefix}: {message}")
    return fail


def build_plugin(cls: type, base: type, config: object = None, spec_config: object = None):
    """``cls(config, spec_config)`` after checking that ``cls`` subclasses ``base`` and has a
    ``NAME``; ``config`` defaults to ``cls.Config()`` when the class declares a ``Config``."""
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise AssertionError(f"{cls!r} is not a subclass of specdec.{base.__name__}")
    if not isinstance(cls.NAME, str) or not cls.NAME:
        raise AssertionError(f"{cls.__qualname__} must set NAME to a non-empty string")
    if config is None and getattr(cls, "Config", None) is not None:
        config = cls.Config()
    return cls(config, spec_config)


# --- synthetic inputs -------------------------------------------------------------------------

def _sampling(temperature, top_k, top_p, rows: int, rng: np.random.Generator) -> BatchSampling:
    return BatchSampling(temperature=np.asarray(temperature, dtype=np.float32),
                         top_p=np.asarray(top_p, dtype=np.float32),
                         top_k=np.asarray(top_k, dtype=np.int64),
                         uniforms=rng.random((len(temperature), rows, 2)))


def _verify_inputs(rng: np.random.Generator, vocab: int, lengths, temperature, top_k, top_p,
                   with_probs: bool = False) -> VerifyInputs:
    """Peaked random logits (each row's favourite token well ahead) and drafts that follow the
    favourites for a random prefix, then drift: strategies accept some drafts and reject others.
    Padding rows and positions hold finite garbage the strategy must ignore."""
    lengths = np.asarray(lengths, dtype=np.int64)
    batch, width = len(lengths), int(lengths.max(initial=0))
    logits = rng.normal(0.0, 1.0, (batch, width + 1, vocab)).astype(np.float32)
    favourite = rng.integers(0, vocab, (batch, width + 1))
    np.put_along_axis(logits, favourite[..., None], 8.0, axis=-1)
    probs = None
    if with_probs:  # drafts sampled from a distribution near the target's
        probs = processed_probs(logits[:, :width] + rng.normal(0.0, 0.5, (batch, width, vocab)),
                                np.ones(batch), np.zeros(batch, dtype=np.int64), np.ones(batch))
        tokens = sample_tokens(probs, rng.random((batch, width)))
    else:
        follows = np.arange(width)[None, :] < rng.integers(0, width + 1, batch)[:, None]
        tokens = np.where(follows, favourite[:, :width], rng.integers(0, vocab, (batch, width)))
    tokens = np.where(np.arange(width)[None, :] < lengths[:, None], tokens, DRAFT_PAD)
    drafts = Drafts(token_ids=tokens.astype(np.int64), lengths=lengths, probs=probs)
    return VerifyInputs(logits=logits, drafts=drafts, sampling=_sampling(temperature, top_k, top_p, width + 1, rng))


def verify_batches(vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> list[tuple[str, VerifyInputs]]:
    """Labelled batches for :func:`check_verify_strategy`: greedy and sampled requests mixed
    (with and without draft ``probs``), all greedy, a batch of width 0 and a single request;
    draft lengths differ within a batch and include 0."""
    rng = np.random.default_rng(seed)
    mixed = dict(lengths=[0, 4, 1, 3, 4, 2, 4, 0],
                 temperature=[0.0, 0.0, 0.7, 1.0, 0.0, 1.3, 0.5, 1.0],
                 top_k=[0, 0, 5, 0, 3, 20, 0, 0],
                 top_p=[1.0, 0.9, 0.9, 1.0, 1.0, 0.8, 0.95, 1.0])
    return [
        ("mixed", _verify_inputs(rng, vocab_size, **mixed)),
        ("mixed drafts-with-probs", _verify_inputs(rng, vocab_size, **mixed, with_probs=True)),
        ("greedy", _verify_inputs(rng, vocab_size, lengths=[3, 0, 1, 3, 2, 3], temperature=[0.0] * 6,
                                  top_k=[0, 5, 0, 2, 0, 0], top_p=[1.0, 1.0, 0.5, 1.0, 1.0, 0.9])),
        ("width-0", _verify_inputs(rng, vocab_size, lengths=[0, 0, 0], temperature=[0.0, 1.0, 0.6],
                                   top_k=[0, 0, 4], top_p=[1.0, 1.0, 0.9])),
        ("single", _verify_inputs(rng, vocab_size, lengths=[5], temperature=[1.0], top_k=[0], top_p=[1.0])),
    ]


# --- shared rules -----------------------------------------------------------------------------

def _snapshot(**arrays) -> dict[str, Optional[np.ndarray]]:
    return {name: None if a is None else np.array(a, copy=True) for name, a in arrays.items()}


def _check_unchanged(before: dict, after: dict, fail: Fail) -> None:
    for name, old in before.items():
        new = after[name]
        if (old is None) != (new is None) or (old is not None and not np.array_equal(old, np.asarray(new))):
            fail(f"modified its input {name}")


def _inputs_arrays(inputs: VerifyInputs) -> dict:
    d, s = inputs.drafts, inputs.sampling
    return dict(logits=inputs.logits, drafts_token_ids=d.token_ids, drafts_lengths=d.lengths, drafts_probs=d.probs,
                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, uniforms=s.uniforms)


def _int_array(value, name: str, shape: tuple, fail: Fail) -> np.ndarray:
    array = np.asarray(value)
    if array.shape != shape or not np.issubdtype(array.dtype, np.integer):
        fail(f"{name} must be an integer array of shape {shape}, got {array.dtype} shape {array.shape}")
    return array


def _first(bad: np.ndarray) -> Optional[int]:
    """The first request flagged in ``bad [B]``, or ``None``."""
    rows = np.flatnonzero(bad)
    return int(rows[0]) if len(rows) else None


def check_result(result: object, drafts: Drafts, vocab_size: int, fail: Fail) -> VerifyResult:
    """Assert the :class:`specdec.VerifyResult` contract of ``result`` for ``drafts``: shapes and
    integer dtypes; ``0 <= accepted_lengths <= drafts.lengths``; the kept drafts, then one
    valid token id, then ``DRAFT_PAD`` in ``output_tokens``; ``target_tokens`` valid ids up to
    each request's drafts and ``DRAFT_PAD`` past them. Returns it with numpy arrays."""
    if not isinstance(result, VerifyResult):
        fail(f"returned {type(result).__name__}, expected specdec.VerifyResult")
    batch, width = drafts.token_ids.shape
    accepted = _int_array(result.accepted_lengths, "accepted_lengths", (batch,), fail)
    output = _int_array(result.output_tokens, "output_tokens", (batch, width + 1), fail)
    target = _int_array(result.target_tokens, "target_tokens", (batch, width + 1), fail)
    lengths = np.asarray(drafts.lengths)
    if (b := _first((accepted < 0) | (accepted > lengths))) is not None:
        fail(f"request {b} accepted {accepted[b]} drafts, it has {lengths[b]}")

    positions = np.arange(width + 1)[None, :]
    next_token = at_positions(output, accepted)
    checks = [
        (np.any((positions[:, :width] < accepted[:, None]) & (output[:, :width] != drafts.token_ids), axis=1),
         "the accepted drafts must equal the drafts"),
        ((next_token < 0) | (next_token >= vocab_size),
         f"the token after the accepted drafts must be a token id in [0, {vocab_size})"),
        (np.any((positions > accepted[:, None]) & (output != DRAFT_PAD), axis=1),
         f"entries after the emitted tokens must be {DRAFT_PAD}"),
    ]
    for bad, rule in checks:
        if (b := _first(bad)) is not None:
            fail(f"request {b} (drafts {drafts.token_ids[b].tolist()}, accepted {accepted[b]}) has output_tokens "
                 f"{output[b].tolist()}: {rule}")
    inside = positions <= lengths[:, None]
    if (b := _first(np.any(inside & ((target < 0) | (target >= vocab_size)), axis=1))) is not None:
        fail(f"request {b} has target_tokens {target[b].tolist()}: rows 0..{lengths[b]} must be token ids "
             f"in [0, {vocab_size})")
    if (b := _first(np.any(~inside & (target != DRAFT_PAD), axis=1))) is not None:
        fail(f"request {b} has target_tokens {target[b].tolist()}: rows past its {lengths[b]} drafts must be "
             f"{DRAFT_PAD}")
    return VerifyResult(accepted_lengths=accepted, output_tokens=output, target_tokens=target)


# --- verify strategies ------------------------------------------------------------------------

def _run_verify(strategy: VerifyStrategy, inputs: VerifyInputs, vocab: int, fail: Fail) -> VerifyResult:
    before = _snapshot(**_inputs_arrays(inputs))
    result = strategy.verify(inputs)
    _check_unchanged(before, _inputs_arrays(inputs), fail)
    return check_result(result, inputs.drafts, vocab, fail)


def _check_greedy_rows(result: VerifyResult, inputs: VerifyInputs, greedy_equivalent: bool, fail: Fail) -> None:
    """Temperature-0 requests: ``target_tokens`` are the argmax (every strategy); with
    ``greedy_equivalent`` the output is prefix matching against it."""
    rows = np.flatnonzero(inputs.sampling.temperature <= 0.0)
    if len(rows) == 0:
        return
    drafts = inputs.drafts.select(rows)
    argmax = pad_beyond_drafts(greedy_tokens(inputs.logits[rows]), drafts.lengths)
    if (i := _first(np.any(result.target_tokens[rows] != argmax, axis=1))) is not None:
        fail(f"temperature-0 request {rows[i]} has target_tokens {result.target_tokens[rows[i]].tolist()}, "
             f"expected the argmax {argmax[i].tolist()}")
    if not greedy_equivalent:
        return
    want = prefix_match_result(drafts, argmax)
    wrong = (result.accepted_lengths[rows] != want.accepted_lengths) | np.any(
        result.output_tokens[rows] != want.output_tokens, axis=1)
    if (i := _first(wrong)) is not None:
        fail(f"temperature-0 request {rows[i]} (drafts {drafts.token_ids[i].tolist()}) emitted "
             f"{result.output_tokens[rows[i]].tolist()}, but prefix matching against the argmax gives "
             f"{want.output_tokens[i].tolist()} (greedy_equivalent)")


def _chi2_limit(df: int) -> float:
    """Chi-square quantile at the normal quantile ``STAT_Z`` (Wilson-Hilferty; slightly high,
    so on the safe side, for one degree of freedom)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + STAT_Z * np.sqrt(c)) ** 3


def _stat_drafts(with_probs: bool, rng: np.random.Generator) -> Drafts:
    """Two drafts per request: uniformly random ids (deterministic: no ``probs``), or samples of
    ``STAT_DRAFT_Q`` that carry it as ``probs``. Either way independent of the verify uniforms."""
    size, lengths = len(STAT_TARGET), np.full(STAT_ROWS, 2, dtype=np.int64)
    if not with_probs:
        return Drafts(token_ids=rng.integers(0, size, (STAT_ROWS, 2)), lengths=lengths)
    q = np.broadcast_to(STAT_DRAFT_Q.astype(np.float32), (STAT_ROWS, 2, size)).copy()
    return Drafts(token_ids=sample_tokens(q, rng.random((STAT_ROWS, 2))), lengths=lengths, probs=q)


def _check_lossless(strategy: VerifyStrategy, rng: np.random.Generator, prefix: str) -> None:
    """The first emitted token of ``STAT_ROWS`` two-draft requests follows the target's processed
    distribution (chi-square), for deterministic drafts and for drafts sampled from ``probs``."""
    size = len(STAT_TARGET)
    logits = np.log(np.broadcast_to(STAT_TARGET, (STAT_ROWS, 3, size))).astype(np.float32)
    logits[:, 1:] = rng.normal(0.0, 1.0, (STAT_ROWS, 2, size))  # the rows after each draft: not tested
    ones = np.ones(STAT_ROWS)
    for temperature, top_k, top_p in STAT_SETTINGS:
        expected = processed_probs(logits[:1, :1], [temperature], [top_k], [top_p])[0, 0].astype(np.float64)
        support = expected > 0
        for with_probs in (False, True):
            mode = "drafts with probs" if with_probs else "deterministic drafts"
            fail = _failer(f"{prefix} (LOSSLESS, temperature {temperature}, top_k {top_k}, top_p {top_p}, {mode})")
            inputs = VerifyInputs(logits=logits, drafts=_stat_drafts(with_probs, rng),
                                  sampling=_sampling(temperature * ones, top_k * ones, top_p * ones, 3, rng))
            result = _run_verify(strategy, inputs, size, fail)
            counts = np.bincount(result.output_tokens[:, 0], minlength=size)
            if counts[~support].any():
                fail(f"emitted tokens {np.flatnonzero(counts * ~support).tolist()} that the target's processed "
                     "distribution excludes")
            want = expected * STAT_ROWS
            chi2 = float(np.sum((counts[support] - want[support]) ** 2 / want[support]))
            limit = _chi2_limit(int(support.sum()) - 1)
            if chi2 > limit:
                fail(f"the first emitted token does not follow the target: chi-square {chi2:.1f} > {limit:.1f} "
                     f"over {STAT_ROWS} rows, counts {counts.tolist()}, expected {np.round(want).astype(int).tolist()}")


def check_verify_strategy(cls: type, config: object = None, spec_config: object = None, *,
                          vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0,
                          greedy_equivalent: Optional[bool] = None, lossless: Optional[bool] = None) -> None:
    """Run verify strategy class ``cls`` on synthetic batches and assert the contract.

    Every batch (greedy and sampled requests mixed, drafts with and without ``probs``, draft
    lengths including 0, a batch of width 0): the result is a :class:`specdec.VerifyResult`
    with ``accepted_lengths [B]`` within ``[0, drafts.lengths]`` and ``output_tokens`` /
    ``target_tokens [B, k+1]`` of integers; the output holds the accepted drafts, one valid
    token id, then ``DRAFT_PAD``; ``target_tokens`` are valid ids up to each request's drafts,
    ``DRAFT_PAD`` past them, and the argmax at temperature 0; the inputs are left unmodified.

    ``greedy_equivalent`` (default ``cls.LOSSLESS``): temperature-0 requests emit exactly what
    prefix matching of the drafts against the argmax gives. ``lossless`` (default
    ``cls.LOSSLESS``): at temperature > 0 (with and without top-k/top-p), the first emitted
    token of a few thousand requests follows the target's processed distribution (chi-square
    test at p = 1e-6, fixed seed), for deterministic drafts and for drafts sampled from ``probs``.

    ``config`` defaults to ``cls.Config()`` when the class declares a ``Config``.
    """
    strategy = build_plugin(cls, VerifyStrategy, config, spec_config)
    greedy_equivalent = cls.LOSSLESS if greedy_equivalent is None else greedy_equivalent
    lossless = cls.LOSSLESS if lossless is None else lossless
    for label, inputs in verify_batches(vocab_size, seed):
        fail = _failer(f"{cls.NAME}.verify on the {label} batch")
        result = _run_verify(strategy, inputs, vocab_size, fail)
        _check_greedy_rows(result, inputs, greedy_equivalent, fail)
    if lossless:
        _check_lossless(strategy, np.random.default_rng(seed), f"{cls.NAME}.verify")


# --- accept policies --------------------------------------------------------------------------

def accept_cases(vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> list[tuple[str, Drafts, VerifyResult]]:
    """Labelled ``(drafts, verify result)`` pairs for :func:`check_accept_policy`, built with the
    sdk builders: prefix matching against targets that follow the drafts for a while, a
    strategy that accepted drafts the targets do not match (as ``topp`` may), a batch of
    width 0 and a single request."""
    rng = np.random.default_rng(seed)

    def targets(drafts: Drafts) -> np.ndarray:
        width = drafts.width
        follows = np.arange(width + 1)[None, :] < rng.integers(0, width + 2, drafts.batch_size)[:, None]
        padded = np.concatenate([drafts.token_ids, np.full((drafts.batch_size, 1), DRAFT_PAD)], axis=1)
        own = rng.integers(0, vocab_size, (drafts.batch_size, width + 1))
        return pad_beyond_drafts(np.where(follows & (padded >= 0), padded, own), drafts.lengths)

    def drafts_of(lengths) -> Drafts:
        return Drafts.from_lists([rng.integers(0, vocab_size, n).tolist() for n in lengths])

    cases = []
    for label, lengths in (("prefix-match", [0, 4, 1, 3, 4, 2]), ("width-0", [0, 0, 0]), ("single", [5])):
        drafts = drafts_of(lengths)
        cases.append((label, drafts, prefix_match_result(drafts, targets(drafts))))
    drafts = drafts_of([4, 0, 2, 3, 4, 1])
    target = targets(drafts)
    accepted = rng.integers(0, drafts.lengths + 1)
    cases.append(("partial-accept", drafts, VerifyResult(
        accepted_lengths=accepted,
        output_tokens=assemble_output(drafts.token_ids, accepted, at_positions(target, accepted)),
        target_tokens=target)))
    return cases


def _apply_arrays(result: VerifyResult, drafts: Drafts) -> dict:
    return dict(accepted_lengths=result.accepted_lengths, output_tokens=result.output_tokens,
                target_tokens=result.target_tokens, drafts_token_ids=drafts.token_ids, drafts_lengths=drafts.lengths)


def check_accept_policy(cls: type, config: object = None, spec_config: object = None, *,
                        vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> None:
    """Run accept policy class ``cls`` on synthetic verify results and assert the contract.

    ``apply(result, drafts)`` returns a :class:`specdec.VerifyResult` of the same shapes with
    integer arrays; ``0 <= accepted_lengths <= drafts.lengths``; the kept drafts are the drafts;
    the token after them is the target's own choice there, ``result.target_tokens[b,
    accepted[b]]``; ``DRAFT_PAD`` after it; ``target_tokens`` passed through unchanged; the
    inputs are left unmodified.

    ``config`` defaults to ``cls.Config()`` when the class declares a ``Config``.
    """
    policy = build_plugin(cls, AcceptPolicy, config, spec_config)
    for label, drafts, result in accept_cases(vocab_size, seed):
        fail = _failer(f"{cls.NAME}.apply on the {label} batch")
        before = _snapshot(**_apply_arrays(result, drafts))
        applied = policy.apply(result, drafts)
        _check_unchanged(before, _apply_arrays(result, drafts), fail)
        applied = check_result(applied, drafts, vocab_size, fail)
        if not np.array_equal(applied.target_tokens, before["target_tokens"]):
            fail("target_tokens must be the verify result's, unchanged")
        accepted = applied.accepted_lengths
        want = at_positions(before["target_tokens"], accepted)
        if (b := _first(at_positions(applied.output_tokens, accepted) != want)) is not None:
            fail(f"request {b} keeps {accepted[b]} drafts and emits {applied.output_tokens[b, accepted[b]]} after "
                 f"them, expected the target's token there, result.target_tokens[{b}, {accepted[b]}] = {want[b]}")
