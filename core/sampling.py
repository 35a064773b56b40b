"""Sampling parameters of a request."""

from __future__ import annotations

from typing import Optional

import attrs


def _non_negative(instance, attribute, value):
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def _probability(instance, attribute, value):
    if not (0.0 < value <= 1.0):
        raise ValueError(f"{attribute.name} must be in (0, 1], got {value}")


@attrs.define(frozen=True, kw_only=True)
class SamplingParams:
    """How one request samples.

    ``temperature`` 0 means greedy decoding. ``top_k`` 0 and ``top_p`` 1 disable those filters.
    ``seed`` makes sampling reproducible: the same seed gives the same tokens. Generation stops
    at EOS (unless ``ignore_eos``), after ``max_tokens`` tokens, or when the text ends with one
    of ``stop`` (the stop string is not included in the returned text).
    ``num_speculative_tokens`` limits speculation for this request alone: ``None`` keeps the
    engine's setting, 0 turns speculation off, a smaller k caps its drafts (it cannot raise
    the engine's k).
    """

    max_tokens: int = attrs.field(default=128, validator=_non_negative)
    temperature: float = attrs.field(default=0.0, validator=_non_negative)
    top_p: float = attrs.field(default=1.0, validator=_probability)
    top_k: int = attrs.field(default=0, validator=_non_negative)
    seed: Optional[int] = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=lambda s: (s,) if isinstance(s, str) else tuple(s or ()))
    ignore_eos: bool = False
    num_speculative_tokens: Optional[int] = attrs.field(default=None, validator=_non_negative)
