"""``paddle``: the reference attention backend (plain paddle ops over the paged cache).

Each layer's cache is one ``[num_blocks * block_size, 2*KVH, D]`` tensor: cache slot
``block * block_size + offset`` holds one position's key heads, then its value heads. A step
scatters the new rows' keys and values into their slots, gathers every request's keys
(``[B, longest sequence]`` slots, padded) and runs masked attention for the whole batch at
once: padded query rows, padded key columns and the causal rule are all in one additive
mask. It favours plainness over speed; it is the twin the fused backends are tested against.
"""

from __future__ import annotations

import numpy as np

import specdec
from specdec.sdk import AttentionMetadata, SpecdecError, require_paddle


class PaddleAttention(specdec.AttentionBackend):
    NAME = "paddle"

    def setup(self, *, num_layers, num_heads, num_kv_heads, head_dim, dtype, rope_cos, rope_sin):
        self.paddle = require_paddle()
        if dtype != "float32":
            raise SpecdecError(f"kv_cache_dtype: attention_backend 'paddle' keeps a float32 cache, got {dtype}; "
                               "use kv_cache_dtype: float32 (or auto)")
        super().setup(num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      dtype=dtype, rope_cos=rope_cos, rope_sin=rope_sin)
        self.group = num_heads // num_kv_heads
        self.num_blocks = 0
        self.block_size = 0

    def init_cache(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = [num_blocks * block_size, 2 * self.num_kv_heads, self.head_dim]
        self._caches = [self.paddle.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]

    def _block_slots(self, block_ids):
        """The cache slots of ``block_ids``, block after block (a paddle int64 tensor)."""
        blocks = np.asarray(block_ids, dtype=np.int64)
        slots = blocks[:, None] * self.block_size + np.arange(self.block_size)[None, :]
        return self.paddle.to_tensor(slots.reshape(-1))

    def export_blocks(self, block_ids):
        """Per layer ``[len(block_ids), block_size, 2*KVH, D]``: each block's slots, in order."""
        shape = [len(block_ids), self.block_size, 2 * self.num_kv_heads, self.head_dim]
        if not len(block_ids):
            return [np.empty(shape, dtype=self.dtype) for _ in self._caches]
        slots = self._block_slots(block_ids)
        return [self.paddle.gather(cache, slots).numpy().reshape(shape) for cache in self._caches]

    def import_blocks(self, block_ids, data):
        self._check_block_data(block_ids, data, [self.block_size, 2 * self.num_kv_heads, self.head_dim], self.dtype)
        if not len(block_ids):
            return
        p = self.paddle
        slots = self._block_slots(block_ids)
        rows = [-1, 2 * self.num_kv_heads, self.head_dim]
        for cache, blocks in zip(self._caches, data):
            p.scatter_(cache, slots, p.to_tensor(blocks).reshape(rows), overwrite=True)  # in place, as forward writes

    def _rope_rows(self, positions: np.ndarray) -> None:
        """RoPE factors of this step's rows for every head (identity on the value heads)."""
        heads = self.num_heads + 2 * self.num_kv_heads
        rope_heads = self.num_heads + self.num_kv_heads
        cos = np.ones((len(positions), heads, self.head_dim), dtype=np.float32)
        sin = np.zeros_like(cos)
        cos[:, :rope_heads] = self.rope_cos[positions][:, None, :]
        sin[:, :rope_heads] = self.rope_sin[positions][:, None, :]
        self._cos, self._sin = self.paddle.to_tensor(cos), self.paddle.to_tensor(sin)

    def prepare(self, meta: AttentionMetadata) -> None:
        """RoPE rows, the padded row index, every request's key slots and the batch mask."""
        if int((meta.context_lens + meta.query_lens).max()) > meta.block_tables.shape[1] * self.block_size:
            raise ValueError("attention: a request's positions exceed its block table")
        p = self.paddle
        self._rope_rows(meta.positions)
        batch = meta.num_requests
        seq_lens = (meta.context_lens + meta.query_lens).astype(np.int64)
        q_max, k_max = int(meta.query_lens.max()), int(seq_lens.max())
        row_in_request = meta.positions - meta.context_lens[meta.batch_ids]
        self._q_max = q_max
        self._padded_rows = p.to_tensor(meta.batch_ids.astype(np.int64) * q_max + row_in_request)
        key_positions = np.arange(k_max)
        blocks = meta.block_tables[:, np.minimum(key_positions // self.block_size, meta.block_tables.shape[1] - 1)]
        slots = blocks.astype(np.int64) * self.block_size + key_positions % self.block_size
        self._key_slots = p.to_tensor(slots.reshape(-1))
        self._batch, self._k_max = batch, k_max
        # Row t of request b sees key j when j <= context + t. Padded query rows see key 0
        # only (their output is dropped; the mask just keeps their softmax finite).
        t = np.arange(q_max)
        visible = np.where(t[None, :] < meta.query_lens[:, None], meta.context_lens[:, None] + t[None, :], 0)
        allowed = key_positions[None, None, :] <= visible[:, :, None]  # [B, q_max, k_max]
        mask = np.where(allowed, 0.0, -np.inf).astype(np.float32)
        # Query rows are ordered (t, g) inside each KV head: repeat each row G times.
        self._mask = p.to_tensor(np.repeat(mask, self.group, axis=1)[:, None])

    def forward(self, layer, qkv, meta: AttentionMetadata):
        p = self.paddle
        heads, kv_heads, group, dim = self.num_heads, self.num_kv_heads, self.group, self.head_dim
        batch, q_max, k_max = self._batch, self._q_max, self._k_max
        qkv = qkv.reshape([-1, heads + 2 * kv_heads, dim])
        qkv = qkv * self._cos + p.roll(qkv, dim // 2, axis=-1) * self._sin
        cache = self._caches[layer]
        p.scatter_(cache, p.to_tensor(meta.slot_mapping), qkv[:, heads:], overwrite=True)

        queries = p.zeros([batch * q_max, heads * dim], dtype=qkv.dtype)
        queries = p.scatter(queries, self._padded_rows, qkv[:, :heads].reshape([-1, heads * dim]))
        q = queries.reshape([batch, q_max, kv_heads, group, dim]).transpose([0, 2, 1, 3, 4])
        q = q.reshape([batch, kv_heads, q_max * group, dim])
        kv = p.gather(cache, self._key_slots).reshape([batch, k_max, 2 * kv_heads, dim]).transpose([0, 2, 1, 3])
        scores = p.matmul(q, kv[:, :kv_heads], transpose_y=True) + self._mask
        out = p.matmul(p.nn.functional.softmax(scores, axis=-1), kv[:, kv_heads:])
        out = out.reshape([batch, kv_heads, q_max, group, dim]).transpose([0, 2, 1, 3, 4])
        return p.gather(out.reshape([batch * q_max, heads * dim]), self._padded_rows)


@specdec.hookimpl
def specdec_register_attention_backends(register):
    register(PaddleAttention)
