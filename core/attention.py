"""The attention backend contract (see ``specdec_register_attention_backends``)."""

from __future__ import annotations

from typing import ClassVar

import attrs


@attrs.define(slots=True)
class AttentionMetadata:
    """Where the packed query rows of one step sit; built once per step by the engine.

    :ivar query_lens: per request, how many new rows it has in the packed batch.
    :ivar context_lens: per request, how many tokens its KV cache holds before this step; its
        new rows take positions ``context_lens[b] .. context_lens[b] + query_lens[b] - 1``.
    :ivar cache_slots: per request, the handle :meth:`AttentionBackend.allocate` returned.
    :ivar cu_seqlens_q: ``[B + 1]`` offsets of each request's rows in the packed array.
    """

    query_lens: list[int]
    context_lens: list[int]
    cache_slots: list[int]
    cu_seqlens_q: list[int] = attrs.field(init=False)

    def __attrs_post_init__(self):
        offsets = [0]
        for n in self.query_lens:
            offsets.append(offsets[-1] + n)
        self.cu_seqlens_q = offsets


class AttentionBackend:
    """Base class of attention backends: owns the KV cache and computes causal attention.

    Lifecycle: ``setup`` once per engine with the model's shape and RoPE tables; ``allocate``
    when a request starts (``capacity`` = the most positions it can reach) and ``free`` when it
    ends; ``prepare`` once per step with that step's metadata; ``forward`` once per layer per
    step. The backend applies RoPE, so that a fused kernel can do RoPE, the cache write and
    attention in one pass.
    Rows a step later rejects are not removed: the next step simply overwrites them, because
    every request's visible length is its ``context_lens`` entry.
    """

    NAME: ClassVar[str] = ""

    def __init__(self, config=None, engine_config=None):
        self.config = config
        self.engine_config = engine_config

    def setup(self, *, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
              dtype: str, rope_cos, rope_sin) -> None:
        """Remember the model's shape. ``rope_cos``/``rope_sin`` are ``[max_positions, D]``
        float32 numpy tables: ``rope(x) = x * cos + roll(x, D/2) * sin`` (rotate-half RoPE,
        the sign folded into ``sin``)."""
        raise NotImplementedError

    def allocate(self, capacity: int) -> int:
        """Reserve a cache able to hold ``capacity`` positions; return its slot handle."""
        raise NotImplementedError

    def free(self, slot: int) -> None:
        """Release a slot (the request finished or was cancelled)."""
        raise NotImplementedError

    def prepare(self, meta: AttentionMetadata, positions) -> None:
        """Build per-step state shared by all layers (masks, RoPE rows); ``positions`` is the
        ``[T]`` int64 numpy position of every packed row."""

    def forward(self, layer: int, qkv, meta: AttentionMetadata):
        """Attention of one layer over the packed rows of a step.

        :param qkv: ``[T, (H + 2*KVH) * D]`` float32 paddle tensor: the query heads, then the key
            heads, then the value heads of every packed row, before RoPE; queries are
            pre-scaled by ``1/sqrt(D)``.
        :returns: ``[T, H*D]``, each row's attention output (heads concatenated).
        The backend applies RoPE to queries and keys, stores the rows' keys and values at their
        positions in the cache, then attends causally.
        """
        raise NotImplementedError
