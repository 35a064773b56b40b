"""A Llama-family decoder in paddle (GQA, RoPE, RMSNorm, SwiGLU), tuned for small-batch decode.

The forward pass runs over one packed array of token rows (every request's new rows back to
back) and returns logits only for the rows the caller asks for. Speed on CPU is dominated by
eager-op overhead and by reading the weights, so the weights are stored pre-transposed and
fused (one QKV matmul, one gate/up matmul), RMSNorm gains are folded into the matmul that
follows them, the attention scale is folded into the query weights, and RoPE is applied to the
whole QKV block at once with per-step cos/sin tables (value heads get cos 1, sin 0).
"""

from __future__ import annotations

import numpy as np

from ..attention import AttentionBackend, AttentionMetadata
from ..errors import require_paddle
from .config import ModelConfig


def rope_tables(config: ModelConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and signed ``sin`` tables ``[max_positions, head_dim]`` for rotate-half RoPE.

    ``rope(x) = x * cos + roll(x, D/2) * sin_signed`` where ``sin_signed`` is ``-sin`` on the
    first half and ``+sin`` on the second: the same as ``x * cos + rotate_half(x) * sin``.
    """
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, half, dtype=np.float64) * 2 / config.head_dim))
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    cos = np.cos(angles)
    sin = np.sin(angles)
    cos_full = np.concatenate([cos, cos], axis=-1).astype(np.float32)
    sin_signed = np.concatenate([-sin, sin], axis=-1).astype(np.float32)
    return cos_full, sin_signed


class LlamaModel:
    """The decoder. Build it from HF-named float32 numpy weights and an attention backend."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], attention: AttentionBackend,
                 max_positions: int | None = None):
        paddle = require_paddle()
        self.paddle = paddle
        self.config = config
        self.attention = attention
        self.max_positions = max_positions or config.max_position_embeddings
        attention.setup(num_layers=config.num_layers, num_heads=config.num_heads,
                        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype="float32")
        self._num_rope_heads = config.num_heads + config.num_kv_heads
        self._num_qkv_heads = config.num_heads + 2 * config.num_kv_heads
        self._cos_table, self._sin_table = rope_tables(config, self.max_positions)
        self._load(weights)

    # -- weights -----------------------------------------------------------------------------

    def _load(self, w: dict[str, np.ndarray]) -> None:
        c = self.config
        t = self.paddle.to_tensor
        scale = 1.0 / np.sqrt(c.head_dim)
        self.embed = t(w["model.embed_tokens.weight"])
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            attn_gain = w[p + "input_layernorm.weight"][:, None]
            mlp_gain = w[p + "post_attention_layernorm.weight"][:, None]
            qkv = np.concatenate([
                w[p + "self_attn.q_proj.weight"] * scale,
                w[p + "self_attn.k_proj.weight"],
                w[p + "self_attn.v_proj.weight"],
            ]).T * attn_gain
            gate_up = np.concatenate([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]).T * mlp_gain
            layer = {
                "qkv": t(np.ascontiguousarray(qkv, dtype=np.float32)),
                "o": t(np.ascontiguousarray(w[p + "self_attn.o_proj.weight"].T)),
                "gate_up": t(np.ascontiguousarray(gate_up, dtype=np.float32)),
                "down": t(np.ascontiguousarray(w[p + "mlp.down_proj.weight"].T)),
                "qkv_bias": None,
            }
            if c.attention_bias:
                bias = np.concatenate([
                    w[p + "self_attn.q_proj.bias"] * scale,
                    w[p + "self_attn.k_proj.bias"],
                    w[p + "self_attn.v_proj.bias"],
                ]).astype(np.float32)
                layer["qkv_bias"] = t(bias)
            self.layers.append(layer)
        head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
        self.lm_head = t(np.ascontiguousarray(head.T * w["model.norm.weight"][:, None], dtype=np.float32))

    # -- forward -----------------------------------------------------------------------------

    def _rms(self, x):
        # The gain is folded into the next matmul's weights (see _load).
        p = self.paddle
        return x * p.rsqrt(p.mean(x * x, axis=-1, keepdim=True) + self.config.rms_norm_eps)

    def _rope_inputs(self, positions: np.ndarray):
        """Per-step cos/sin ``[T, H + 2*KVH, D]``: RoPE for q and k heads, identity for v."""
        n = len(positions)
        cos = np.ones((n, self._num_qkv_heads, self.config.head_dim), dtype=np.float32)
        sin = np.zeros_like(cos)
        cos[:, : self._num_rope_heads] = self._cos_table[positions][:, None, :]
        sin[:, : self._num_rope_heads] = self._sin_table[positions][:, None, :]
        return self.paddle.to_tensor(cos), self.paddle.to_tensor(sin)

    def forward(self, token_ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata,
                logit_rows: np.ndarray, return_hidden: bool = False):
        """Run the decoder over packed rows.

        :param token_ids: ``[T]`` int64, every request's new tokens back to back.
        :param positions: ``[T]`` int64, each row's position in its own sequence.
        :param meta: where each request's rows sit (see :class:`AttentionMetadata`).
        :param logit_rows: ``[M]`` int64 indices of the rows whose logits are wanted.
        :returns: ``[M, V]`` float32 numpy logits (and the final hidden states of those rows
            when ``return_hidden``).
        """
        p = self.paddle
        c = self.config
        head_dim = c.head_dim
        with p.no_grad():
            x = p.gather(self.embed, p.to_tensor(token_ids))
            cos, sin = self._rope_inputs(positions)
            self.attention.prepare(meta)
            n = len(token_ids)
            for index, layer in enumerate(self.layers):
                qkv = p.matmul(self._rms(x), layer["qkv"])
                if layer["qkv_bias"] is not None:
                    qkv = qkv + layer["qkv_bias"]
                qkv = qkv.reshape([n, self._num_qkv_heads, head_dim])
                qkv = qkv * cos + p.roll(qkv, head_dim // 2, axis=-1) * sin
                attn = self.attention.forward(index, qkv, meta)
                x = x + p.matmul(attn, layer["o"])
                gate_up = p.matmul(self._rms(x), layer["gate_up"])
                x = x + p.matmul(p.nn.functional.swiglu(gate_up), layer["down"])
            if len(logit_rows) != n or not np.array_equal(logit_rows, np.arange(n)):
                x = p.gather(x, p.to_tensor(logit_rows))
            hidden = self._rms(x)
            logits = p.matmul(hidden, self.lm_head).numpy()
        if return_hidden:
            return logits, hidden.numpy()
        return logits
