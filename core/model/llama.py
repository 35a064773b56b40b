"""A Llama-family decoder in paddle (GQA, RoPE, RMSNorm, SwiGLU), tuned for small-batch decode.

The forward pass runs over one packed array of token rows (every request's new rows back to
back) and returns logits only for the rows the caller asks for. Speed on CPU is dominated by
reading the weights and by eager-op overhead, so the weights are fused (one QKV matmul, one
gate/up matmul) and stored in the layout the matmul streams (see ``linear.py``), RMSNorm gains
are folded into the matmul that follows them, and the attention scale into the query weights.
RoPE and the KV cache belong to the attention backend.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..attention import AttentionBackend, AttentionMetadata
from ..errors import require_paddle
from .config import ModelConfig
from .float_weights import FloatWeights
from .linear import CpuKernelLinear, PaddleLinear


def rope_tables(config: ModelConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and signed ``sin`` tables ``[max_positions, head_dim]`` for rotate-half RoPE.

    ``rope(x) = x * cos + roll(x, D/2) * sin_signed`` where ``sin_signed`` is ``-sin`` on the
    first half and ``+sin`` on the second: the same as ``x * cos + rotate_half(x) * sin``.
    """
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, half, dtype=np.float64) * 2 / config.head_dim))
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    cos, sin = np.cos(angles), np.sin(angles)
    cos_full = np.concatenate([cos, cos], axis=-1).astype(np.float32)
    sin_signed = np.concatenate([-sin, sin], axis=-1).astype(np.float32)
    return cos_full, sin_signed


def host_array(tensor) -> np.ndarray:
    """``tensor``'s values as a numpy array: for a CPU tensor a view of its memory (DLPack, no
    copy: ``Tensor.numpy()`` copies, 21 us for a verify step's 6 rows of logits and 0.35 ms for
    64 rows of the default model's 49,152-token vocabulary), else a copy to the host."""
    if tensor.place.is_cpu_place():
        return np.from_dlpack(tensor)
    return tensor.numpy()


def make_linear(paddle, config: ModelConfig, kernels: str, weight_dtype: str):
    """The matmul implementation for ``kernels``: paddle's own ops for ``paddle`` (reference)
    and ``triton`` (whose kernels are attention and verification: the matmuls stay paddle's),
    or ``cpu`` (the CPU kernels). Choosing for ``auto`` is the engine's job (``resolve_kernels``)."""
    if kernels in ("paddle", "triton"):
        if weight_dtype != "float32":
            raise ValueError(f"dtype {weight_dtype} needs the CPU kernels")
        return PaddleLinear(paddle, config.rms_norm_eps)
    if kernels != "cpu":
        raise ValueError(f"kernels must be 'paddle', 'triton' or 'cpu', got {kernels!r}")
    from specdec.kernels.cpu import load_cpu_ops

    return CpuKernelLinear(paddle, config.rms_norm_eps, load_cpu_ops(), weight_dtype)


class LlamaModel:
    """The decoder. Build it from HF-named weights (float32 numpy arrays, or
    :class:`~specdec.model.quant.QuantizedMatrix` blocks from a GGUF file) and an attention
    backend.

    :param quantization: ``none`` (the float path: ``kernels`` and ``weight_dtype`` choose its
        matmul), or ``gguf``, ``wint8``, ``wint4``: the weight-only quantized CPU kernels
        (:class:`~specdec.model.quant_weights.QuantizedWeights`).
    :param tensor_parallel: ``(group, rank, world_size)`` to hold one rank's slice of the
        model (:mod:`specdec.model.tensor_parallel`; the float32 ``paddle`` path only); the
        attention backend then keeps that rank's heads. ``config`` stays the whole model's.
    """

    def __init__(self, config: ModelConfig, weights: dict, attention: AttentionBackend,
                 max_positions: int | None = None, kernels: str = "paddle", weight_dtype: str = "float32",
                 kv_cache_dtype: str = "float32", quantization: str = "none", tensor_parallel=None):
        paddle = require_paddle()
        self.paddle = paddle
        self.config = config
        self.attention = attention
        self.quantization = quantization
        self.max_positions = max_positions or config.max_position_embeddings
        cos, sin = rope_tables(config, self.max_positions)
        local_config = config
        if tensor_parallel is not None:
            from .tensor_parallel import Shard, shard_weights

            group, rank, world_size = tensor_parallel
            shard = Shard.plan(config, rank, world_size)
            local_config, weights = shard_weights(config, weights, shard)
        attention.setup(num_layers=config.num_layers, num_heads=local_config.num_heads,
                        num_kv_heads=local_config.num_kv_heads, head_dim=config.head_dim, dtype=kv_cache_dtype,
                        rope_cos=cos, rope_sin=sin)
        if tensor_parallel is not None:
            from .tensor_parallel import TensorParallelWeights

            if quantization != "none" or kernels not in ("paddle", "triton"):
                raise ValueError("tensor parallelism runs the float32 paddle path (quantization none, kernels "
                                 "paddle or triton)")
            self.weights = TensorParallelWeights(paddle, local_config, weights, make_linear(paddle, config, kernels,
                                                                                            weight_dtype),
                                                 group, shard, config.vocab_size)
        elif quantization == "none":
            self.weights = FloatWeights(paddle, config, weights, make_linear(paddle, config, kernels, weight_dtype))
        else:
            if kernels != "cpu":
                raise ValueError(f"quantization {quantization} needs the CPU kernels")
            from specdec.kernels.cpu import load_cpu_ops

            from .quant_weights import QuantizedWeights

            self.weights = QuantizedWeights(paddle, config, weights, load_cpu_ops(), quantization)

    @property
    def embed(self):
        """``[V, H]`` float32 paddle tensor: the token embedding (dequantized on first use when
        the weights are quantized)."""
        return self.weights.embedding

    @property
    def final_norm(self):
        """``[H]`` float32 paddle tensor: the final RMSNorm's gain."""
        return self.weights.final_norm

    @property
    def lm_head_weight(self):
        """``[V, H]`` float32, for proposers (``specdec.TargetModel.lm_head``); the step uses
        its own packed or quantized LM head, with the final norm's gain applied."""
        return self.weights.lm_head_weight

    def embed_tokens(self, token_ids):
        """``[n, H]`` float32 paddle embeddings of ``token_ids`` (numpy or paddle int64)."""
        p = self.paddle
        with p.no_grad():
            if not isinstance(token_ids, p.Tensor):  # one op (each costs tens of us on a CPU)
                return self.weights.embed(p.to_tensor(np.ascontiguousarray(token_ids, np.int64).reshape(-1)))
            if token_ids.dtype != p.int64:
                token_ids = token_ids.astype("int64")
            return self.weights.embed(token_ids if len(token_ids.shape) == 1 else token_ids.reshape([-1]))

    def forward(self, token_ids: np.ndarray, meta: AttentionMetadata,
                logit_rows: np.ndarray, return_hidden: bool = False, device_logits: bool = False,
                hidden_layers: Optional[Sequence[int]] = None):
        """Run the decoder over packed rows.

        :param token_ids: ``[T]`` int64, every request's new tokens back to back.
        :param meta: where each request's rows sit and where its KV cache lives (see
            :class:`AttentionMetadata`; ``meta.positions`` are the rows' positions).
        :param logit_rows: ``[M]`` int64 indices of the rows whose logits are wanted (may be
            empty: a prefill chunk needs none).
        :param return_hidden: also return the last layer's hidden states of every row
            (``[T, H]`` float32 paddle tensor, before the final norm), for proposers that read
            them.
        :param hidden_layers: with ``return_hidden``, the layers whose input states to return
            instead, side by side in this order (``[T, len(hidden_layers) * H]``): layer ``i``'s
            input is the residual stream entering decoder layer ``i`` (0: the embeddings),
            ``num_layers`` the last layer's output (see ``Proposer.hidden_state_layers``).
        :param device_logits: return the logits as a paddle tensor where the model ran (for
            the fused verify kernels) instead of copying them to a numpy array.
        :returns: ``[M, V]`` float32 numpy logits, or ``(logits, hidden_states)``.
        """
        weights = self.weights
        self.attention.prepare(meta)
        operands = self._native_attention() if not hidden_layers else None
        if operands is not None:  # the whole pass in one native call
            hidden, logits = weights.forward_rows(np.asarray(token_ids, np.int64), np.asarray(logit_rows, np.int64),
                                                  operands)
            if not device_logits:
                logits = host_array(logits)
            return (logits, hidden) if return_hidden else logits
        p = self.paddle
        with p.no_grad():
            x = weights.embed(p.to_tensor(token_ids))
            x, hidden = self._layer_by_layer(x, weights.attention_input(0, x), meta, hidden_layers)
            if len(logit_rows) == 0:
                logits = np.zeros((0, self.config.vocab_size), np.float32)
                if device_logits:
                    logits = p.to_tensor(logits)
            else:
                if len(logit_rows) != len(token_ids) or not np.array_equal(logit_rows, np.arange(len(token_ids))):
                    x = p.gather(x, p.to_tensor(logit_rows))
                logits = weights.logits(x)
                if not device_logits:
                    logits = host_array(logits)
        return (logits, hidden) if return_hidden else logits

    def _native_attention(self) -> Optional[tuple]:
        """The attention's operands for the quantized kernels' call of the whole pass
        (``forward_rows``): a quantized model over the ``cpu`` backend (not a subclass of it
        with a ``forward`` of its own); else None."""
        operands = getattr(self.attention, "kernel_operands", None)
        if operands is None or not hasattr(self.weights, "forward_rows"):
            return None
        return operands()

    def _layer_by_layer(self, x, qkv, meta: AttentionMetadata, hidden_layers: Optional[Sequence[int]]):
        """The decoder layers one call at a time from the first layer's input ``x`` and its
        ``qkv``: ``(last layer's output, hidden)``, ``hidden`` being that output or, with
        ``hidden_layers``, those layers' inputs side by side (see :meth:`forward`)."""
        weights, last = self.weights, self.config.num_layers - 1
        wanted = set(hidden_layers or ())
        layer_inputs = {0: x} if 0 in wanted else {}
        for index in range(last):
            attn = self.attention.forward(index, qkv, meta)
            x, qkv = weights.layer_output_and_next_input(index, attn, x)
            if index + 1 in wanted:
                layer_inputs[index + 1] = x
        x = weights.layer_output(last, self.attention.forward(last, qkv, meta), x)
        if not hidden_layers:
            return x, x
        layer_inputs[last + 1] = x
        return x, self.paddle.concat([layer_inputs[i] for i in hidden_layers], axis=1)

    def logits_of_hidden(self, hidden_states):
        """``[n, V]`` float32 paddle logits of last-layer hidden states ``[n, H]`` (numpy or
        paddle), exactly as :meth:`forward` computes them: the final norm, then the LM head."""
        p = self.paddle
        x = hidden_states if isinstance(hidden_states, p.Tensor) else p.to_tensor(np.asarray(hidden_states))
        with p.no_grad():
            x = x.astype("float32").reshape([-1, self.config.hidden_size])
            if x.shape[0] == 0:
                return p.zeros([0, self.config.vocab_size], dtype="float32")
            return self.weights.logits(x)
