"""What a model-based proposer (MTP, EAGLE, Medusa, a draft model) gets from the engine.

:meth:`specdec.Proposer.setup` receives a :class:`ProposerContext` once, after the proposer is
built and before its first request: the target's shape and tokenizer, a :class:`TargetModel`
handle (embedding, final norm and LM head, shared with the target),
:meth:`ProposerContext.create_cache_layers`, which gives the proposer decoder layers of its own
over the engine's paged KV cache, and :meth:`ProposerContext.load_model`, which loads a whole
second model (a draft model, :class:`DraftModel`) on the engine's kernels with its own cache
over the same blocks. docs/plugins.md ("Model-based proposers") is the guide.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import attrs
import numpy as np

from .attention import AttentionBackend, AttentionMetadata


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

    def _quantized_embedding(self):
        """``(data, layout)``: the embedding table as the CPU kernels read it, or None when the
        target is not on the quantized kernels (for :class:`specdec.sdk.QuantizedDraftInput`)."""
        return getattr(getattr(self._model, "weights", None), "embedding_blocks", None)

    def logits(self, hidden_states):
        """``[n, V]`` logits of last-layer hidden states ``[n, H]`` (before the final norm),
        computed exactly as the target computes its own: the final RMSNorm, then the LM head."""
        return self._model.logits_of_hidden(hidden_states)


class DraftModel:
    """A second model a proposer runs (a draft model), loaded by
    :meth:`ProposerContext.load_model`.

    It runs on the target's kernels (quantized as its file stores it, unless the proposer
    asked otherwise), and its KV cache has a layer per draft layer over the target's block
    ids: position ``p`` of a request lives in block ``request.block_table[p // block_size]``
    for the draft as for the target, so the draft's rows are freed, dropped on preemption and
    prefix-shared with their request, and need no bookkeeping of the proposer's own. The rules
    of :meth:`ProposerContext.create_cache_layers` hold: write only positions the engine
    reserved this step, and a row at position ``p`` depends on tokens ``0 .. p`` only.

    :ivar name: what the user named the model (a path or an alias).
    :ivar config: the draft's shape (``num_layers``, ``hidden_size``, ...).
    :ivar tokenizer: the draft's tokenizer; the same vocabulary and special tokens as the
        target's (checked when loading).
    :ivar vocab_size: the width of :meth:`forward`'s logits: the *target's* vocabulary size,
        so that a column is the same token for both (a draft whose LM head is narrower gets
        ``-inf`` in the missing columns).
    """

    def __init__(self, model: Any, tokenizer: Any, name: str, vocab_size: int):
        self._model = model
        self.name = name
        self.config = model.config
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)

    def forward(self, token_ids: np.ndarray, meta: AttentionMetadata, logit_rows: np.ndarray) -> np.ndarray:
        """Run the draft over packed rows, as the target's forward does.

        :param token_ids: ``[T]`` int64, every request's new rows back to back.
        :param meta: ``AttentionMetadata.build(query_lens, context_lens, block_tables,
            block_size)`` for those rows (each request's rows start at its ``context_len``; its
            cache rows below that must hold the tokens before).
        :param logit_rows: ``[M]`` int64 indices of the rows whose logits are wanted.
        :returns: ``[M, vocab_size]`` float32 numpy logits.
        """
        logits = self._model.forward(np.ascontiguousarray(token_ids, dtype=np.int64), meta,
                                     np.asarray(logit_rows, dtype=np.int64))
        width = logits.shape[1]
        if width == self.vocab_size:
            return logits
        if width > self.vocab_size:
            return np.ascontiguousarray(logits[:, : self.vocab_size])
        out = np.full((logits.shape[0], self.vocab_size), -np.inf, dtype=np.float32)
        out[:, :width] = logits
        return out


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
    _load_model: Optional[Callable[..., DraftModel]] = attrs.field(default=None, repr=False, alias="load_model")

    def load_model(self, model: str, *, quantization: Optional[str] = None) -> DraftModel:
        """Load a draft model: a whole second decoder (GGUF file, Hugging Face checkpoint
        directory or alias) with a KV cache of its own over the engine's blocks.

        ``quantization`` as the engine's key: ``None`` or ``auto`` keeps a GGUF file's blocks
        on the quantized kernels (a float checkpoint stays float), ``wint8``/``wint4`` quantize
        a float one at load, ``none`` computes in float. The draft must tokenize as the target
        does: a different vocabulary or different special tokens is a one-line
        :class:`specdec.SpecdecError` naming both models, raised before the weights are read,
        as is a missing or non-GGUF file.

        Call it from ``setup``, once per model. Its cache memory comes on top of
        ``kv_cache_memory_gb`` (the draft's bytes per position against the target's); loading
        it clears the prefix cache, whose blocks hold no draft rows yet.
        """
        if self._load_model is None:
            from .errors import SpecdecError

            raise SpecdecError("this context cannot load models (it was made outside an engine)")
        return self._load_model(model, quantization)

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
