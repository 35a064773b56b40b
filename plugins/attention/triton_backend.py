"""``triton``: RoPE, the paged KV-cache write and causal attention in Triton kernels, for GPUs.

Each layer's cache is ``[num_blocks, 2, KVH, block_size, D]`` of float32, float16 or bfloat16
(``kv_cache_dtype``): keys at ``[:, 0]``, values at ``[:, 1]``, one KV head's block a contiguous
``[block_size, D]`` tile; any block size that is a multiple of 8. ``prepare`` plans the step
once on the host (:func:`plan_attention`: which tiles of rows x query heads each program takes,
and whether to split long contexts over several programs, flash-decoding style) and puts the
index arrays on the device; ``forward`` is two launches per layer (three with split keys):
RoPE + cache write, then paged variable-length attention of the whole packed step (prefill
chunks and decode rows together), see ``specdec.kernels.triton.attention``.

It needs a CUDA device, or ``TRITON_INTERPRET=1`` (Triton's interpreter on the CPU: slow, for
tests); the tests compare it with its numpy twins and with dense causal attention.
"""

from __future__ import annotations


import specdec
from specdec.sdk import AttentionMetadata, KernelUnavailable, SpecdecError, load_triton_kernels, require_paddle

CACHE_DTYPES = ("float32", "float16", "bfloat16")


class TritonAttention(specdec.AttentionBackend):
    NAME = "triton"

    def setup(self, *, num_layers, num_heads, num_kv_heads, head_dim, dtype, rope_cos, rope_sin):
        self.paddle = require_paddle()
        if dtype not in CACHE_DTYPES:
            raise SpecdecError(f"kv_cache_dtype: attention_backend 'triton' keeps float32, float16 or bfloat16, "
                               f"got {dtype}")
        try:
            self.kernels = load_triton_kernels().attention
        except KernelUnavailable as exc:
            raise SpecdecError(f"attention_backend 'triton': {exc}") from None
        if num_heads % num_kv_heads or head_dim % 2:
            raise SpecdecError(f"attention_backend 'triton' needs num_heads a multiple of num_kv_heads and an even "
                               f"head_dim, got {num_heads}, {num_kv_heads}, {head_dim}")
        super().setup(num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      dtype=dtype, rope_cos=rope_cos, rope_sin=rope_sin)
        p = self.paddle
        self._cos_table = p.to_tensor(rope_cos, dtype="float32")
        self._sin_table = p.to_tensor(rope_sin, dtype="float32")
        self._target_programs = self.kernels.DEFAULT_TARGET_PROGRAMS
        if p.is_compiled_with_cuda() and p.device.cuda.device_count() > 0:
            # Two programs per SM keep the GPU busy: fewer tiles than that split the keys.
            self._target_programs = 2 * p.device.cuda.get_device_properties().multi_processor_count

    def init_cache(self, num_blocks: int, block_size: int) -> None:
        if block_size % 8 or block_size <= 0:
            raise SpecdecError(f"block_size: the triton attention backend needs a multiple of 8, got {block_size}")
        self.block_size = block_size
        shape = [num_blocks, 2, self.num_kv_heads, block_size, self.head_dim]
        self._caches = [self.paddle.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]

    def export_blocks(self, block_ids):
        """Per layer ``[len(block_ids), 2, KVH, block_size, D]``, copied to the host (a bfloat16
        cache comes as its ``uint16`` bits, as paddle hands bfloat16 to numpy)."""
        return self._export_leading_blocks(self._caches, block_ids)

    def import_blocks(self, block_ids, data):
        self._import_leading_blocks(self._caches, block_ids, data)

    def prepare(self, meta: AttentionMetadata) -> None:
        """The step's plan, and its index tensors on the device."""
        if int((meta.context_lens + meta.query_lens).max()) > meta.block_tables.shape[1] * self.block_size:
            raise ValueError("attention: a request's positions exceed its block table")
        p = self.paddle
        self._plan = self.kernels.plan_attention(
            meta.query_lens, meta.context_lens, block_size=self.block_size, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            cache_dtype=self.dtype, target_programs=self._target_programs).place(self._cos_table)
        self._tables = p.to_tensor(meta.block_tables.astype("int32"))
        self._positions = p.to_tensor(meta.positions.astype("int64"))
        self._slots = p.to_tensor(meta.slot_mapping.astype("int64"))
        self._query = p.empty([meta.num_rows, self.num_heads, self.head_dim], dtype="float32")

    def forward(self, layer, qkv, meta: AttentionMetadata):
        cache = self._caches[layer]
        query = self.kernels.rope_and_cache_write(qkv, cache, self._cos_table, self._sin_table, self._positions,
                                                  self._slots, self.num_heads, self.num_kv_heads,
                                                  query_out=self._query)
        return self.kernels.paged_attention(query, cache, self._tables, self._plan)


@specdec.hookimpl
def specdec_register_attention_backends(register):
    register(TritonAttention)
