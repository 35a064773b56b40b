"""What a model-based proposer (MTP, EAGLE, Medusa, a draft model) gets from the engine.

:meth:`specdec.Proposer.setup` receives a :class:`ProposerContext` once, after the proposer is
built and before its first request: the target's shape and tokenizer, a :class:`TargetModel`
handle (embedding, final norm and LM head, shared with the target), and
:meth:`ProposerContext.create_cache_layers`, which gives the proposer decoder layers of its own
over the engine's paged KV cache. docs/plugins.md ("Model-based proposers") is the guide.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import attrs

from .attention import AttentionBackend


class TargetModel:
    """A read-only handle on the target model's shared weights.

    ``embed`` and ``logits`` take numpy arrays or paddle tensors and return float32 paddle
    tensors on the model's device (``numpy.asarray`` of them works). The weight properties are
    the target's own tensors, not copies: read them, never write them.
    """

    def __init__(self, model: Any):
        self._model = model

    @property
    def embedding(self):
        """``[V, H]`` float32 paddle tensor: the token embedding."""
        return self._model.embed

    @property
    def final_norm(self):
        """``[H]`` float32 paddle tensor: the gain of the final RMSNorm (applied before the LM head)."""
        return self._model.final_norm

    @property
    def lm_head(self):
        """``[V, H]`` float32 paddle tensor: the LM head (the embedding when the model ties them).
        The target computes ``logits = rms_norm(h) * final_norm @ lm_head.T``."""
        return self._model.lm_head_weight

    @property
    def rms_norm_eps(self) -> float:
        return self._model.config.rms_norm_eps

    def embed(self, token_ids):
        """``[n, H]`` embeddings of ``token_ids`` (``[n]`` int64)."""
        return self._model.embed_tokens(token_ids)

    def logits(self, hidden_states):
        """``[n, V]`` logits of last-layer hidden states ``[n, H]`` (before the final norm),
        computed exactly as the target computes its own: the final RMSNorm, then the LM head."""
        return self._model.logits_of_hidden(hidden_states)


@attrs.define(slots=True)
class ProposerContext:
    """What :meth:`specdec.Proposer.setup` receives.

    :ivar model_name: the target's known name (such as ``smollm2-135m-instruct``) when the
        engine config names it by alias or by the path of that model's file, else the path, for
        a proposer that ships weights per target.
    :ivar model_config: the target's shape (``hidden_size``, ``vocab_size``, ``num_layers``,
        ``num_heads``, ``num_kv_heads``, ``head_dim``, ``intermediate_size``, ``rms_norm_eps``,
        ``rope_theta``, ...).
    :ivar tokenizer: the target's tokenizer (``encode``, ``decode``, ``eos_token_ids``).
    :ivar target: the :class:`TargetModel` handle.
    :ivar block_size: positions per block of the paged KV cache (see ``ProposalRequest.block_table``).
    :ivar num_blocks: blocks in the pool; block ids are ``0 .. num_blocks - 1``.
    """

    model_name: str
    model_config: Any
    tokenizer: Any
    target: TargetModel
    block_size: int
    num_blocks: int
    _create_cache_layers: Callable[..., AttentionBackend] = attrs.field(repr=False, alias="create_cache_layers")
    _create_proposer: Optional[Callable[..., Any]] = attrs.field(default=None, repr=False, alias="create_proposer")

    def create_proposer(self, method: str, **keys: Any) -> Any:
        """Another registered proposer, built and set up, for a method that composes others
        (``hybrid``: a model proposer, then a lookup proposer).

        ``method`` is its ``NAME``; ``keys`` are flat keys of its own ``Config``. It gets the
        speculative config of the composing method with ``method`` changed:
        ``num_speculative_tokens`` and the model keys it reads (``num_model_steps``, ``model``,
        ``quantization``). Its :meth:`setup` runs with this
        context. The composing method owns it: it calls its ``propose`` and lifecycle methods
        itself. Raises :class:`specdec.SpecdecError` (one line) for an unknown method or a bad key.
        """
        if self._create_proposer is None:
            from .errors import SpecdecError

            raise SpecdecError("this context cannot build proposers (it was made outside an engine)")
        return self._create_proposer(self, method, keys)

    def create_cache_layers(self, num_layers: int, *, num_heads: Optional[int] = None,
                            num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None) -> AttentionBackend:
        """Decoder layers of the proposer's own over the engine's paged KV cache.

        Returns an attention backend of the engine's kind, already set up (``num_layers``
        layers; heads and head size default to the target's; the target's RoPE tables and
        cache dtype) and with its cache allocated with the target's block geometry. Its blocks
        are the target's: position ``p`` of a request lives in block
        ``request.block_table[p // block_size]`` for the draft layers as for the target's, so
        the draft rows of a request are freed with it, dropped with it when it is preempted,
        and shared with every request that shares its prompt prefix. Use it as the target's
        layers use theirs: build ``specdec.AttentionMetadata.build(query_lens, context_lens,
        block_tables, block_size)`` for the rows you compute, call ``prepare(meta)`` once, then
        ``forward(layer, qkv, meta)`` per layer (``qkv`` before RoPE, queries pre-scaled by
        ``1/sqrt(head_dim)``).

        Rules that keep it correct:

        - Write only positions the engine reserved: below ``len(token_ids) +
          max_draft_len`` of this step's ``ProposalRequest``.
        - A draft row at position ``p`` may depend on tokens ``0 .. p`` only (never on
          ``p + 1``): shared prefix blocks are shared by token content. MTP and EAGLE store the
          row made from ``(hidden state at p - 1, token p)`` at position ``p``.
        - Rows past a request's accepted tokens are simply overwritten later, as the target's.

        Call it from ``setup``, once. Its memory comes on top of ``kv_cache_memory_gb`` (one
        draft layer costs ``1 / num_layers`` of the target's cache). Creating it clears the
        prefix cache, whose blocks hold no draft rows yet.
        """
        return self._create_cache_layers(num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                         head_dim=head_dim)
