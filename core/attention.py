"""The attention backend contract (see ``specdec_register_attention_backends``)."""

from __future__ import annotations

import functools
from typing import Sequence

import attrs
import numpy as np

from .errors import SpecdecError
from .plugin import Plugin

#: Bytes per cached value of each ``kv_cache_dtype`` a backend may keep.
CACHE_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


@attrs.define(slots=True, kw_only=True)
class AttentionMetadata:
    """Where the packed query rows of one step sit, and where their keys live in the paged
    cache; built once per step by the engine (:meth:`build`), read by every layer.

    Per request ``b`` (``B`` requests, ``T`` packed rows):

    :ivar query_lens: ``[B]`` int32, how many new rows it has in the packed batch.
    :ivar context_lens: ``[B]`` int32, how many positions its cache holds before this step; its
        new rows take positions ``context_lens[b] .. context_lens[b] + query_lens[b] - 1``
        and attend causally to everything before them.
    :ivar block_tables: ``[B, max_blocks]`` int32, the cache block of each of its
        ``block_size``-position pages (padding entries are 0 and never read).
    :ivar block_size: positions per cache block.
    :ivar cu_seqlens_q: ``[B + 1]`` int32 offsets of each request's rows in the packed array.

    The row-level arrays (:attr:`cu_seqlens_k`, :attr:`positions`, :attr:`batch_ids`,
    :attr:`slot_mapping`) are computed on first read: a backend that does not read them (the
    ``cpu`` one) does not pay for them, a few us a step each.
    """

    query_lens: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    block_size: int
    cu_seqlens_q: np.ndarray

    @classmethod
    def build(cls, query_lens, context_lens, block_tables, block_size: int) -> "AttentionMetadata":
        """From the per-request arrays (the row-level ones follow on first read, with no per-row
        Python loop). ``block_tables`` is one ``[B, max_blocks]`` array, or one table per
        request of any lengths (padded here with block 0, never read past a request's own rows)."""
        query_lens = np.asarray(query_lens, dtype=np.int32)
        context_lens = np.asarray(context_lens, dtype=np.int32)
        if isinstance(block_tables, (list, tuple)) and len({len(t) for t in block_tables}) > 1:
            block_tables = _padded_tables(block_tables)
        block_tables = np.asarray(block_tables, dtype=np.int32).reshape(len(query_lens), -1)
        cu_q = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=cu_q[1:])
        return cls(query_lens=query_lens, context_lens=context_lens, block_tables=block_tables,
                   block_size=block_size, cu_seqlens_q=cu_q)

    @functools.cached_property
    def cu_seqlens_k(self) -> np.ndarray:
        """``[B + 1]`` int32 offsets of each request's keys (context + new rows)."""
        cu_k = np.zeros(len(self.query_lens) + 1, dtype=np.int32)
        np.cumsum(self.context_lens + self.query_lens, out=cu_k[1:])
        return cu_k

    @functools.cached_property
    def batch_ids(self) -> np.ndarray:
        """``[T]`` int32, the request of each row."""
        return np.repeat(np.arange(len(self.query_lens), dtype=np.int32), self.query_lens)

    @functools.cached_property
    def positions(self) -> np.ndarray:
        """``[T]`` int64, each row's position in its own sequence."""
        rows = np.arange(self.num_rows, dtype=np.int64)
        return rows - self.cu_seqlens_q[self.batch_ids] + self.context_lens[self.batch_ids]

    @functools.cached_property
    def slot_mapping(self) -> np.ndarray:
        """``[T]`` int64, where each row's key/value goes: ``block * block_size + offset``."""
        blocks = self.block_tables[self.batch_ids, self.positions // self.block_size].astype(np.int64)
        return blocks * self.block_size + self.positions % self.block_size

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def num_rows(self) -> int:
        return int(self.cu_seqlens_q[-1])


def _padded_tables(tables) -> np.ndarray:
    """Block tables of different lengths as one zero-padded ``[B, max_blocks]`` int32 array."""
    out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return out


class AttentionBackend(Plugin):
    """Base class of attention backends: owns the paged KV cache memory and computes causal
    attention of the packed rows of a step over it.

    Lifecycle: built once per engine as ``cls(config, None)``, ``config`` being ``cls.Config()``
    when the class declares one (no configuration key reaches a backend's Config yet) and the
    speculative config ``None`` (a backend outlives any one speculative config); ``setup`` once with the model's shape and RoPE tables;
    ``init_cache`` once with the pool size the engine chose (which block holds which
    positions is the engine's business: it passes block tables in the metadata); ``prepare``
    once per step; ``forward`` once per layer per step. The backend applies RoPE, so that a
    fused kernel can do RoPE, the cache write and attention in one pass.
    Rows a step later rejects are not removed: the next step simply overwrites them, because
    every request's visible length is its ``context_lens`` entry.

    After ``setup`` the base class holds the shape as ``num_layers``, ``num_heads``,
    ``num_kv_heads``, ``head_dim`` and ``dtype``, and ``rope_cos``/``rope_sin``.
    """

    num_layers: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = "float32"

    def setup(self, *, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
              dtype: str, rope_cos, rope_sin) -> None:
        """Remember the model's shape. ``dtype`` is the cache's storage (``kv_cache_dtype``
        resolved: ``float32`` or ``float16``); a backend that cannot keep it raises
        :class:`specdec.SpecdecError` naming ``kv_cache_dtype``. ``rope_cos``/``rope_sin``
        are ``[max_positions, D]`` float32 numpy tables: ``rope(x) = x * cos + roll(x, D/2) * sin``
        (rotate-half RoPE, the sign folded into ``sin``).

        Backends override it to check what they support and build their tables, calling
        ``super().setup(...)`` to record the shape."""
        if dtype not in CACHE_DTYPE_BYTES:
            raise ValueError(f"unknown cache dtype {dtype!r}; expected one of {sorted(CACHE_DTYPE_BYTES)}")
        self.num_layers, self.num_heads, self.num_kv_heads = num_layers, num_heads, num_kv_heads
        self.head_dim, self.dtype = head_dim, dtype
        self.rope_cos, self.rope_sin = rope_cos, rope_sin

    def bytes_per_block(self, block_size: int) -> int:
        """Cache memory one block of ``block_size`` positions takes over all layers (the
        engine sizes the pool from a memory budget with it): keys and values of every KV
        head in ``dtype``. A backend that stores more (scales, say) overrides it."""
        return self.num_layers * 2 * self.num_kv_heads * block_size * self.head_dim * CACHE_DTYPE_BYTES[self.dtype]

    def init_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the cache: ``num_blocks`` blocks of ``block_size`` positions per layer."""
        raise NotImplementedError

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build per-step state shared by all layers (masks, RoPE rows, index tensors)."""

    def forward(self, layer: int, qkv, meta: AttentionMetadata):
        """Attention of one layer over the packed rows of a step.

        :param qkv: ``[T, (H + 2*KVH) * D]`` float32 paddle tensor: the query heads, then the key
            heads, then the value heads of every packed row, before RoPE; queries are
            pre-scaled by ``1/sqrt(D)``.
        :returns: ``[T, H*D]``, each row's attention output (heads concatenated).
        The backend applies RoPE to queries and keys, stores the rows' keys and values at
        ``meta.slot_mapping``, then lets row ``t`` of request ``b`` attend to positions
        ``0 .. context_lens[b] + t`` of that request.
        """
        raise NotImplementedError

    # -- moving blocks between engines (a request handed from a prefill to a decode instance) --

    def export_blocks(self, block_ids: Sequence[int]) -> list[np.ndarray]:
        """Copy the cache contents of ``block_ids`` out, for another engine's :meth:`import_blocks`.

        :returns: one numpy array per layer (a copy), whose first axis is ``block_ids`` in the
            order given: that layer's whole cache rows of each block (keys and values of every
            position and KV head), in this backend's own layout; the importing side is a
            backend of the same ``NAME``, cache dtype and shape, and treats them as opaque.
        :raises SpecdecError: when the backend cannot (this base implementation).
        """
        raise SpecdecError(self._cannot_move_blocks())

    def import_blocks(self, block_ids: Sequence[int], data: list[np.ndarray]) -> None:
        """Write ``data`` (what :meth:`export_blocks` returned on a backend like this one) into
        the blocks ``block_ids`` of this cache, in place, so that the next ``forward`` reads it.

        :raises SpecdecError: when ``data`` does not fit (layers, blocks, shape or dtype), or
            the backend cannot move blocks (this base implementation).
        """
        raise SpecdecError(self._cannot_move_blocks())

    def _export_leading_blocks(self, caches: list, block_ids: Sequence[int]) -> list[np.ndarray]:
        """:meth:`export_blocks` for a cache of one paddle tensor per layer with blocks on its
        first axis (bfloat16 comes out as its ``uint16`` bits, as paddle hands it to numpy)."""
        if not len(block_ids):
            dtype = np.uint16 if self.dtype == "bfloat16" else self.dtype
            return [np.empty((0, *cache.shape[1:]), dtype=dtype) for cache in caches]
        import paddle

        index = paddle.to_tensor(np.asarray(block_ids, dtype=np.int64), place=caches[0].place)
        return [cache[index].numpy() for cache in caches]

    def _import_leading_blocks(self, caches: list, block_ids: Sequence[int], data: list[np.ndarray]) -> None:
        """:meth:`import_blocks` for the caches of :meth:`_export_leading_blocks`."""
        self._check_block_data(block_ids, data, caches[0].shape[1:], self.dtype)
        if not len(block_ids):
            return
        import paddle

        place = caches[0].place
        index = paddle.to_tensor(np.asarray(block_ids, dtype=np.int64), place=place)
        for cache, blocks in zip(caches, data):
            # In place: the kernels read this very tensor. (paddle's scatter has no float16 CPU
            # kernel; index_put_ has; numpy uint16 becomes a bfloat16 tensor.)
            paddle.index_put_(cache, (index,), paddle.to_tensor(blocks, place=place))

    def _cannot_move_blocks(self) -> str:
        return f"attention_backend '{self.NAME}' cannot move KV blocks between instances (export_blocks/import_blocks)"

    def _check_block_data(self, block_ids: Sequence[int], data: list, block_shape: Sequence[int],
                          dtype: str) -> None:
        """For :meth:`import_blocks`: a one-line SpecdecError unless ``data`` holds one array per
        layer of shape ``[len(block_ids), *block_shape]`` and numpy dtype ``dtype`` (bfloat16
        travels as its ``uint16`` bits)."""
        if len(data) != self.num_layers:
            raise SpecdecError(f"import_blocks: {len(data)} layers of KV blocks, the model has {self.num_layers}")
        shape = (len(block_ids), *block_shape)
        want = np.dtype("uint16") if dtype == "bfloat16" else np.dtype(dtype)
        for layer, array in enumerate(data):
            if tuple(array.shape) != shape or array.dtype != want:
                raise SpecdecError(f"import_blocks: layer {layer} holds {array.dtype} {list(array.shape)}; this "
                                   f"cache takes {want} {list(shape)}")
