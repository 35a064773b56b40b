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
    prediction: tuple[int, ...] = attrs.field(default=(), converter=tuple, validator=_check_prediction, repr=False)
