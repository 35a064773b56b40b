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

    def setup(self, *, num_layers, num_heads, num_kv_heads, head_dim, dtype, rope_cos, rope_sin):
        self.paddle = require_paddle()
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.rope_cos, self.rope_sin = rope_cos, rope_sin
        self._caches: dict[int, list] = {}
        self._capacity: dict[int, int] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0

    def allocate(self, capacity: int) -> int:
        slot = self._free_slots.pop() if self._free_slots else self._next_slot
        self._next_slot = max(self._next_slot, slot + 1)
        shape = [2 * self.num_kv_heads, capacity, self.head_dim]
        self._caches[slot] = [self.paddle.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        self._capacity[slot] = capacity
        return slot

    def free(self, slot: int) -> None:
        if self._caches.pop(slot, None) is not None:
            del self._capacity[slot]
            self._free_slots.append(slot)

    @property
    def num_allocated(self) -> int:
        return len(self._caches)

    def _check_room(self, meta: AttentionMetadata) -> None:
        for q_len, ctx, slot in zip(meta.query_lens, meta.context_lens, meta.cache_slots):
            if ctx + q_len > self._capacity[slot]:
                raise ValueError(f"slot {slot}: {ctx + q_len} positions exceed its capacity {self._capacity[slot]}")

    def prepare(self, meta: AttentionMetadata, positions) -> None:
        """Per-step RoPE rows (identity on value heads) and one causal mask per request."""
        self._check_room(meta)
        p = self.paddle
        heads = self.num_heads + 2 * self.num_kv_heads
        rope_heads = self.num_heads + self.num_kv_heads
        cos = np.ones((len(positions), heads, self.head_dim), dtype=np.float32)
        sin = np.zeros_like(cos)
        cos[:, :rope_heads] = self.rope_cos[positions][:, None, :]
        sin[:, :rope_heads] = self.rope_sin[positions][:, None, :]
        self._cos, self._sin = p.to_tensor(cos), p.to_tensor(sin)
        self._masks = []
        for q_len, ctx, slot in zip(meta.query_lens, meta.context_lens, meta.cache_slots):
            visible = ctx + 1 + np.arange(q_len)  # row t sees positions < ctx + t + 1
            capacity = self._capacity[slot]
            mask = np.where(np.arange(capacity)[None, :] < visible[:, None], 0.0, -np.inf).astype(np.float32)
            # Query rows are ordered (t, g) inside each KV head: repeat each row G times.
            self._masks.append(p.to_tensor(np.repeat(mask, self.group, axis=0)))

    def forward(self, layer, qkv, meta: AttentionMetadata):
        p = self.paddle
        heads, kv_heads, group, dim = self.num_heads, self.num_kv_heads, self.group, self.head_dim
        qkv = qkv.reshape([-1, heads + 2 * kv_heads, dim])
        qkv = qkv * self._cos + p.roll(qkv, dim // 2, axis=-1) * self._sin
        outputs = []
        for b, (start, end) in enumerate(zip(meta.cu_seqlens_q[:-1], meta.cu_seqlens_q[1:])):
            rows = qkv if len(meta.query_lens) == 1 else qkv[start:end]
            q_len, ctx = end - start, meta.context_lens[b]
            cache = self._caches[meta.cache_slots[b]][layer]
            new_kv = rows[:, heads:]  # [T, 2*KVH, D]
            cache[:, ctx:ctx + q_len] = new_kv.transpose([1, 0, 2])
            q = rows[:, :heads].reshape([q_len, kv_heads, group, dim]).transpose([1, 0, 2, 3])
            q = q.reshape([kv_heads, q_len * group, dim])
            scores = p.matmul(q, cache[:kv_heads], transpose_y=True) + self._masks[b]
            out = p.matmul(p.nn.functional.softmax(scores, axis=-1), cache[kv_heads:])
            out = out.reshape([kv_heads, q_len, group, dim]).transpose([1, 0, 2, 3])
            outputs.append(out.reshape([q_len, heads * dim]))
        return outputs[0] if len(outputs) == 1 else p.concat(outputs, axis=0)


@specdec.hookimpl
def specdec_register_attention_backends(register):
    register(PaddleAttention)
