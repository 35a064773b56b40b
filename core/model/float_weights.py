"""The float path's weights: fused (one QKV matrix, one gate/up matrix), RMSNorm gains and the
attention scale folded in, stored as ``linear.py`` streams them. The tensor-parallel slices
(``tensor_parallel.py``) and the quantized weights (``quant_weights.py``) keep the same
interface."""

from __future__ import annotations

import numpy as np

from .config import ModelConfig


class FloatWeights:
    """The float path: weights fused (one QKV matrix, one gate/up matrix), RMSNorm gains and the
    attention scale folded in, stored as ``linear`` streams them (``linear.py``)."""

    def __init__(self, paddle, config: ModelConfig, w: dict[str, np.ndarray], linear):
        self.paddle = paddle
        self.linear = linear
        c = config
        pack = linear.pack
        scale = 1.0 / np.sqrt(c.head_dim)
        self.embedding = paddle.to_tensor(w["model.embed_tokens.weight"])
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
            layer = {
                "qkv": pack(qkv),
                "o": pack(w[p + "self_attn.o_proj.weight"].T),
                "gate_up": linear.pack_gate_up(w[p + "mlp.gate_proj.weight"].T * mlp_gain,
                                               w[p + "mlp.up_proj.weight"].T * mlp_gain),
                "down": pack(w[p + "mlp.down_proj.weight"].T),
                "qkv_bias": None,
            }
            if c.attention_bias:
                bias = np.concatenate([
                    w[p + "self_attn.q_proj.bias"] * scale,
                    w[p + "self_attn.k_proj.bias"],
                    w[p + "self_attn.v_proj.bias"],
                ]).astype(np.float32)
                layer["qkv_bias"] = paddle.to_tensor(bias)
            self.layers.append(layer)
        head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
        self.lm_head = pack(head.T * w["model.norm.weight"][:, None])
        self.final_norm = paddle.to_tensor(w["model.norm.weight"])
        self.lm_head_weight = self.embedding if c.tie_word_embeddings else paddle.to_tensor(head)

    def embed(self, ids):
        return self.paddle.gather(self.embedding, ids)

    def attention_input(self, index: int, x):
        layer = self.layers[index]
        qkv = self.linear.rms_matmul(x, layer["qkv"])
        return qkv if layer["qkv_bias"] is None else qkv + layer["qkv_bias"]

    def layer_output(self, index: int, attn, x):
        layer, linear = self.layers[index], self.linear
        x = linear.matmul_add(attn, layer["o"], x)
        return linear.matmul_add(linear.rms_matmul_swiglu(x, layer["gate_up"]), layer["down"], x)

    def layer_output_and_next_input(self, index: int, attn, x):
        """``(layer_output(index, attn, x), attention_input(index + 1, that))``."""
        x = self.layer_output(index, attn, x)
        return x, self.attention_input(index + 1, x)

    def logits(self, x):
        return self.linear.rms_matmul(x, self.lm_head)
