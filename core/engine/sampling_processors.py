"""The sampling controls of :class:`~specdec.SamplingParams` as a row processor: logit bias,
repetition / frequency / presence penalties and min-p (``logits_processing.py`` says why a
processor keeps speculation lossless).

Why min-p is here and not next to top-p in ``BatchSampling``: after temperature ``T`` a token
survives min-p when ``p / p_max >= min_p``, that is when its logit is at least
``max_logit + T * log(min_p)``. That threshold is exact on the raw logits, so the processor
applies min-p without touching the verify strategies, their fused kernels or their reference
twins, and a greedy request (``T`` 0) is left alone (the argmax always survives).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..sampling import SamplingParams
from .logits_processing import RowProcessor


class SamplingControls(RowProcessor):
    """Logit bias, then the penalties, then min-p (vLLM's order), for one request.

    Row ``j`` counts the output tokens plus ``drafts[:j]``: the penalties the target would have
    had at that position. Stateless between steps: the counts come from the tokens shown.
    """

    def __init__(self, sampling: SamplingParams, prompt_ids: np.ndarray):
        self.num_prompt_tokens = len(prompt_ids)
        self.presence = float(sampling.presence_penalty)
        self.frequency = float(sampling.frequency_penalty)
        self.repetition = float(sampling.repetition_penalty)
        bias = sampling.logit_bias
        self.bias_ids = np.array([token for token, _ in bias], dtype=np.int64)
        self.bias_values = np.array([value for _, value in bias], dtype=np.float32)
        #: The min-p cut on raw logits: ``temperature * log(min_p)`` below the row's maximum.
        self.min_p_gap: Optional[float] = (sampling.temperature * math.log(sampling.min_p)
                                           if sampling.min_p > 0 and sampling.temperature > 0 else None)
        self.prompt_unique = (np.unique(np.asarray(prompt_ids, dtype=np.int64)) if self.repetition != 1.0
                              else np.empty(0, dtype=np.int64))

    def process(self, logits: np.ndarray, tokens: np.ndarray, drafts: np.ndarray) -> None:
        if self.bias_ids.size:
            logits[:, self.bias_ids] += self.bias_values
        if self.presence or self.frequency or self.repetition != 1.0:
            self._penalize(logits, np.asarray(tokens[self.num_prompt_tokens:], dtype=np.int64), drafts)
        if self.min_p_gap is not None:
            cut = logits.max(axis=1, keepdims=True) + np.float32(self.min_p_gap)
            logits[logits < cut] = -np.inf

    def _penalize(self, logits: np.ndarray, output: np.ndarray, drafts: np.ndarray) -> None:
        """Penalize, at each row ``j``, the tokens of the prompt (repetition only) and of
        ``output`` + ``drafts[:j]``; only the columns of those tokens are touched."""
        rows = logits.shape[0]
        generated = np.concatenate([output, drafts[: rows - 1]])
        universe, inverse = np.unique(np.concatenate([self.prompt_unique, generated]), return_inverse=True)
        if not universe.size:
            return
        generated_index = inverse[len(self.prompt_unique):]
        counts = np.zeros((rows, universe.size), dtype=np.float32)
        counts[:] = np.bincount(generated_index[: len(output)], minlength=universe.size)
        for j in range(1, rows):  # row j has also seen drafts[:j]
            counts[j:, generated_index[len(output) + j - 1]] += 1
        columns = logits[:, universe]
        if self.repetition != 1.0:
            seen = counts > 0
            seen[:, inverse[: len(self.prompt_unique)]] = True
            scaled = np.where(columns > 0, columns / self.repetition, columns * self.repetition)
            columns = np.where(seen, scaled, columns)
        columns = columns - self.frequency * counts - self.presence * (counts > 0)
        logits[:, universe] = columns.astype(logits.dtype, copy=False)


def sampling_processors(sampling: SamplingParams, prompt_ids: np.ndarray) -> list[RowProcessor]:
    """The processors ``sampling`` needs: none when every control is off (the fast paths)."""
    return [SamplingControls(sampling, prompt_ids)] if sampling.needs_processing else []
