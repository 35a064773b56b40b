"""Sampling parameters of a request, and the bounds every request is checked against."""

from __future__ import annotations

import math
from typing import Optional

import attrs

from .errors import RequestError

#: The smallest temperature above 0: below it ``logits / temperature`` overflows float32 into
#: NaN probabilities (1e-40 did), and the result is greedy decoding anyway.
MIN_TEMPERATURE = 1e-3
#: The largest temperature: beyond it sampling is uniform noise.
MAX_TEMPERATURE = 100.0
#: Seeds are unsigned 64-bit integers.
MAX_SEED = 2**64 - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_max_tokens(instance, attribute, value):
    if not _is_int(value) or value < 1:
        raise RequestError("max_tokens", f"must be an integer >= 1, got {value!r}")


def _check_temperature(instance, attribute, value):
    if not _is_real(value) or not math.isfinite(value) or not (
            value == 0 or MIN_TEMPERATURE <= value <= MAX_TEMPERATURE):
        raise RequestError("temperature", f"must be 0 (greedy) or between {MIN_TEMPERATURE:g} and "
                                          f"{MAX_TEMPERATURE:g}, got {value!r}")


def _check_top_p(instance, attribute, value):
    if not _is_real(value) or not (0.0 < value <= 1.0):
        raise RequestError("top_p", f"must be in (0, 1], got {value!r}")


def _check_top_k(instance, attribute, value):
    if not _is_int(value) or value < 0:
        raise RequestError("top_k", f"must be an integer >= 0 (0 or -1: off), got {value!r}")


def _check_seed(instance, attribute, value):
    if value is not None and (not _is_int(value) or not 0 <= value <= MAX_SEED):
        raise RequestError("seed", f"must be an integer between 0 and 2**64 - 1, got {value!r}")


def _check_stop(instance, attribute, value):
    for i, stop in enumerate(value):
        if not isinstance(stop, str):
            raise RequestError("stop", f"expected strings, got {type(stop).__name__} at index {i}")
        if not stop:
            raise RequestError("stop", f"stop strings must not be empty (index {i})")


def _check_num_speculative_tokens(instance, attribute, value):
    if value is not None and (not _is_int(value) or value < 0):
        raise RequestError("num_speculative_tokens", f"must be an integer >= 0, got {value!r}")


#: Bounds of the penalties, as OpenAI and vLLM have them.
MAX_PENALTY = 2.0
#: ``logit_bias`` values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's bound).
MAX_LOGIT_BIAS = 100.0
#: The most ``logprobs`` (top tokens per position) a request may ask for (OpenAI's chat bound).
MAX_LOGPROBS = 20


def _check_penalty(instance, attribute, value):
    if not _is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
        raise RequestError(attribute.name, f"must be a number between {-MAX_PENALTY:g} and {MAX_PENALTY:g}, "
                                           f"got {value!r}")


def _check_repetition_penalty(instance, attribute, value):
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise RequestError("repetition_penalty", f"must be a number > 0 (1: off), got {value!r}")


def _check_min_p(instance, attribute, value):
    if not _is_real(value) or not 0.0 <= value <= 1.0:
        raise RequestError("min_p", f"must be in [0, 1] (0: off), got {value!r}")


def _logit_bias(value):
    """``{token id: bias}`` (keys may be decimal strings, as JSON objects have them), or
    ``(id, bias)`` pairs, as a tuple of ``(id, bias)`` tuples sorted by id; anything else is
    left for the validator to reject."""
    if value is None:
        return ()
    if isinstance(value, dict):
        value = [(int(k) if isinstance(k, str) and k.strip().isdigit() else k, v) for k, v in value.items()]
    if not isinstance(value, (list, tuple)):
        return value
    pairs = tuple(tuple(p) if isinstance(p, (list, tuple)) else p for p in value)
    if all(isinstance(p, tuple) and len(p) == 2 and _is_int(p[0]) for p in pairs):
        return tuple(sorted(pairs))
    return pairs


def _check_logit_bias(instance, attribute, value):
    if not isinstance(value, tuple):
        raise RequestError("logit_bias", f"must map token ids to numbers, got {value!r}")
    for pair in value:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise RequestError("logit_bias", f"must map token ids to numbers, got {pair!r}")
        key, bias = pair
        if not _is_int(key) or key < 0:
            raise RequestError("logit_bias", f"keys must be token ids (integers >= 0), got {key!r}")
        if not _is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise RequestError("logit_bias", f"values must be numbers between {-MAX_LOGIT_BIAS:g} and "
                                             f"{MAX_LOGIT_BIAS:g}, got {bias!r} for token {key}")


def _check_stop_token_ids(instance, attribute, value):
    for i, token in enumerate(value):
        if not _is_int(token) or token < 0:
            raise RequestError("stop_token_ids", f"expected token ids (integers >= 0), got {token!r} at index {i}")


def _check_logprobs(instance, attribute, value):
    if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
        raise RequestError("logprobs", f"must be an integer between 0 and {MAX_LOGPROBS}, got {value!r}")
def _check_prediction(instance, attribute, value):
    if not all(_is_int(t) and t >= 0 for t in value):
        raise RequestError("prediction", "expected a sequence of token ids (integers >= 0)")


def _top_k(value):
    return 0 if value == -1 else value  # -1 is "off", as vLLM and the OpenAI-style servers have it


def _stop(value):
    return (value,) if isinstance(value, str) else tuple(value or ())


@attrs.define(frozen=True, kw_only=True)
class SamplingParams:
    """How one request samples. Every value is checked when the object is built (a
    :class:`~specdec.errors.RequestError` naming the field), and again against the engine
    (``top_k`` within the vocabulary, stop-string limits, the context) when it is submitted.

    ``temperature`` 0 means greedy decoding; otherwise it lies in
    [``MIN_TEMPERATURE``, ``MAX_TEMPERATURE``]. ``top_k`` 0 (or -1) and ``top_p`` 1 disable
    those filters. ``seed`` (0 to 2**64 - 1) makes sampling reproducible: the same seed gives
    the same tokens. Generation stops at EOS (unless ``ignore_eos``), after ``max_tokens``
    tokens (at least 1), or when the text ends with one of ``stop`` (non-empty strings; the
    stop string is not included in the returned text). ``num_speculative_tokens`` limits
    speculation for this request alone: ``None`` keeps the engine's setting, 0 turns
    speculation off, a smaller k caps its drafts (it cannot raise the engine's k).

    The logits controls, applied to the target's logits at every verified position (so
    speculation stays lossless with them on; ``specdec.engine.sampling_processors``), in vLLM's
    order: ``logit_bias`` (``{token id: bias}``, bias in [-100, 100], added to the logit), then
    ``repetition_penalty`` (> 0, 1 off: a logit of a token in the prompt or the output is
    divided by it when positive, multiplied when not), ``frequency_penalty`` and
    ``presence_penalty`` (in [-2, 2], 0 off: subtracted once per occurrence of the token in the
    output, and once if it occurs at all), then temperature, then ``min_p`` (in [0, 1], 0 off:
    tokens less likely than ``min_p`` times the most likely one are dropped), then top-k and
    top-p. ``stop_token_ids`` end generation like EOS (the token is kept in the output, even
    with ``ignore_eos``). ``logprobs`` (0 to 20, None off) returns the log-probability of each
    generated token and of the ``logprobs`` most likely ones at its position, from the
    target's raw logits (before the controls and temperature).
    ``prediction``: token ids of the output the caller expects (OpenAI's Predicted Outputs),
    drafted from for this request alone (``specdec.engine.prediction``); the output stays
    what it is without it.
    """

    max_tokens: int = attrs.field(default=128, validator=_check_max_tokens)
    temperature: float = attrs.field(default=0.0, validator=_check_temperature)
    top_p: float = attrs.field(default=1.0, validator=_check_top_p)
    top_k: int = attrs.field(default=0, converter=_top_k, validator=_check_top_k)
    seed: Optional[int] = attrs.field(default=None, validator=_check_seed)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop, validator=_check_stop)
    ignore_eos: bool = False
    num_speculative_tokens: Optional[int] = attrs.field(default=None, validator=_check_num_speculative_tokens)
    presence_penalty: float = attrs.field(default=0.0, validator=_check_penalty)
    frequency_penalty: float = attrs.field(default=0.0, validator=_check_penalty)
    repetition_penalty: float = attrs.field(default=1.0, validator=_check_repetition_penalty)
    min_p: float = attrs.field(default=0.0, validator=_check_min_p)
    logit_bias: tuple = attrs.field(default=(), converter=_logit_bias, validator=_check_logit_bias)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=lambda v: tuple(v or ()),
                                                  validator=_check_stop_token_ids)
    logprobs: Optional[int] = attrs.field(default=None, validator=_check_logprobs)

    @property
    def reproducible(self) -> bool:
        """Whether the request samples with its own ``seed``: its tokens must then depend on
        the seed alone. At temperature > 0 which drafts are verified decides which random
        numbers it draws, so its drafts may depend only on its own tokens: never on timing,
        on the requests that share its batch, or on requests before it."""
        return self.seed is not None and self.temperature > 0

    @property
    def needs_processing(self) -> bool:
        """Whether any of the logits controls (penalties, bias, min-p) is on."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or (self.min_p and self.temperature > 0))
    prediction: tuple[int, ...] = attrs.field(default=(), converter=tuple, validator=_check_prediction, repr=False)
