"""Validators for attrs ``Config`` classes, the engine's and plugins' alike (part of
:mod:`specdec.sdk`).

Each raises :class:`InvalidValue`, which the config reader turns into a one-line error naming
the key path: ``--speculative-config.max_ngram_size: must be between 1 and 64, got 0``.
"""

from __future__ import annotations

from typing import Any, Callable

from .errors import did_you_mean


class InvalidValue(ValueError):
    """Raised by the validators below; ``problem`` is the message after the key path."""

    def __init__(self, name: str, problem: str):
        super().__init__(f"{name}: {problem}")
        self.name = name
        self.problem = problem


def range_problem(low: int | float, high: int | float | None, value: Any) -> str:
    """``must be >= 1, got 0`` or ``must be between 1 and 8, got 9``."""
    if high is None:
        return f"must be >= {low}, got {value}"
    return f"must be between {low} and {high}, got {value}"


def in_range(low: int | float, high: int | float | None = None) -> Callable:
    """attrs validator: ``low <= value`` (``<= high`` when given); ``None`` passes."""

    def check(_instance, attribute, value):
        if value is not None and (value < low or (high is not None and value > high)):
            raise InvalidValue(attribute.name, range_problem(low, high, value))

    return check


def multiple_of(step: int) -> Callable:
    """attrs validator: the value is a multiple of ``step``; ``None`` passes."""

    def check(_instance, attribute, value):
        if value is not None and value % step:
            raise InvalidValue(attribute.name, f"must be a multiple of {step}, got {value}")

    return check


def above(low: int | float) -> Callable:
    """attrs validator: ``value > low`` (strictly); ``None`` passes."""

    def check(_instance, attribute, value):
        if value is not None and not value > low:
            raise InvalidValue(attribute.name, f"must be > {low}, got {value}")

    return check


def one_of(*choices: str) -> Callable:
    """attrs validator: the value is one of ``choices``; ``None`` passes."""

    def check(_instance, attribute, value):
        if value is not None and value not in choices:
            hint = did_you_mean(value, choices) if isinstance(value, str) else ""
            raise InvalidValue(attribute.name, f"must be one of {', '.join(choices)}, got {value!r}{hint}")

    return check
