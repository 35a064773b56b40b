"""Per-request logits processors, applied where verification sees them.

A :class:`RowProcessor` changes one request's target logits before the verify strategy reads
them. A step verifies ``len(drafts) + 1`` rows of a request at once: row ``j`` is the target's
distribution after the request's tokens plus this step's ``drafts[:j]``. A processor edits each
row as if those drafts had already been emitted (a penalty at row ``j`` counts the drafts before
``j``), so every row is exactly the distribution plain decoding would have had there, and a
lossless verify strategy stays lossless with the processor on: at temperature 0 the output is
naive decoding's, and sampled tokens follow the processed distribution.

Requests carry their processors in ``Request.row_processors`` (empty by default: a request
without any costs nothing, and a batch without any keeps the fused device path untouched).
The engine calls :func:`apply_row_processors` between the forward pass and verification, and
:meth:`RowProcessor.on_emitted` once the step's tokens are appended. The first output token
comes from a decode step too (the prompt's last token is its first row), so it is processed
like any other.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class RowProcessor:
    """Base class: changes one request's logits at every row the step verifies.

    Subclasses override :meth:`process` (and :meth:`on_emitted` when they keep state). They
    must be deterministic functions of the tokens they are shown: the engine may call
    :meth:`process` again for the same step (a failed batch is retried request by request).
    """

    def process(self, logits: np.ndarray, tokens: np.ndarray, drafts: np.ndarray) -> None:
        """Edit the logits of one request in place.

        :param logits: float32 ``[len(drafts) + 1, V]``; row ``j`` is the target's logits after
            ``tokens`` followed by ``drafts[:j]``.
        :param tokens: the request's prompt and output token ids so far (int64, read-only).
        :param drafts: this step's draft token ids for the request (int64, possibly empty).
        """
        raise NotImplementedError

    def on_emitted(self, tokens: np.ndarray) -> None:
        """The tokens this step appended to the request (after verification), to advance any
        state (a grammar's automaton, say). The default does nothing."""


def apply_row_processors(requests: Sequence, logits, draft_ids: np.ndarray, draft_lengths: np.ndarray):
    """Run each request's ``row_processors`` on its rows of the step's ``[B, k+1, V]`` logits.

    ``requests`` are row-aligned with ``logits``. Returns ``(logits, failures)``: the logits to
    verify (the same array edited in place when it is a writable numpy array, else a processed
    copy; for a paddle tensor on its device the same tensor, with only the processed requests'
    rows brought to the host and written back) and ``[(row, exception)]`` for the requests
    whose processors raised (their rows are left as they were). Each request's rows are
    processed once, on a copy written back only when all its processors succeed, so a failure
    never leaves a request half processed. Nothing is touched when no request has processors.
    """
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
            tokens = requests[b].token_ids
            drafts = np.asarray(draft_ids[b, :length], dtype=np.int64)
            for processor in requests[b].row_processors:
                processor.process(rows, tokens, drafts)
        except Exception as exc:  # noqa: BLE001 - this request alone fails
            failures.append((b, exc))
            continue
        if on_host:
            logits[b, : length + 1] = rows
        else:
            import paddle

            logits[b, : length + 1] = paddle.to_tensor(rows, dtype=logits.dtype, place=logits.place)
    return logits, failures
