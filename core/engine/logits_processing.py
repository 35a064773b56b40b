"""Per-request logits processing between the forward and verify.

A :class:`RowProcessor` edits a request's ``[len(drafts) + 1, V]`` logits in place before the
verify strategy sees them, so that whatever it forbids is rejected at every verified
position, drafts included; after the update it is told what the request got.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class RowProcessor:
    """Edits one request's logits at every step (a grammar's token mask, say)."""

    def process(self, logits: np.ndarray, tokens: np.ndarray, drafts: np.ndarray) -> None:
        """logits: float32 [len(drafts) + 1, V], edited in place; tokens: the request's prompt
        and output token ids so far; drafts: this step's draft ids for the request. Row j is
        the target's distribution after tokens + drafts[:j]."""

    def on_emitted(self, tokens: np.ndarray) -> None:
        """The tokens this step appended to the request, to advance state."""


def apply_row_processors(requests: Sequence, logits, draft_ids: np.ndarray, draft_lengths: np.ndarray):
    """Run each request's ``row_processors`` on its rows of the step's ``[B, k+1, V]`` logits
    (``requests`` row-aligned with them). Returns ``(logits, failures)``: the logits to verify
    (edited in place when a writable numpy array, else a processed copy / the device tensor
    with the processed rows written back) and ``[(row, exception)]`` of the requests whose
    processors raised (their rows are left as they were)."""
    chosen = [b for b, request in enumerate(requests) if request.row_processors]
    failures = []
    if not chosen:
        return logits, failures
    on_host = isinstance(logits, np.ndarray)
    if on_host and not logits.flags.writeable:
        logits = logits.copy()
    for b in chosen:
        length = int(draft_lengths[b])
        source = logits[b, : length + 1]
        rows = np.array(source if on_host else source.numpy(), dtype=np.float32)
        try:
            drafts = np.asarray(draft_ids[b, :length], dtype=np.int64)
            for processor in requests[b].row_processors:
                processor.process(rows, requests[b].token_ids, drafts)
        except Exception as exc:  # noqa: BLE001 - this request alone fails
            failures.append((b, exc))
            continue
        if on_host:
            logits[b, : length + 1] = rows
        else:
            import paddle

            logits[b, : length + 1] = paddle.to_tensor(rows, dtype=logits.dtype, place=logits.place)
    return logits, failures
