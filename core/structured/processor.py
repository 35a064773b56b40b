"""The grammar as a row processor: the target's logits masked at every verified position.

Speculation verifies ``k`` drafts in one step: row ``j`` of a request's logits is the target's
distribution after its tokens plus ``drafts[:j]``. :class:`GrammarProcessor` masks each row
with what the grammar allows after that prefix (disallowed logits to ``-inf``), so the verify
strategy sees the constrained distribution at every position: a draft the grammar forbids has
probability 0 there and is rejected like any other mismatch, and the token put in its place is
drawn from the masked row. Rows past the first forbidden draft are left as they are: that
draft is rejected, so nothing after it is emitted. The matcher walks the drafts and rolls back;
only :meth:`on_emitted` moves it for real. Where the grammar is complete only the end-of-sequence
tokens are allowed.
"""

from __future__ import annotations

import logging

import numpy as np

from ..engine.logits_processing import RowProcessor

logger = logging.getLogger("specdec.structured")


class GrammarProcessor(RowProcessor):
    """Masks one request's logits with an ``llguidance.LLMatcher``.

    :param matcher: a fresh matcher for the request's grammar (:class:`~.grammar.GrammarCompiler`).
    :param eos_token_ids: the ids that end the request; allowed where the grammar is complete,
        and the only ones allowed once the matcher is in an error state (a resource limit hit
        mid-way), so that the request ends rather than run unconstrained.
    """

    def __init__(self, matcher, eos_token_ids):
        self.matcher = matcher
        self.eos_token_ids = np.asarray(sorted(eos_token_ids), dtype=np.int64)
        self._words = None

    def _row_mask(self, vocab_size: int) -> np.ndarray:
        """What the grammar allows next: a bool array over ``vocab_size`` ids."""
        words = np.empty((vocab_size + 31) // 32, dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)

    def _mask(self, row: np.ndarray) -> None:
        if self.matcher.is_error():
            allowed = np.zeros(row.shape[0], dtype=bool)
            allowed[self.eos_token_ids[self.eos_token_ids < row.shape[0]]] = True
        else:
            allowed = self._row_mask(row.shape[0])
        row[~allowed] = -np.inf

    def process(self, logits: np.ndarray, tokens: np.ndarray, drafts: np.ndarray) -> None:
        """Mask row 0 (after ``tokens``) and row ``j`` (after ``drafts[:j]``) for every draft
        up to the first one the grammar forbids, then roll the matcher back."""
        drafts = [int(t) for t in drafts]
        valid = self.matcher.validate_tokens(drafts) if drafts and not self.matcher.is_error() else 0
        consumed = 0
        for j in range(valid + 1):
            self._mask(logits[j])
            if j < valid:
                if not self.matcher.consume_token(drafts[j]):  # cannot happen: validated
                    break
                consumed += 1
        if consumed:
            self.matcher.rollback(consumed)

    def on_emitted(self, tokens: np.ndarray) -> None:
        """Advance the matcher over the tokens the step appended."""
        for token in tokens:
            if self.matcher.is_stopped() or self.matcher.is_error():
                return
            if not self.matcher.consume_token(int(token)):
                logger.warning("grammar: emitted token %d is not allowed: %s", int(token), self.matcher.get_error())
                return
