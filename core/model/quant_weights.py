"""The quantized path of the decoder: weights as GGML blocks, two native calls per layer.

A step makes one embedding lookup (``specdec_q_embedding``), the first layer's attention input
(``specdec_q_matmul``: RMSNorm, the norm's gain, the fused QKV matmul, the attention scale on
the query columns, the q/k/v biases), then per layer:

1. the attention backend's ``forward`` (with the ``cpu`` backend, one call: RoPE, the
   KV-cache write and attention);
2. ``specdec_q_layer_tail_qkv``: the output projection and residual, RMSNorm, gate/up,
   SwiGLU, down and residual, then the next layer's attention input as above
   (``specdec_q_layer_tail`` without it after the last layer);

and the LM head (``specdec_q_matmul`` with the final norm): 3 + 2 * layers calls.

Blocks stay as stored, so gains and the attention scale cannot be folded into the weights as
the float path does: the kernels apply them on the way in and out instead.
"""

from __future__ import annotations

import logging
import mmap

import numpy as np

from ..errors import SpecdecError
from .config import ModelConfig
from .quant import LOAD_TIME_FORMATS, QuantizedMatrix, layout_array, packed_size, quantize
from .quant_layer import LAYER_MATRICES, attention_input, build_layer, layer_operands, layer_output, release_with

log = logging.getLogger(__name__)


def as_quantized(weight, quantization: str, name: str) -> QuantizedMatrix:
    """``weight`` in blocks: GGUF blocks as they are (``gguf``: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
    Q4_K, Q5_K, Q6_K, the formats of ``BLOCK_FORMATS``), float weights quantized for
    ``wint8``/``wint4``. A float matrix of a quantized GGUF file (some files keep small ones in
    F16/F32, or in a block format the kernels do not read, dequantized at load) is quantized
    per output channel, as ``wint8`` would."""
    if isinstance(weight, QuantizedMatrix):
        return weight
    method = quantization if quantization in LOAD_TIME_FORMATS else "wint8"
    if quantization == "gguf":
        log.info("%s is not in a block format the kernels read (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, "
                 "Q6_K): quantized to int8 per channel", name)
    try:
        return quantize(np.asarray(weight, np.float32), method)
    except ValueError as exc:  # rows that are not whole groups of 32
        raise SpecdecError(f"quantization: {name}: {exc}; use quantization: none") from None


class WeightArena:
    """One anonymous memory mapping that holds every quantized matrix, backed by 2 MiB pages
    where the kernel allows (``MADV_HUGEPAGE``): a decode step streams all the weights, and on
    4 KiB pages that is a TLB miss every 4 KiB. The paddle tensors are views of it (DLPack,
    no copy)."""

    ALIGN = 64

    def __init__(self, paddle, total_bytes: int):
        self.paddle = paddle
        self.size = max(1, total_bytes)
        self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # not supported here: 4 KiB pages, same results
                pass
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.used = 0

    @classmethod
    def slot(cls, nbytes: int) -> int:
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    def put(self, matrix: QuantizedMatrix):
        """``(data, layout)`` paddle tensors of ``matrix``, its data placed in the arena."""
        size = packed_size(matrix)
        out = self.array[self.used:self.used + size]
        self.used += self.slot(size)
        data, layout = layout_array(matrix, out=out)
        return self.paddle.utils.dlpack.from_dlpack(data), self.paddle.to_tensor(layout)


class QuantizedWeights:
    """Same interface as :class:`specdec.model.float_weights.FloatWeights`, over quantized matrices.

    :param quantization: ``gguf`` (blocks as the file stores them), ``wint8`` or ``wint4``
        (float weights quantized here; see :func:`specdec.model.quant.quantize`).
    """

    def __init__(self, paddle, config: ModelConfig, w: dict, ops, quantization: str):
        self.paddle = paddle
        self.ops = ops
        self.config = config
        self.eps = float(config.rms_norm_eps)
        self._none = paddle.empty([0], dtype="float32")

        c = config
        layer_names = [[f"model.layers.{i}.{name}" for name in LAYER_MATRICES] for i in range(c.num_layers)]
        quantized = {name: as_quantized(w[name], quantization, name)
                     for name in [n for names in layer_names for n in names] + self._table_names(c)}
        self.arena = WeightArena(paddle, sum(WeightArena.slot(packed_size(m)) for m in quantized.values()))

        def matrix(*names: str):
            parts = [quantized.pop(name) for name in names]
            return self.arena.put(parts[0] if len(parts) == 1 else QuantizedMatrix.stacked(parts))

        def vector(name: str):
            return paddle.to_tensor(np.ascontiguousarray(w[name], dtype=np.float32))

        self.layers = [build_layer(paddle, lambda name, p=f"model.layers.{i}.": w[p + name],
                                   lambda *names, p=f"model.layers.{i}.": matrix(*(p + n for n in names)),
                                   c.num_heads, c.num_kv_heads, c.head_dim, c.attention_bias)
                       for i in range(c.num_layers)]
        self.embedding_blocks = matrix("model.embed_tokens.weight")
        self.lm_head = self.embedding_blocks if c.tie_word_embeddings else matrix("lm_head.weight")
        self.final_norm = vector("model.norm.weight")
        self._float_embedding = None
        self._float_lm_head = None
        #: Every layer's operands, in the kernel's order, read once by the kernels
        #: (``specdec_q_register_layers``): :meth:`forward_rows` passes their handle, not 11
        #: tensors a layer, each of which paddle checks at every call (100 us of the default
        #: model's 1-row forward pass, 2026-12-05). The list keeps the tensors alive as long as
        #: the kernels may read them: the handle is released with this object.
        self._layer_operands = [tensor for layer in self.layers for tensor in layer_operands(layer)]
        self._layer_stack = ops.specdec_q_register_layers(self._layer_operands, c.num_heads * c.head_dim)
        release_with(self, ops, self._layer_stack)
        #: The whole model for :meth:`forward_rows`: the stack, the embedding, the final norm and
        #: the LM head (the tensors are this object's, alive as long as it is).
        self._model = ops.specdec_q_register_model(self._layer_stack, *self.embedding_blocks, self.final_norm,
                                                   *self.lm_head)
        release_with(self, ops, self._model)

    @staticmethod
    def _table_names(config: ModelConfig) -> list[str]:
        return ["model.embed_tokens.weight"] + ([] if config.tie_word_embeddings else ["lm_head.weight"])

    def weight_bytes(self) -> int:
        """Bytes of quantized weights one step reads (each matrix once; the embedding's few
        rows aside, unless it is also the LM head)."""
        matrices = [m for layer in self.layers for m in (layer["qkv"], layer["o"], layer["gate_up"], layer["down"])]
        return sum(int(data.shape[0]) for data, _ in matrices + [self.lm_head])

    def embed(self, ids):
        data, layout = self.embedding_blocks
        return self.ops.specdec_q_embedding(ids, data, layout, self.config.hidden_size)

    def attention_input(self, index: int, x):
        return attention_input(self.ops, self.layers[index], x, self.eps)

    def layer_output(self, index: int, attn, x):
        return layer_output(self.ops, self.layers[index], attn, x, self.eps)

    def forward_rows(self, token_ids, logit_rows, attention_operands: tuple):
        """The model's forward pass in one native call (``specdec_q_forward``): the embedding
        of ``token_ids``, every layer with the cpu attention backend's ``kernel_operands()``,
        the final norm and the LM head over ``logit_rows``. Returns ``(hidden [T, H] before the
        final norm, logits [len(logit_rows), V])``, the same floats as :meth:`embed`,
        :meth:`attention_input`, the layers' calls (``specdec_q_decoder_layers``) and
        :meth:`logits` called one by one; those four calls and the ids' copy into a tensor cost
        0.2 ms, 8% of the default model's 1-row pass (docs/models.md)."""
        caches, cos, sin, meta, heads, kv_heads = attention_operands
        return self.ops.specdec_q_forward(caches, cos, sin, meta, self._model, token_ids.tolist(), logit_rows.tolist(),
                                          heads, kv_heads, self.eps)

    def layer_output_and_next_input(self, index: int, attn, x):
        """``(layer_output(index, attn, x), attention_input(index + 1, that))`` in one call."""
        layer, following = self.layers[index], self.layers[index + 1]
        return self.ops.specdec_q_layer_tail_qkv(attn, x, *layer["o"], layer["mlp_gain"], *layer["gate_up"],
                                                 *layer["down"], following["attn_gain"], *following["qkv"],
                                                 following["qkv_epilogue"], self.eps)

    def logits(self, x):
        data, layout = self.lm_head
        return self.ops.specdec_q_matmul(x, self.final_norm, data, layout, self._none, self.eps, True)

    def _dequantized(self, blocks):
        data, layout = blocks
        rows = int(layout.numpy()[:, 1].sum())
        ids = self.paddle.arange(rows, dtype="int64")
        return self.ops.specdec_q_embedding(ids, data, layout, self.config.hidden_size)

    @property
    def embedding(self):
        """``[V, H]`` float32, dequantized on first use (proposers that read the table: MTP)."""
        if self._float_embedding is None:
            self._float_embedding = self._dequantized(self.embedding_blocks)
        return self._float_embedding

    @property
    def lm_head_weight(self):
        """``[V, H]`` float32, dequantized on first use."""
        if self.lm_head is self.embedding_blocks:
            return self.embedding
        if self._float_lm_head is None:
            self._float_lm_head = self._dequantized(self.lm_head)
        return self._float_lm_head
