"""Errors that reach users as one line (exit code 2 on the CLI, HTTP 400 on the server)."""

from __future__ import annotations

import difflib
from typing import Iterable


class SpecdecError(Exception):
    """A user-facing error: its message is one line, printed without a traceback."""


class ConfigError(SpecdecError):
    """Bad configuration: the message names the key path and the problem."""


class PluginError(SpecdecError):
    """A plugin problem: unknown name, duplicate name, or a plugin that failed to load."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or an empty string."""
    matches = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{matches[0]}'?)" if matches else ""


def require_paddle():
    """Import paddle, or raise a one-line error naming the extra that installs it."""
    import os
    import warnings

    # MKL takes a slow code path on AMD processors unless told otherwise; it reads this once,
    # when paddle loads it.
    os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # paddle warns about ccache and such on import
            import paddle  # noqa: F401
    except ImportError as exc:
        if exc.name not in (None, "paddle") and not exc.name.startswith("paddle."):
            # paddle is there, but a module it imports is not (setuptools, in a venv made by uv
            # or Python >= 3.12, before specdec declared it)
            raise SpecdecError(f"paddle failed to import: {exc}") from exc
        raise SpecdecError(
            "paddle is not installed: pip install 'paddle-specdec[cpu]' (or 'paddle-specdec[gpu]' on a CUDA machine)"
        ) from exc
    return paddle


class RequestError(SpecdecError, ValueError):
    """A request the engine refuses (bad sampling values, a prompt that does not fit).

    The message starts with ``param``, the offending field as the OpenAI API names it
    (``top_k: must be ...``); the server answers 400 with ``param`` and ``code`` (``invalid_value``,
    or ``context_length_exceeded``), the CLI prints it with the matching flag.
    """

    def __init__(self, param: str, problem: str, code: str = "invalid_value"):
        super().__init__(f"{param}: {problem}")
        self.param = param
        self.problem = problem
        self.code = code
