"""Per-request logits processing between the forward and verify.

A :class:`RowProcessor` edits a request's ``[len(drafts) + 1, V]`` logits in place before the
verify strategy sees them, so that whatever it forbids is rejected at every verified
position, drafts included; after the update it is told what the request got.
"""

from __future__ import annotations

import numpy as np


class RowProcessor:
    """Edits one request's logits at every step (a grammar's token mask, say)."""

    def process(self, logits: np.ndarray, tokens: np.ndarray, drafts: np.ndarray) -> None:
        """logits: float32 [len(drafts) + 1, V], edited in place; tokens: the request's prompt
        and output token ids so far; drafts: this step's draft ids for the request. Row j is
        the target's distribution after tokens + drafts[:j]."""

    def on_emitted(self, tokens: np.ndarray) -> None:
        """The tokens this step appended to the request, to advance state."""
