"""``cpu``: RoPE, the KV-cache write and causal attention in one CPU kernel call per request
and layer (``specdec_rope_attention`` in specdec.kernels.cpu). Same cache storage as the
``paddle`` reference backend, but keys are kept transposed and capacities are multiples of 8
(see the kernel); the tests compare its outputs with the reference backend's."""

from __future__ import annotations

import specdec
from specdec.attention import AttentionMetadata
from specdec.errors import SpecdecError

from .paddle_backend import PaddleAttention


class CpuAttention(PaddleAttention):
    NAME = "cpu"

    def setup(self, **kwargs):
        from specdec.kernels.cpu import KernelUnavailable, load_cpu_ops

        super().setup(**kwargs)
        try:
            self.ops = load_cpu_ops()
        except KernelUnavailable as exc:
            raise SpecdecError(f"attention_backend 'cpu': {exc}; use 'paddle'") from None
        self._cos_table = self.paddle.to_tensor(self.rope_cos)
        self._sin_table = self.paddle.to_tensor(self.rope_sin)

    def allocate(self, capacity: int) -> int:
        return super().allocate(-(-capacity // 8) * 8)

    def prepare(self, meta: AttentionMetadata, positions) -> None:
        self._check_room(meta)

    def forward(self, layer, qkv, meta: AttentionMetadata):
        attend = self.ops.specdec_rope_attention
        if len(meta.query_lens) == 1:
            cache = self._caches[meta.cache_slots[0]][layer]
            return attend(qkv, cache, self._cos_table, self._sin_table, meta.context_lens[0],
                          self.num_heads, self.num_kv_heads)
        outputs = []
        for b, (start, end) in enumerate(zip(meta.cu_seqlens_q[:-1], meta.cu_seqlens_q[1:])):
            cache = self._caches[meta.cache_slots[b]][layer]
            outputs.append(attend(qkv[start:end], cache, self._cos_table, self._sin_table,
                                  meta.context_lens[b], self.num_heads, self.num_kv_heads))
        return self.paddle.concat(outputs, axis=0)


@specdec.hookimpl
def specdec_register_attention_backends(register):
    register(CpuAttention)
