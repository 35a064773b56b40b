"""``paddle``: the reference attention backend (plain paddle ops, one contiguous cache per request).

Each request owns a ``[layers][2*KVH, capacity, D]`` cache (key heads, then value heads) sized
for the most positions it can reach. Attention runs over the whole capacity with an additive
mask: keeping the operands contiguous is far cheaper on CPU than slicing the live prefix,
which would copy it every layer.
"""

from __future__ import annotations

import numpy as np

import specdec
from specdec.attention import AttentionMetadata
from specdec.errors import require_paddle


class PaddleAttention(specdec.AttentionBackend):
    NAME = "paddle"

    def setup(self, *, num_layers, num_heads, num_kv_heads, head_dim, dtype):
        self.paddle = require_paddle()
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self._caches: dict[int, list] = {}
        self._capacity: dict[int, int] = {}
        self._next_slot = 0
        self._masks: list = []

    def allocate(self, capacity: int) -> int:
        slot = self._next_slot
        self._next_slot += 1
        shape = [2 * self.num_kv_heads, capacity, self.head_dim]
        self._caches[slot] = [self.paddle.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        self._capacity[slot] = capacity
        return slot

    def free(self, slot: int) -> None:
        self._caches.pop(slot, None)
        self._capacity.pop(slot, None)

    def capacity(self, slot: int) -> int:
        return self._capacity[slot]

    def prepare(self, meta: AttentionMetadata) -> None:
        """One additive causal mask per request, ``[T*G, capacity]``, shared by all layers."""
        self._masks = []
        for q_len, ctx, slot in zip(meta.query_lens, meta.context_lens, meta.cache_slots):
            capacity = self._capacity[slot]
            if ctx + q_len > capacity:
                raise ValueError(f"slot {slot}: {ctx + q_len} positions exceed its capacity {capacity}")
            visible = ctx + 1 + np.arange(q_len)  # row t sees positions < ctx + t + 1
            mask = np.where(np.arange(capacity)[None, :] < visible[:, None], 0.0, -np.inf).astype(np.float32)
            # Query rows are ordered (t, g) inside each KV head: repeat each row G times.
            self._masks.append(self.paddle.to_tensor(np.repeat(mask, self.group, axis=0)))

    def forward(self, layer, qkv, meta: AttentionMetadata):
        p = self.paddle
        heads, kv_heads, group, dim = self.num_heads, self.num_kv_heads, self.group, self.head_dim
        outputs = []
        for b, (start, end) in enumerate(zip(meta.cu_seqlens_q[:-1], meta.cu_seqlens_q[1:])):
            rows = qkv if len(meta.query_lens) == 1 else qkv[start:end]
            q_len, ctx = end - start, meta.context_lens[b]
            cache = self._caches[meta.cache_slots[b]][layer]
            new_kv = rows[:, heads:]  # [T, 2*KVH, D]
            cache[:, ctx:ctx + q_len] = new_kv.transpose([1, 0, 2]) if q_len > 1 else new_kv.reshape([2 * kv_heads, 1, dim])
            q = rows[:, :heads].reshape([q_len, kv_heads, group, dim])
            if q_len > 1:
                q = q.transpose([1, 0, 2, 3])
            q = q.reshape([kv_heads, q_len * group, dim])
            scores = p.matmul(q, cache[:kv_heads], transpose_y=True) + self._masks[b]
            out = p.matmul(p.nn.functional.softmax(scores, axis=-1), cache[kv_heads:])
            if q_len > 1:
                out = out.reshape([kv_heads, q_len, group, dim]).transpose([1, 0, 2, 3])
            outputs.append(out.reshape([q_len, heads * dim]))
        return outputs[0] if len(outputs) == 1 else p.concat(outputs, axis=0)


@specdec.hookimpl
def specdec_register_attention_backends(register):
    register(PaddleAttention)
