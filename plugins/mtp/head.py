"""One MTP layer: ``h' = proj([enorm(embed(t)); hnorm(h)])``, a decoder layer whose attention
runs over the proposer's cache layer, then the LM head; on the quantized CPU kernels through the
public SDK (``QuantizedDraftInput``, ``QuantizedDecoderLayer``, ``QuantizedLinear``: the input
with the layer's q/k/v, the cache layer's attention, the layer's output with the LM head over
the rows that draft; ``QuantizedDraftHead`` runs the three in one native call), or in float32
eager paddle ops.

The row at position ``p`` is built from the hidden state at ``p - 1`` and the token at ``p``
(so it depends on tokens ``0 .. p`` only, as the shared prefix blocks require); its output
predicts the token at ``p + 1``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specdec.sdk import (AttentionMetadata, QuantizedDecoderLayer, QuantizedDraftHead, QuantizedDraftInput,
                         QuantizedLinear, SpecdecError, require_paddle)

from .weights import MtpLayerWeights


class MtpHead:
    """The layer's weights and its forward, on one of two paths:

    - ``quantization`` ``wint8`` or ``wint4`` (what the ``mtp`` proposer runs, ``wint4`` unless
      its config says otherwise): the engine's fast path, one native call per forward
      (:class:`specdec.sdk.QuantizedDraftHead`) over a quantized target and the ``cpu``
      attention backend, else three:
      ``input`` is a :class:`specdec.sdk.QuantizedDraftInput` (the target's embedding rows,
      ``enorm``/``hnorm``, both projections, their sum and the layer's q/k/v in one call), the
      decoder layer a :class:`specdec.sdk.QuantizedDecoderLayer` whose ``output`` also runs the
      LM head (a ``QuantizedLinear`` with the final norm's gain, over the draft vocabulary when
      the head has one) on the rows that draft, in the same call.
    - ``quantization`` None: float32, eager paddle ops (``[in, out]`` tensors): the reference
      the training code is checked against (``tests/e2e/test_mtp_chained_training.py``).
    """

    def __init__(self, weights: MtpLayerWeights, context: Any, cache_layers: Any, layer_index: int = 0,
                 quantization: str | None = None):
        paddle = require_paddle()
        self.paddle = paddle
        self.target = context.target
        self.eps = float(context.target.rms_norm_eps)
        self.cache = cache_layers
        self.layer_index = layer_index
        self.quantization = quantization
        c = context.model_config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim

        def tensor(array: np.ndarray):
            return paddle.to_tensor(np.ascontiguousarray(array, dtype=np.float32))

        self.final_norm = None if weights.final_norm is None else tensor(weights.final_norm)
        self.draft_vocab = None
        if weights.draft_vocab is not None:
            vocab = np.asarray(weights.draft_vocab, dtype=np.int64)
            if vocab.max() >= c.vocab_size:
                from specdec.sdk import SpecdecError

                raise SpecdecError(f"speculative_config.model: draft vocabulary holds token id {vocab.max()}, "
                                   f"beyond the target's {c.vocab_size}")
            self.draft_vocab = vocab
        d = weights.decoder
        self.fused = None  # the quantized path's one call (_init_quantized)
        if quantization is not None:
            self._init_quantized(weights, quantization)
            return
        #: The float path: each matrix a callable ``x -> x @ W^T``.
        self.layer = None

        def linear(matrix: np.ndarray):  # [out, in] -> x @ matrix^T
            transposed = tensor(matrix.T)
            return lambda x: paddle.matmul(x, transposed)

        scale = self.head_dim ** -0.5
        self.enorm, self.hnorm = tensor(weights.enorm), tensor(weights.hnorm)
        self.embed_proj, self.hidden_proj = linear(weights.embed_proj), linear(weights.hidden_proj)
        self.attn_norm = tensor(d["input_layernorm.weight"])
        self.qkv = linear(np.concatenate([d["self_attn.q_proj.weight"] * scale, d["self_attn.k_proj.weight"],
                                          d["self_attn.v_proj.weight"]]))
        self.qkv_bias = None
        if "self_attn.q_proj.bias" in d:
            self.qkv_bias = tensor(np.concatenate([d["self_attn.q_proj.bias"] * scale, d["self_attn.k_proj.bias"],
                                                   d["self_attn.v_proj.bias"]]))
        self.o = linear(d["self_attn.o_proj.weight"])
        self.mlp_norm = tensor(d["post_attention_layernorm.weight"])
        self.gate, self.up = linear(d["mlp.gate_proj.weight"]), linear(d["mlp.up_proj.weight"])
        self.down = linear(d["mlp.down_proj.weight"])
        #: With a draft vocabulary: the LM head's rows for it with the final norm's gain folded
        #: in (``[K, H]``, contiguous: paddle's CPU matmul is 4x slower on a transposed view).
        if self.draft_vocab is not None:
            gain = self.final_norm if self.final_norm is not None else self.target.final_norm
            with paddle.no_grad():
                rows = paddle.gather(self.target.lm_head, paddle.to_tensor(self.draft_vocab))
                self.vocab_head = rows * gain.unsqueeze(0)

    def _init_quantized(self, weights: MtpLayerWeights, method: str) -> None:
        """The fast path's matrices, quantized with ``method`` (see the class docstring)."""
        c, eps = self, self.eps
        self.input = QuantizedDraftInput(self.target, weights.embed_proj, weights.hidden_proj, method,
                                         embed_gain=weights.enorm, hidden_gain=weights.hnorm, eps=eps)
        self.layer = QuantizedDecoderLayer(weights.decoder, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                                           head_dim=c.head_dim, eps=eps, method=method)
        #: The LM head with its final norm in one call: the head's own final norm, else the
        #: target's; over the draft vocabulary's rows when the head has one. Without either a
        #: draft vocabulary or a final norm of its own the head calls ``target.logits``, the
        #: target's own (native when the target is quantized).
        self.lm_head = None
        if self.draft_vocab is not None or self.final_norm is not None:
            gain = self.final_norm if self.final_norm is not None else self.target.final_norm
            rows = np.asarray(self.target.lm_head, np.float32)
            if self.draft_vocab is not None:
                rows = rows[self.draft_vocab]
            self.lm_head = QuantizedLinear(rows, method, norm_gain=np.asarray(gain, np.float32), eps=eps)
        #: The three calls in one (QuantizedDraftHead), where the target is quantized and the
        #: head has its LM head here.
        if self.lm_head is not None:
            try:
                self.fused = QuantizedDraftHead(self.input, self.layer, self.lm_head)
            except SpecdecError:  # a float target: the three calls
                pass

    def _rms(self, x, gain=None):
        p = self.paddle
        x = x * p.rsqrt(p.mean(x * x, axis=-1, keepdim=True) + self.eps)
        return x if gain is None else x * gain

    def forward(self, token_ids: np.ndarray, hidden, meta: AttentionMetadata, logit_rows=None):
        """Rows for ``token_ids`` ``[T]`` with the previous positions' hidden states ``[T, H]``
        at the positions ``meta`` gives (their keys and values go to the cache layer); returns
        the layer's output ``[T, H]`` (before any final norm) and the :meth:`logits` of its rows
        ``logit_rows`` (indices into the ``T`` rows; None: no logits): ``(output, logits)``."""
        if self.fused is not None:  # one native call: no autograd to turn off (no_grad costs us too)
            out, logits = self.fused.forward(token_ids, hidden, self.cache, self.layer_index, meta,
                                             () if logit_rows is None else logit_rows)
            return out, None if logit_rows is None else logits
        p = self.paddle
        with p.no_grad():
            if self.layer is not None:
                x, qkv = self.input(token_ids, hidden, self.layer)
                self.cache.prepare(meta)
                attn = self.cache.forward(self.layer_index, qkv, meta)
                if logit_rows is not None and self.lm_head is not None:
                    return self.layer.output(attn, x, head=self.lm_head, rows=logit_rows)
                out = self.layer.output(attn, x)
            else:
                embeds = self.target.embed(token_ids)
                x = self.embed_proj(self._rms(embeds, self.enorm)) + self.hidden_proj(self._rms(hidden, self.hnorm))
                qkv = self.qkv(self._rms(x, self.attn_norm))
                if self.qkv_bias is not None:
                    qkv = qkv + self.qkv_bias
                self.cache.prepare(meta)
                x = x + self.o(self.cache.forward(self.layer_index, qkv, meta))
                y = self._rms(x, self.mlp_norm)
                out = x + self.down(p.nn.functional.silu(self.gate(y)) * self.up(y))
        return out, None if logit_rows is None else self.logits(rows_of(p, out, np.asarray(logit_rows, np.int64)))

    def start(self, token_ids: np.ndarray, hidden, meta: AttentionMetadata, logit_rows=None):
        """:meth:`forward` on the kernels' worker thread (``QuantizedDraftHead.start``): a
        ``PendingDraftHead`` whose ``result()`` is what :meth:`forward` returns. Needs the one
        native call (``fused``)."""
        return self.fused.start(token_ids, hidden, self.cache, self.layer_index, meta,
                                () if logit_rows is None else logit_rows)

    def prepare_start(self, block_size: int) -> None:
        """Ready :meth:`start` ahead of its first call (``QuantizedDraftHead.prepare_start``)."""
        self.fused.prepare_start(self.cache, self.layer_index, block_size)

    def logits(self, out):
        """``[T, V]`` logits of the layer's output (``[T, K]`` over the draft vocabulary when the
        head has one): its own final norm and the target's LM head, or, without one, the
        target's final norm and LM head."""
        p = self.paddle
        with p.no_grad():
            if self.layer is not None:
                return self.target.logits(out) if self.lm_head is None else self.lm_head(out)
            if self.draft_vocab is not None:
                return p.matmul(self._rms(out), self.vocab_head, transpose_y=True)
            if self.final_norm is None:
                return self.target.logits(out)
            return p.matmul(self._rms(out, self.final_norm), self.target.lm_head, transpose_y=True)

    def draft_tokens(self, logits) -> np.ndarray:
        """``[T]`` int64: the token each row of :meth:`logits` drafts (its argmax, mapped to the
        target's vocabulary)."""
        best = np.asarray(logits).argmax(axis=-1).astype(np.int64)  # one copy, no paddle op
        return best if self.draft_vocab is None else self.draft_vocab[best]


def rows_of(p, x, rows: np.ndarray):
    """``x[rows]`` with as few paddle ops as the rows allow (each op costs tens of us on a CPU):
    none when they are all of ``x``, a slice when they are consecutive, else a gather."""
    if len(rows) == x.shape[0] and np.array_equal(rows, np.arange(len(rows))):
        return x
    if np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows))):
        return x[int(rows[0]):int(rows[0]) + len(rows)]
    return p.gather(x, p.to_tensor(rows))
