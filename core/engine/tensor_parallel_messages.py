"""The messages rank 0 sends the other tensor-parallel ranks, as fixed-layout int64 arrays.

Nothing a rank receives is unpickled: paddle's ``broadcast_object_list`` would, and then
whoever can reach the collectives could run code in every rank. A message is instead a
header of :data:`HEADER_SIZE` int64 values and, for a forward pass only, one int64 payload
whose length the header gives:

==========  ============================================================================
header      ``[MAGIC, kind, a, b, c, d, e, 0]``: ``kind`` one of :class:`Kind`; ``a .. e``
            per kind: ``init_cache``: blocks, block size; ``forward``: rows ``T``,
            requests ``B``, block-table width ``W``, block size, logit rows ``M``
payload     ``forward``: token ids ``[T]``, query lengths ``[B]``, context lengths ``[B]``,
            block tables ``[B * W]``, logit rows ``[M]``, back to back
==========  ============================================================================

The receiving rank checks everything against :class:`Limits` before it allocates or uses a
value (:func:`payload_length`, :func:`decode`): a known kind, sizes within bounds, token ids
within the vocabulary, block ids within its cache, positions within the model's. Anything
else raises :class:`MessageError`. The attention metadata is rebuilt from the per-request
arrays with :meth:`AttentionMetadata.build`, the only way the engine makes one, so a worker
never takes derived arrays (slot mappings, offsets) it has not computed itself.
"""

from __future__ import annotations

import enum
from typing import Optional, Union

import attrs
import numpy as np

from ..attention import AttentionMetadata
from ..errors import SpecdecError

HEADER_SIZE = 8
#: The header's first value: "specdT" in ASCII, then the layout's version (1) in the low bytes.
MAGIC = int.from_bytes(b"specdT\x00\x01", "big")
#: Bounds that hold whatever the model: a step's rows and requests, a block table's width.
MAX_ROWS = 1 << 20
MAX_REQUESTS = 1 << 16
MAX_TABLE_WIDTH = 1 << 20
MAX_PAYLOAD = 1 << 24


class Kind(enum.IntEnum):
    STOP = 1
    PING = 2
    INIT_CACHE = 3
    FORWARD = 4


class MessageError(SpecdecError):
    """A tensor-parallel message that does not follow the layout (refused, never used)."""


@attrs.frozen
class Stop:
    """End the worker loop."""


@attrs.frozen
class Ping:
    """Rank 0 is idle; keeps the workers' collective from timing out."""


@attrs.frozen
class InitCache:
    """Allocate the rank's KV cache: ``num_blocks`` blocks of ``block_size`` positions."""

    num_blocks: int
    block_size: int


@attrs.frozen(eq=False)
class Forward:
    """One forward pass: :meth:`LlamaModel.forward`'s inputs, the metadata as the per-request
    arrays :meth:`AttentionMetadata.build` takes."""

    token_ids: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    block_size: int
    logit_rows: np.ndarray

    @classmethod
    def of(cls, token_ids, meta: AttentionMetadata, logit_rows) -> "Forward":
        return cls(np.asarray(token_ids, np.int64), meta.query_lens, meta.context_lens, meta.block_tables,
                   meta.block_size, np.asarray(logit_rows, np.int64))

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata.build(self.query_lens, self.context_lens, self.block_tables, self.block_size)


Message = Union[Stop, Ping, InitCache, Forward]


@attrs.frozen
class Limits:
    """What a receiving rank accepts: token ids below ``vocab_size``, positions below
    ``max_positions``, and, once its cache exists (``num_blocks`` > 0), block ids below
    ``num_blocks`` in blocks of ``block_size``; no forward pass before that."""

    vocab_size: int
    max_positions: int
    num_blocks: int = 0
    block_size: int = 0


def encode(message: Message) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """``(header, payload)``; the payload is None for every kind but :class:`Forward`."""
    header = np.zeros(HEADER_SIZE, np.int64)
    header[0] = MAGIC
    payload = None
    if isinstance(message, Stop):
        header[1] = Kind.STOP
    elif isinstance(message, Ping):
        header[1] = Kind.PING
    elif isinstance(message, InitCache):
        header[1:4] = Kind.INIT_CACHE, message.num_blocks, message.block_size
    elif isinstance(message, Forward):
        tables = np.asarray(message.block_tables)  # [B, W], as AttentionMetadata.build makes it
        header[1:7] = (Kind.FORWARD, len(message.token_ids), len(message.query_lens), tables.shape[1],
                       message.block_size, len(message.logit_rows))
        payload = np.concatenate([np.asarray(part, np.int64).reshape(-1) for part in (
            message.token_ids, message.query_lens, message.context_lens, tables, message.logit_rows)])
    else:
        raise TypeError(f"not a tensor-parallel message: {type(message).__name__}")
    return header, payload


def payload_length(header: np.ndarray, limits: Limits) -> int:
    """How many int64 values follow ``header`` (0: none); raises :class:`MessageError` for a
    header that is not one of :func:`encode`'s within ``limits``."""
    header = np.asarray(header)
    _require(header.dtype == np.int64 and header.shape == (HEADER_SIZE,), "a header is 8 int64 values")
    _require(int(header[0]) == MAGIC, "not a tensor-parallel message header (wrong magic)")
    _require(int(header[1]) in Kind.__members__.values(), f"unknown message kind {int(header[1])}")
    kind = Kind(int(header[1]))
    if kind in (Kind.STOP, Kind.PING):
        _require(not header[2:].any(), f"{kind.name.lower()} carries no values")
        return 0
    if kind == Kind.INIT_CACHE:
        num_blocks, block_size = int(header[2]), int(header[3])
        _require(not header[4:].any(), "init_cache carries two values")
        _require(0 < num_blocks <= MAX_PAYLOAD and 0 < block_size <= limits.max_positions,
                 f"init_cache: {num_blocks} blocks of {block_size} positions is out of bounds")
        return 0
    rows, requests, width, block_size, logit_rows = (int(value) for value in header[2:7])
    _require(not header[7], "forward carries five values")
    _require(limits.num_blocks > 0, "forward before init_cache")
    _require(0 <= rows <= MAX_ROWS and 0 <= requests <= MAX_REQUESTS and 0 <= width <= MAX_TABLE_WIDTH
             and 0 <= logit_rows <= rows, f"forward: sizes out of bounds ({rows}, {requests}, {width}, {logit_rows})")
    _require(block_size == limits.block_size, f"forward: block size {block_size}, the cache's is {limits.block_size}")
    length = rows + 2 * requests + requests * width + logit_rows
    _require(length <= MAX_PAYLOAD, f"forward: {length} values, more than {MAX_PAYLOAD}")
    return length


def decode(header: np.ndarray, payload: Optional[np.ndarray], limits: Limits) -> Message:
    """The message ``header`` and ``payload`` encode; raises :class:`MessageError` unless
    they are what :func:`encode` makes, within ``limits``."""
    length = payload_length(header, limits)
    kind = Kind(int(header[1]))
    if kind == Kind.STOP:
        return Stop()
    if kind == Kind.PING:
        return Ping()
    if kind == Kind.INIT_CACHE:
        return InitCache(int(header[2]), int(header[3]))
    payload = np.asarray(payload)
    _require(payload.dtype == np.int64 and payload.shape == (length,), f"forward: a payload of {length} int64 values")
    rows, requests, width, block_size, _ = (int(value) for value in header[2:7])
    token_ids, query_lens, context_lens, tables, logit_rows = np.split(
        payload, np.cumsum([rows, requests, requests, requests * width]))
    _require(bool(((token_ids >= 0) & (token_ids < limits.vocab_size)).all()),
             "forward: a token id out of the vocabulary")
    # Each length bounded before any sum: int64 sums of forged values would wrap around.
    _require(bool(((query_lens >= 0) & (query_lens <= rows)).all()) and int(query_lens.sum()) == rows,
             "forward: query lengths do not sum to the rows")
    _require(bool(((context_lens >= 0) & (context_lens <= limits.max_positions)).all()),
             "forward: a context length out of the model's positions")
    ends = context_lens + query_lens
    _require(bool((ends <= min(limits.max_positions, width * block_size)).all()),
             "forward: a position beyond the model's or the block table's")
    _require(bool(((tables >= 0) & (tables < limits.num_blocks)).all()), "forward: a block id out of the cache")
    _require(bool(((logit_rows >= 0) & (logit_rows < rows)).all()), "forward: a logit row out of the rows")
    return Forward(token_ids, query_lens.astype(np.int32), context_lens.astype(np.int32),
                   tables.astype(np.int32).reshape(requests, width), block_size, logit_rows)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise MessageError(f"refused a tensor-parallel message: {message}")
