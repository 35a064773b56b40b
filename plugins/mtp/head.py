"""One MTP layer in paddle: ``h' = proj([enorm(embed(t)); hnorm(h)])``, a decoder layer whose
attention runs over the proposer's cache layer, then the LM head.

The row at position ``p`` is built from the hidden state at ``p - 1`` and the token at ``p``
(so it depends on tokens ``0 .. p`` only, as the shared prefix blocks require); its output
predicts the token at ``p + 1``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specdec.sdk import AttentionMetadata, QuantizedLinear, require_paddle

from .weights import MtpLayerWeights


class MtpHead:
    """The layer's weights and its forward. Each matrix is a callable ``x -> x @ W^T``: float32
    (``[in, out]`` paddle tensors), or with ``quantization`` (``wint8``, ``wint4``) quantized
    and run by the engine's quantized kernels (:class:`specdec.sdk.QuantizedLinear`)."""

    def __init__(self, weights: MtpLayerWeights, context: Any, cache_layers: Any, layer_index: int = 0,
                 quantization: str | None = None):
        paddle = require_paddle()
        self.paddle = paddle
        self.target = context.target
        self.eps = float(context.target.rms_norm_eps)
        self.cache = cache_layers
        self.layer_index = layer_index
        c = context.model_config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim

        def tensor(array: np.ndarray):
            return paddle.to_tensor(np.ascontiguousarray(array, dtype=np.float32))

        def linear(matrix: np.ndarray):  # [out, in] -> x @ matrix^T
            if quantization is not None:
                return QuantizedLinear(np.asarray(matrix, np.float32), quantization)
            transposed = tensor(matrix.T)
            return lambda x: paddle.matmul(x, transposed)

        d = weights.decoder
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
        self.final_norm = None if weights.final_norm is None else tensor(weights.final_norm)
        #: With a draft vocabulary: its token ids, and the LM head's rows for them with the final
        #: norm's gain folded in (``[K, H]``, contiguous: paddle's CPU matmul is 4x slower on a
        #: transposed view).
        self.draft_vocab = None
        if weights.draft_vocab is not None:
            vocab = np.asarray(weights.draft_vocab, dtype=np.int64)
            if vocab.max() >= c.vocab_size:
                from specdec.sdk import SpecdecError

                raise SpecdecError(f"speculative_config.model: draft vocabulary holds token id {vocab.max()}, "
                                   f"beyond the target's {c.vocab_size}")
            self.draft_vocab = vocab
            gain = self.final_norm if self.final_norm is not None else self.target.final_norm
            with paddle.no_grad():
                rows = paddle.gather(self.target.lm_head, paddle.to_tensor(vocab))
                self.vocab_head = rows * gain.unsqueeze(0)

    def _rms(self, x, gain=None):
        p = self.paddle
        x = x * p.rsqrt(p.mean(x * x, axis=-1, keepdim=True) + self.eps)
        return x if gain is None else x * gain

    def forward(self, token_ids: np.ndarray, hidden, meta: AttentionMetadata):
        """Rows for ``token_ids`` ``[T]`` with the previous positions' hidden states ``[T, H]``
        at the positions ``meta`` gives (their keys and values go to the cache layer); returns
        the layer's output ``[T, H]`` (before any final norm)."""
        p = self.paddle
        with p.no_grad():
            embeds = self.target.embed(token_ids)
            x = self.embed_proj(self._rms(embeds, self.enorm)) + self.hidden_proj(self._rms(hidden, self.hnorm))
            qkv = self.qkv(self._rms(x, self.attn_norm))
            if self.qkv_bias is not None:
                qkv = qkv + self.qkv_bias
            self.cache.prepare(meta)
            x = x + self.o(self.cache.forward(self.layer_index, qkv, meta))
            y = self._rms(x, self.mlp_norm)
            x = x + self.down(p.nn.functional.silu(self.gate(y)) * self.up(y))
        return x

    def logits(self, out):
        """``[T, V]`` logits of the layer's output (``[T, K]`` over the draft vocabulary when the
        head has one): its own final norm and the target's LM head, or, without one, the
        target's final norm and LM head."""
        p = self.paddle
        with p.no_grad():
            if self.draft_vocab is not None:
                return p.matmul(self._rms(out), self.vocab_head, transpose_y=True)
            if self.final_norm is None:
                return self.target.logits(out)
            return p.matmul(self._rms(out, self.final_norm), self.target.lm_head, transpose_y=True)

    def draft_tokens(self, out) -> np.ndarray:
        """``[T]`` int64: the token each output row drafts (the argmax of :meth:`logits`)."""
        best = self.paddle.argmax(self.logits(out), axis=-1).numpy().astype(np.int64)
        return best if self.draft_vocab is None else self.draft_vocab[best]
