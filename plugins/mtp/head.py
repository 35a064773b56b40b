"""One MTP layer in paddle: ``h' = proj([enorm(embed(t)); hnorm(h)])``, a decoder layer whose
attention runs over the proposer's cache layer, then the LM head.

The row at position ``p`` is built from the hidden state at ``p - 1`` and the token at ``p``
(so it depends on tokens ``0 .. p`` only, as the shared prefix blocks require); its output
predicts the token at ``p + 1``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specdec.sdk import AttentionMetadata, require_paddle

from .weights import MtpLayerWeights


class MtpHead:
    """The layer's weights as paddle tensors (``[in, out]`` for ``x @ W``) and its forward."""

    def __init__(self, weights: MtpLayerWeights, context: Any, cache_layers: Any, layer_index: int = 0):
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

        d = weights.decoder
        scale = self.head_dim ** -0.5
        self.enorm, self.hnorm = tensor(weights.enorm), tensor(weights.hnorm)
        self.embed_proj, self.hidden_proj = tensor(weights.embed_proj.T), tensor(weights.hidden_proj.T)
        self.attn_norm = tensor(d["input_layernorm.weight"])
        self.qkv = tensor(np.concatenate([d["self_attn.q_proj.weight"] * scale, d["self_attn.k_proj.weight"],
                                          d["self_attn.v_proj.weight"]]).T)
        self.qkv_bias = None
        if "self_attn.q_proj.bias" in d:
            self.qkv_bias = tensor(np.concatenate([d["self_attn.q_proj.bias"] * scale, d["self_attn.k_proj.bias"],
                                                   d["self_attn.v_proj.bias"]]))
        self.o = tensor(d["self_attn.o_proj.weight"].T)
        self.mlp_norm = tensor(d["post_attention_layernorm.weight"])
        self.gate, self.up = tensor(d["mlp.gate_proj.weight"].T), tensor(d["mlp.up_proj.weight"].T)
        self.down = tensor(d["mlp.down_proj.weight"].T)
        self.final_norm = None if weights.final_norm is None else tensor(weights.final_norm)

    def _rms(self, x, gain):
        p = self.paddle
        return x * p.rsqrt(p.mean(x * x, axis=-1, keepdim=True) + self.eps) * gain

    def forward(self, token_ids: np.ndarray, hidden, meta: AttentionMetadata):
        """Rows for ``token_ids`` ``[T]`` with the previous positions' hidden states ``[T, H]``
        at the positions ``meta`` gives (their keys and values go to the cache layer); returns
        the layer's output ``[T, H]`` (before any final norm)."""
        p = self.paddle
        with p.no_grad():
            embeds = self.target.embed(token_ids)
            x = p.matmul(self._rms(embeds, self.enorm), self.embed_proj) + \
                p.matmul(self._rms(hidden, self.hnorm), self.hidden_proj)
            qkv = p.matmul(self._rms(x, self.attn_norm), self.qkv)
            if self.qkv_bias is not None:
                qkv = qkv + self.qkv_bias
            self.cache.prepare(meta)
            x = x + p.matmul(self.cache.forward(self.layer_index, qkv, meta), self.o)
            y = self._rms(x, self.mlp_norm)
            x = x + p.matmul(p.nn.functional.silu(p.matmul(y, self.gate)) * p.matmul(y, self.up), self.down)
        return x

    def logits(self, out):
        """``[T, V]`` logits of the layer's output: its own final norm and the target's LM head,
        or, without one, exactly the target's final norm and LM head."""
        if self.final_norm is None:
            return self.target.logits(out)
        p = self.paddle
        with p.no_grad():
            return p.matmul(self._rms(out, self.final_norm), self.target.lm_head, transpose_y=True)
