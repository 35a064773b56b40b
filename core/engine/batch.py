"""Packing one step's rows into the single token array the model runs on (docs/architecture.md,
"The data of a step").

Pure functions of numpy arrays: no model, no engine, no plugin. The engine hands over, per
scheduled request, the tokens it feeds this step and where its cache is
(:class:`SequenceRows`), plus the drafts of the decoding requests; :func:`pack_step` returns
the packed token ids, the attention metadata, which rows need logits, and how to lay those
logits out as the ``[B, k+1, V]`` array the verify strategies read.

Row order: every decoding request (its uncomputed tokens, then its drafts), then every prefill
chunk. A decoding request needs logits for its last uncomputed token and for each of its
drafts; a prefill chunk needs none.
"""

from __future__ import annotations

from typing import Optional, Sequence

import attrs
import numpy as np

from ..attention import AttentionMetadata
from ..proposer import Drafts


@attrs.frozen
class SequenceRows:
    """The rows one request feeds a step.

    :ivar token_ids: ``[n]`` int64, the tokens whose keys and values are not in the cache yet
        (one for a decoding request, unless its prompt completes this step; the chunk for a
        prefill). A decoding request's drafts are not included: :func:`pack_step` appends them.
    :ivar context_len: positions the request's cache already holds; the rows take positions
        ``context_len ..``.
    :ivar block_table: the request's cache blocks, in position order.
    """

    token_ids: np.ndarray
    context_len: int
    block_table: Sequence[int]


@attrs.frozen
class PackedStep:
    """One step, packed.

    :ivar token_ids: ``[T]`` int64, every row of the step in order.
    :ivar meta: the rows' attention metadata (positions, cache slots, block tables).
    :ivar logit_rows: ``[R]`` int64, the rows of ``token_ids`` whose logits are computed, in
        order: per decoding request ``b``, ``lengths[b] + 1`` rows (``R = B + sum(lengths)``).
    :ivar padded_rows: ``[B, k+1]`` int64 indices into those ``R`` logits that lay them out per
        request, a request's last real row repeated as padding; ``None`` when no request needs
        padding (every draft row is full), and a reshape does.
    :ivar num_decodes: ``B``, the decoding requests.
    :ivar width: ``k``, the drafts' width.
    """

    token_ids: np.ndarray
    meta: AttentionMetadata
    logit_rows: np.ndarray
    padded_rows: Optional[np.ndarray]
    num_decodes: int
    width: int

    @property
    def is_decode_only(self) -> bool:
        """True when every row is a decoding request's last token or a draft (no prompt rows)."""
        return self.meta.num_rows == len(self.logit_rows)

    def verify_logits(self, logits):
        """``[B, k+1, V]`` from the ``[R, V]`` logits of :attr:`logit_rows` (a numpy array, or a
        paddle tensor left on its device): a view when no request needs padding, else a copy
        that repeats each request's last real row (the padding is masked by the drafts'
        lengths and never read as a token)."""
        shape = [self.num_decodes, self.width + 1, logits.shape[-1]]
        if self.padded_rows is None:
            return logits.reshape(shape)
        if isinstance(logits, np.ndarray):
            return logits[self.padded_rows]
        import paddle

        return paddle.gather(logits, paddle.to_tensor(self.padded_rows.reshape(-1))).reshape(shape)


@attrs.frozen
class PickedRows:
    """A step's ``[B, k+1, V]`` logits left as its ``[R, V]`` rows and the ``[B, k+1]`` indices
    that lay them out (:attr:`PackedStep.padded_rows`): a greedy step verifies from the rows'
    argmax and never builds the padded array (at batch 64 that copy moved 13 MB a step)."""

    rows: np.ndarray
    index: np.ndarray

    def select(self, pick: np.ndarray) -> "PickedRows":
        """The logits of the requests at ``pick`` (their indices; the rows stay shared)."""
        return PickedRows(self.rows, self.index[pick])


def pack_step(decodes: Sequence[SequenceRows], drafts: Drafts, chunks: Sequence[SequenceRows],
              block_size: int) -> PackedStep:
    """Pack the rows of a step: ``decodes[b]`` followed by row ``b`` of ``drafts``, then the
    prefill ``chunks``.

    :param decodes: the decoding requests, row-aligned with ``drafts``; each feeds at least one
        token.
    :param drafts: ``[B, k]`` drafts with their lengths (``Drafts.empty(B)`` for none).
    :param chunks: prefill chunks, which need no logits.
    :param block_size: positions per cache block.
    """
    if drafts.batch_size != len(decodes):
        raise ValueError(f"{len(decodes)} decoding requests but {drafts.batch_size} rows of drafts")
    lengths = np.asarray(drafts.lengths, dtype=np.int64)
    width = drafts.width
    pieces = []
    for b, sequence in enumerate(decodes):
        pieces.append(np.asarray(sequence.token_ids, dtype=np.int64))
        pieces.append(drafts.token_ids[b, : lengths[b]])
    pieces.extend(np.asarray(sequence.token_ids, dtype=np.int64) for sequence in chunks)
    token_ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)

    fed = np.fromiter((len(s.token_ids) for s in decodes), dtype=np.int64, count=len(decodes))
    chunk_rows = np.fromiter((len(s.token_ids) for s in chunks), dtype=np.int64, count=len(chunks))
    query_lens = np.concatenate([fed + lengths, chunk_rows])
    sequences = [*decodes, *chunks]
    context_lens = np.fromiter((s.context_len for s in sequences), dtype=np.int64, count=len(sequences))
    tables = np.zeros((len(sequences), max((len(s.block_table) for s in sequences), default=0)), dtype=np.int32)
    for b, sequence in enumerate(sequences):
        tables[b, : len(sequence.block_table)] = sequence.block_table
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size)

    # Per decoding request, its last fed token's row and its draft rows; the padding of
    # [B, k+1] repeats a request's last real logits instead of computing more rows (the LM
    # head is a fifth of the model's multiply-adds per row).
    counts = lengths + 1
    compact_starts = np.cumsum(counts) - counts
    first = meta.cu_seqlens_q[: len(decodes)].astype(np.int64) + fed - 1
    logit_rows = np.repeat(first - compact_starts, counts) + np.arange(int(counts.sum()), dtype=np.int64)
    padded_rows = None
    if not (lengths == width).all():
        padded_rows = compact_starts[:, None] + np.minimum(np.arange(width + 1)[None, :], lengths[:, None])
    return PackedStep(token_ids=token_ids, meta=meta, logit_rows=logit_rows, padded_rows=padded_rows,
                      num_decodes=len(decodes), width=width)
