"""Log-probabilities of the generated tokens, for requests that ask (``SamplingParams.logprobs``).

They are the target's own: the log-softmax of its raw logits at the position of each emitted
token, before any row processor (penalties, logit bias, min-p), temperature, top-k or top-p,
as vLLM's default ``--logprobs-mode raw_logprobs`` has it. Each emitted token's row is the
target's distribution after exactly the tokens before it (an accepted draft's row included),
so the values do not depend on the speculative method beyond floating-point rounding.
"""

from __future__ import annotations

import attrs
import numpy as np


@attrs.define(frozen=True, slots=True)
class TokenLogprob:
    """One generated token: its id and log-probability, and the ``top`` most likely tokens at
    its position as ``(id, logprob)`` pairs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(rows) -> np.ndarray:
    """``[R, V]`` logits (numpy, or a paddle tensor) -> float32 log-probabilities, computed in float64."""
    rows = np.asarray(rows if isinstance(rows, np.ndarray) else rows.numpy(), dtype=np.float64)
    shifted = rows - rows.max(axis=-1, keepdims=True)
    return (shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))).astype(np.float32)


def emitted_logprobs(logprob_rows: np.ndarray, tokens: np.ndarray, num_top: int) -> list[TokenLogprob]:
    """The entries of ``tokens``, the i-th emitted at row ``i`` of ``logprob_rows``."""
    entries = []
    for i, token in enumerate(tokens):
        row = logprob_rows[i]
        top = ()
        if num_top:
            best = np.argpartition(-row, num_top - 1)[:num_top]
            best = best[np.argsort(-row[best], kind="stable")]
            top = tuple((int(t), float(row[t])) for t in best)
        entries.append(TokenLogprob(int(token), float(row[int(token)]), top))
    return entries
