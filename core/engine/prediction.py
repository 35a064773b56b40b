"""Predicted Outputs: a request's expected output text as a draft source for that request alone.

A client that knows most of the answer already (an edit of code it sends along, a document
re-emitted with small changes) passes it as OpenAI's ``prediction``; the server tokenizes it
once and keeps it in :attr:`SamplingParams.prediction`. Every step, :class:`Predictions` finds
where the request's output stands in the prediction and drafts the prediction's next tokens
from there; the target verifies them like any draft, so the output is the one the request
gets without a prediction (lossless), only sooner where the prediction is right.

Re-alignment works like a diff re-syncing: the longest suffix of the generated tokens (up to
:data:`MAX_MATCH` tokens) that occurs in the prediction at or after the last confidently
aligned position marks where the output stands; the draft is what follows it. After the
model inserts text the prediction lacks, no suffix matches until the output returns to the
predicted text, and drafting resumes there; after a deletion the match is found further on.
Matching is on tokens: the prediction is tokenized alone, so around an edit it may split
differently from what the model emits, and the match resumes a few tokens later, once the
output's last tokens are common again (the tokenizer splits text at spaces and punctuation,
so identical code lines tokenize identically).

It composes with the server's method: a request that has a prediction-based draft uses it
(it may be longer than the method's k, up to :data:`PREDICTION_DRAFT_TOKENS`, which the
scheduler still caps by the step's rows and KV blocks), unless it comes from a short match
(under :data:`CONFIDENT_MATCH` tokens) and the method has a draft of its own. Prediction drafts carry their own draft classes
(:data:`CLASS_BASE` plus the match length), so the adaptive draft length learns their
acceptance apart from the method's (by the length of the match: :func:`match_class`). Per request, the drafted prediction tokens that were
accepted and rejected are counted into :class:`~specdec.metrics.SpecMetrics` (the server's
``usage.completion_tokens_details``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import RequestError
from ..proposer import DRAFT_PAD, Drafts

#: The most drafts a prediction gives one request in one step, the config's cap: predictions
#: are accepted far more often than guesses, so longer drafts pay (the adaptive draft length
#: still cuts the ones that do not, per draft class). At 16, Qwen2.5-Coder-1.5B copying a
#: function verified all 16 in 91 of its 237 steps; at 32 its decode took 3% less time, the
#: default model's no different (docs/choosing-a-method.md#code-edits-with-a-prediction).
PREDICTION_DRAFT_TOKENS = 32
#: The longest suffix of the output matched against the prediction.
MAX_MATCH = 16
#: A match at least this long moves the alignment point: shorter ones are too often chance
#: (a ``)`` or a newline occurs everywhere in code) to give up the position found before.
CONFIDENT_MATCH = 3
#: Draft classes of prediction drafts: ``CLASS_BASE + match_class(match length)``, far from
#: the methods' small labels.
CLASS_BASE = 1 << 20


def match_class(length: int) -> int:
    """The draft class of a match of ``length`` tokens: 0 at the output's start (drafted from
    the prediction's start), 1 and 2 for chance-prone short matches, 3 for 3-7 tokens, 4 for 8
    and more (in sync). Few classes, so that the adaptive draft length learns each quickly."""
    return length if length < 3 else (3 if length < 8 else 4)


def _weak(length: int) -> bool:
    """Whether a match of ``length`` tokens is too short to trust over the method's draft."""
    return 0 < length < CONFIDENT_MATCH


def check_prediction(prediction: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """A :class:`RequestError` naming ``prediction`` for ids outside the vocabulary, or a
    prediction longer than the context (it could never all be output)."""
    if len(prediction) > max_model_len:
        raise RequestError("prediction", f"{len(prediction)} tokens are more than the context holds "
                                         f"({max_model_len})", code="context_length_exceeded")
    if len(prediction) and (min(prediction) < 0 or max(prediction) >= vocab_size):
        raise RequestError("prediction", f"token ids must be between 0 and {vocab_size - 1}")


class _Alignment:
    """One request's prediction, and the position the output was last confidently aligned at."""

    __slots__ = ("tokens", "low")

    def __init__(self, tokens: Sequence[int]):
        self.tokens = np.asarray(tokens, dtype=np.int64)
        #: Matches are searched at or after this index of ``tokens`` (where the last confident
        #: match ended): the output does not go back in the prediction.
        self.low = 0

    def draft(self, generated: np.ndarray, max_len: int) -> tuple[np.ndarray, int]:
        """The prediction's tokens after the output's position (at most ``max_len``), and the
        length of the match that placed it (0 at the output's start; no draft: empty)."""
        tokens = self.tokens
        if not len(generated):
            return tokens[:max_len], 0
        end, length = self._match(generated, self.low)
        if end < 0 and self.low:  # lost: the output went back, or a chance match moved ``low``
            end, length = self._match(generated, 0)
            if length < CONFIDENT_MATCH:
                end = -1
        if end < 0:
            return tokens[:0], 0
        if length >= CONFIDENT_MATCH:
            self.low = end + 1 - length
        return tokens[end + 1: end + 1 + max_len], length

    def _match(self, generated: np.ndarray, low: int) -> tuple[int, int]:
        """``(end, length)``: the longest suffix of ``generated`` that occurs in the prediction
        at or after ``low`` ends at index ``end`` (the earliest such place); ``(-1, 0)`` if the
        last token occurs nowhere there."""
        tokens = self.tokens
        ends = np.flatnonzero(tokens[low:] == generated[-1]) + low
        if not len(ends):
            return -1, 0
        length = 1
        for j in range(2, min(MAX_MATCH, len(generated)) + 1):
            alive = ends[ends - (j - 1) >= low]
            alive = alive[tokens[alive - (j - 1)] == generated[-j]]
            if not len(alive):
                break
            ends, length = alive, j
        return int(ends[0]), length


class Predictions:
    """The engine's prediction drafts: per request, its alignment and which drafts came from it."""

    def __init__(self):
        self._alignments: dict[str, _Alignment] = {}
        #: Request ids whose draft of the current step came from the prediction.
        self._drafted: set[str] = set()

    @staticmethod
    def max_draft_len(request, method_k: int) -> int:
        """The most drafts ``request`` may verify in a step: the method's ``k``, or for a
        request with a prediction :data:`PREDICTION_DRAFT_TOKENS` if that is more. The request's
        own ``num_speculative_tokens`` (0: no speculation) caps both."""
        k = max(method_k, PREDICTION_DRAFT_TOKENS) if request.sampling.prediction else method_k
        if request.sampling.num_speculative_tokens is not None:
            k = min(k, request.sampling.num_speculative_tokens)
        return k

    def drafts(self, requests: list, rooms: np.ndarray) -> dict[int, tuple[np.ndarray, int]]:
        """This step's prediction drafts: ``{b: (tokens, match length)}`` for each request of
        ``requests`` that has one (at most ``rooms[b]`` tokens: what the scheduler left it).
        Called once a step (it moves the alignments); :meth:`compose` takes the result."""
        predicted: dict[int, tuple[np.ndarray, int]] = {}
        for b, request in enumerate(requests):
            self._drafted.discard(request.request_id)
            prediction = request.sampling.prediction
            if not prediction or rooms[b] <= 0:
                continue
            alignment = self._alignments.get(request.request_id)
            if alignment is None:
                alignment = self._alignments[request.request_id] = _Alignment(prediction)
            tokens, length = alignment.draft(request.generated_ids, int(rooms[b]))
            if len(tokens):
                predicted[b] = (tokens, length)
        return predicted

    @staticmethod
    def leading(predicted: dict[int, tuple[np.ndarray, int]], method_lengths: np.ndarray) -> np.ndarray:
        """``[B]`` bool: the requests whose prediction draft :meth:`compose` takes whatever the
        method drafts (a confident match, or the output's start, at least as long as the
        method's draft can be: ``method_lengths[b]``). The method's proposer need not run for
        them this step."""
        led = np.zeros(len(method_lengths), dtype=bool)
        for b, (tokens, length) in predicted.items():
            led[b] = not _weak(length) and len(tokens) >= method_lengths[b]
        return led

    def compose(self, requests: list, drafts: Drafts, method_caps: np.ndarray,
                predicted: dict[int, tuple[np.ndarray, int]]) -> tuple[Drafts, np.ndarray]:
        """The step's drafts with the prediction drafts (:meth:`drafts`) in place of the
        method's where a request has one (see the module's docstring), and each request's cap
        on its draft length: the prediction draft's length, else ``method_caps[b]``."""
        caps = np.asarray(method_caps, dtype=np.int64).copy()
        method_lengths = np.minimum(drafts.lengths, caps)
        rows: dict[int, tuple[np.ndarray, int]] = {}
        for b, (tokens, length) in predicted.items():
            if len(tokens) < method_lengths[b] or (_weak(length) and method_lengths[b]):
                continue  # a chance match, likely, or a shorter draft: the method's is better
            rows[b] = (tokens, length)
        if not rows:
            return drafts, caps
        width = max(drafts.width, max(len(tokens) for tokens, _ in rows.values()))
        token_ids = np.full((drafts.batch_size, width), DRAFT_PAD, dtype=np.int64)
        token_ids[:, :drafts.width] = drafts.token_ids
        classes = np.zeros(drafts.batch_size, dtype=np.int64) if drafts.classes is None else drafts.classes.copy()
        lengths = drafts.lengths.copy()
        probs = None if drafts.probs is None else _widened(np.asarray(drafts.probs), width)
        for b, (tokens, length) in rows.items():
            token_ids[b] = DRAFT_PAD
            token_ids[b, :len(tokens)] = tokens
            lengths[b] = caps[b] = len(tokens)
            classes[b] = CLASS_BASE + match_class(length)
            if probs is not None:  # a deterministic draft: one-hot, as rejection sampling counts it
                probs[b] = 0.0
                probs[b, np.arange(len(tokens)), tokens] = 1.0
            self._drafted.add(requests[b].request_id)
        return Drafts(token_ids=token_ids, lengths=lengths, probs=probs, classes=classes), caps

    def record(self, requests: list, draft_lengths: np.ndarray, accepted: np.ndarray) -> None:
        """Count each request's verified prediction drafts: accepted and rejected tokens."""
        for b, request in enumerate(requests):
            if request.request_id in self._drafted:
                drafted, kept = int(draft_lengths[b]), int(accepted[b])
                request.metrics.num_prediction_accepted += kept
                request.metrics.num_prediction_rejected += drafted - kept

    def forget(self, request_id: str) -> None:
        """Drop a finished request's state."""
        self._alignments.pop(request_id, None)
        self._drafted.discard(request_id)

    @property
    def active(self) -> bool:
        """Whether any request has prediction state (for tests and metrics)."""
        return bool(self._alignments)


def _widened(probs: np.ndarray, width: int) -> np.ndarray:
    """``probs`` (``[B, k, V]``) padded with zero rows to ``[B, width, V]`` (a copy)."""
    out = np.zeros((probs.shape[0], width, probs.shape[2]), dtype=probs.dtype)
    out[:, :probs.shape[1]] = probs
    return out
