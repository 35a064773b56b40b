"""``cpu``: RoPE, the paged KV-cache write and causal attention of the whole packed batch in
one CPU kernel call per layer (``specdec_paged_attention`` in specdec.kernels.cpu).

Each layer's cache is ``[num_blocks, 2*KVH, block_size, D]`` of float32 or float16
(``kv_cache_dtype``; the kernel computes in float32 either way) with keys stored in transposed
tiles of 8 positions (see the kernel and its numpy twin ``reference.paged_attention``); the
tests compare this backend with the ``paddle`` reference backend.
"""

from __future__ import annotations

import ctypes

import numpy as np

import specdec
from specdec.sdk import (AttentionMetadata, KernelUnavailable, SpecdecError, load_cpu_ops, pack_attention_metadata,
                         require_paddle)


#: Metadata tensors kept, one per shape ``[requests, 2 + blocks]``: a decoding batch's shape
#: changes slowly (a request joins, a table grows by a block), so a few dozen cover it.
MAX_METADATA_SHAPES = 32


#: The largest head the kernel takes (kMaxHeadDim in specdec_cpu_ops.cc: its score passes copy a
#: block's queries into a buffer on the stack).
MAX_HEAD_DIM = 256


class CpuAttention(specdec.AttentionBackend):
    NAME = "cpu"

    def setup(self, *, num_layers, num_heads, num_kv_heads, head_dim, dtype, rope_cos, rope_sin):
        self.paddle = require_paddle()
        try:
            self.ops = load_cpu_ops()
        except KernelUnavailable as exc:
            raise SpecdecError(f"attention_backend 'cpu': {exc}; use 'paddle'") from None
        if head_dim > MAX_HEAD_DIM:
            raise SpecdecError(f"attention_backend 'cpu': heads of at most {MAX_HEAD_DIM} elements, this model's have "
                               f"{head_dim}; use 'paddle'")
        if dtype not in ("float32", "float16"):
            raise SpecdecError(f"kv_cache_dtype: attention_backend 'cpu' keeps float32 or float16, got {dtype}")
        super().setup(num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      dtype=dtype, rope_cos=rope_cos, rope_sin=rope_sin)
        self._cos_table = self.paddle.to_tensor(rope_cos)
        self._sin_table = self.paddle.to_tensor(rope_sin)
        #: (tensor, numpy view of its memory) by metadata shape (:meth:`_metadata_tensor`).
        self._metadata_tensors: dict[tuple, tuple] = {}

    def init_cache(self, num_blocks: int, block_size: int) -> None:
        if block_size % 8:
            raise SpecdecError(f"block_size: the cpu attention backend needs a multiple of 8, got {block_size}")
        shape = [num_blocks, 2 * self.num_kv_heads, block_size, self.head_dim]
        # Uninitialised: the kernel reads only positions that a step has written (scores of
        # the padding inside a tile of 8 are computed but never used).
        self._caches = [self.paddle.empty(shape, dtype=self.dtype) for _ in range(self.num_layers)]

    def export_blocks(self, block_ids):
        """Per layer ``[len(block_ids), 2*KVH, block_size, D]`` (keys in their tiles of 8, as stored)."""
        return self._export_leading_blocks(self._caches, block_ids)

    def import_blocks(self, block_ids, data):
        self._import_leading_blocks(self._caches, block_ids, data)

    def prepare(self, meta: AttentionMetadata) -> None:
        self._meta = self._metadata_tensor(pack_attention_metadata(meta.block_tables, meta.cu_seqlens_q,
                                                                   meta.context_lens))

    def _metadata_tensor(self, packed: np.ndarray):
        """``packed`` in a paddle tensor without a paddle call: one int32 tensor per shape,
        written through a numpy view of its memory. A ``to_tensor`` per step cost 15-50 us (more
        once the step's weights have evicted paddle's code from the caches), which an MTP
        head's step pays twice. The kernel reads the tensor during this step's ``forward``
        calls only (CPU ops run synchronously), so the next ``prepare`` may overwrite it."""
        if packed.size == 0:
            return self.paddle.to_tensor(packed)
        entry = self._metadata_tensors.get(packed.shape)
        if entry is None:
            tensor = self.paddle.empty(list(packed.shape), dtype="int32")
            memory = (ctypes.c_int32 * packed.size).from_address(tensor.data_ptr())
            if len(self._metadata_tensors) >= MAX_METADATA_SHAPES:
                self._metadata_tensors.pop(next(iter(self._metadata_tensors)))
            entry = self._metadata_tensors[packed.shape] = (tensor, np.ctypeslib.as_array(memory).reshape(packed.shape))
        tensor, view = entry
        view[...] = packed
        return tensor

    def forward(self, layer, qkv, meta: AttentionMetadata):
        return self.ops.specdec_paged_attention(qkv, self._caches[layer], self._cos_table, self._sin_table,
                                                self._meta, self.num_heads, self.num_kv_heads)

    def kernel_operands(self) -> tuple | None:
        """What ``specdec_paged_attention`` takes besides the layer's q/k/v, for this step (after
        :meth:`prepare`): ``(caches, cos, sin, meta, num_heads, num_kv_heads)``, the caches one
        per layer. A quantized model then runs its whole pass, this attention included, in one
        native call (``specdec_q_forward``), the same calls as ``forward`` layer by
        layer. None for a subclass with a ``forward`` of its own, which must then be called."""
        if type(self).forward is not CpuAttention.forward:
            return None
        return self._caches, self._cos_table, self._sin_table, self._meta, self.num_heads, self.num_kv_heads


@specdec.hookimpl
def specdec_register_attention_backends(register):
    register(CpuAttention)
