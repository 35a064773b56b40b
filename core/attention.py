"""The attention backend contract (see ``specdec_register_attention_backends``)."""

from __future__ import annotations

from typing import ClassVar

import attrs


@attrs.define(slots=True)
class AttentionMetadata:
    """Where the packed query rows of one step sit.

    :ivar query_lens: per request, how many new rows it has in the packed batch.
    :ivar context_lens: per request, how many tokens its KV cache holds before this step; its
        new rows take positions ``context_lens[b] .. context_lens[b] + query_lens[b] - 1``.
    :ivar cache_slots: per request, the index of its KV cache in the backend's cache pool.
    """

    query_lens: list[int]
    context_lens: list[int]
    cache_slots: list[int]


class AttentionBackend:
    """Base class of attention backends.

    A backend owns the KV cache layout. ``allocate`` is called once per engine;
    ``forward`` once per layer per step with the packed rows of every request in the batch:
    it writes their keys and values into the cache at their positions, then returns causal
    attention of each request's new rows over its cached keys (its own earlier rows included).
    Rows a step later rejects are simply overwritten by the next step.
    """

    NAME: ClassVar[str] = ""

    def __init__(self, config=None, engine_config=None):
        self.config = config
        self.engine_config = engine_config

    def allocate(self, *, num_layers: int, num_kv_heads: int, head_dim: int, max_model_len: int,
                 num_slots: int, dtype: str) -> None:
        raise NotImplementedError

    def forward(self, layer: int, q, k, v, meta: AttentionMetadata):
        """``q`` is ``[T, H, D]``, ``k``/``v`` are ``[T, KVH, D]`` over all packed rows; returns ``[T, H*D]``."""
        raise NotImplementedError

    def free(self, slot: int) -> None:
        """Release the cache of a finished request (its slot may be reused)."""
