"""Load a Llama-family GGUF file: config, dequantized weights (Hugging Face names), tokenizer."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import attrs
import numpy as np

from ..errors import SpecdecError
from .config import ModelConfig
from .gguf_file import open_gguf_reader

log = logging.getLogger(__name__)


@attrs.frozen
class ArchConventions:
    """How llama.cpp lays out one ``general.architecture``, as far as the loader must know.

    :param rope: llama.cpp's RoPE type for the architecture (``llama_model_rope_type`` in
        ``src/llama-model.cpp``). ``"norm"`` rotates consecutive pairs ``(x[2i], x[2i+1])``, so
        the q/k rows of the file are in that interleaved order (for ``llama`` because
        ``convert_hf_to_gguf.py``'s ``LlamaModel.modify_tensors`` reorders the Hugging Face rows
        with ``LlamaModel.permute``); the loader un-permutes them (:func:`unpermute_rope`).
        ``"neox"`` rotates the halves ``(x[i], x[i + D/2])``, the Hugging Face rotate-half
        order our decoder uses: the rows are taken as they are.
    :param qkv_bias: ``"required"``: the architecture's llama.cpp graph adds ``attn_q/k/v.bias``
        unconditionally, a file without them is an error; ``"optional"``: used when present.
    """

    rope: str
    qkv_bias: str = "optional"

    def __attrs_post_init__(self):
        assert self.rope in ("norm", "neox") and self.qkv_bias in ("optional", "required")


#: ``general.architecture`` -> its conventions: adding an architecture is one entry (and a case
#: in tests/unit/test_gguf_architectures.py). What llama.cpp's source says:
#:
#: - ``llama``: ``convert_hf_to_gguf.py``'s ``LlamaModel`` (registered for ``LlamaForCausalLM``
#:   *and* ``MistralForCausalLM``, ``MixtralForCausalLM``, ...) has ``undo_permute = True`` and
#:   applies ``LlamaModel.permute`` to ``q_proj``/``k_proj`` weights and biases (k with the KV
#:   head count); ``llama_model_rope_type`` puts ``LLM_ARCH_LLAMA`` under
#:   ``LLAMA_ROPE_TYPE_NORM``. q/k/v biases are optional (``create_tensor_qkv``).
#: - ``mistral``: no llama.cpp converter writes it: HF Mistral models go through ``LlamaModel``
#:   and are written as ``llama`` (permuted); the ``MistralModel`` class for Mistral's own
#:   consolidated format sets ``undo_permute = False`` only because those weights are already in
#:   the interleaved order, and also writes ``llama`` (or ``mistral3``). A file labelled
#:   ``mistral`` by another tool is read with the llama layout.
#: - ``qwen2``: ``Qwen2Model`` (``Qwen2ForCausalLM``) is a plain ``TextModel``: no permutation,
#:   the rows stay in Hugging Face order; ``llama_model_rope_type`` lists ``LLM_ARCH_QWEN2``
#:   under ``LLAMA_ROPE_TYPE_NEOX``; ``llm_build_qwen2`` adds ``bq``/``bk``/``bv`` to Q/K/V
#:   unconditionally.
#:
#: Common to all three (so not in the table): the metadata keys are the same under the
#: ``<arch>.`` prefix (``TextModel.set_gguf_parameters``): ``attention.layer_norm_rms_epsilon``
#: (required by llama.cpp, no default), ``attention.key_length`` (written only when the HF config
#: names ``head_dim``, else ``embedding_length / head_count``), ``attention.head_count_kv``
#: (default ``head_count``), ``rope.freq_base``; ``LlamaModel`` adds ``vocab_size`` and
#: ``rope.dimension_count`` (Qwen2 files have neither: the vocabulary is the token list). The
#: output head ``output.weight`` is optional: without it llama.cpp uses ``token_embd.weight``
#: (tied embeddings). Both graphs (``llm_build_qwen2``, the llama graph) assert
#: ``n_rot == head_dim``: partial rotary is an error here too.
ARCHITECTURES: dict[str, ArchConventions] = {
    "llama": ArchConventions(rope="norm"),
    "mistral": ArchConventions(rope="norm"),
    "qwen2": ArchConventions(rope="neox", qkv_bias="required"),
}

#: Quantization types we dequantize (through the ``gguf`` package) and test.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_QKV_BIAS_RE = re.compile(r"blk\.\d+\.attn_[qkv]\.bias$")


def field_value(reader, key: str, default=None):
    """A scalar, string or array field of the GGUF metadata, or ``default`` when absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def architecture(reader) -> tuple[str, ArchConventions]:
    """``general.architecture`` and its :data:`ARCHITECTURES` entry; a one-line error if unknown."""
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise SpecdecError(f"unsupported GGUF architecture '{arch}': specdec runs "
                           f"{', '.join(sorted(ARCHITECTURES))}")
    return arch, ARCHITECTURES[arch]


def read_config(reader) -> ModelConfig:
    arch, conventions = architecture(reader)

    def meta(name, default=None):
        value = field_value(reader, f"{arch}.{name}", default)
        if value is None:
            raise SpecdecError(f"GGUF metadata lacks '{arch}.{name}'")
        return value

    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    rms_norm_eps = float(meta("attention.layer_norm_rms_epsilon"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = field_value(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(field_value(reader, "tokenizer.ggml.tokens"))
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    for key in ("attention.value_length", "rope.dimension_count"):
        value = field_value(reader, f"{arch}.{key}")
        if value is not None and int(value) != head_dim:
            raise SpecdecError(f"GGUF metadata '{arch}.{key}' = {int(value)} differs from the head size "
                               f"{head_dim}: specdec rotates and attends over whole heads")
    biases = [f"blk.{i}.attn_{p}.bias" for i in range(int(meta("block_count"))) for p in "qkv"]
    present = [name in tensor_names for name in biases]
    if conventions.qkv_bias == "required" and not all(present):
        missing = biases[present.index(False)]
        raise SpecdecError(f"GGUF architecture '{arch}' has q/k/v biases but the file lacks {missing}")
    others = sorted(n for n in tensor_names if n.endswith(".bias") and not _QKV_BIAS_RE.match(n))
    if others:  # llama.cpp applies these (attn_output, ffn_*, output biases); the decoder cannot
        raise SpecdecError(f"GGUF tensor '{others[0]}' is a bias specdec's decoder does not apply "
                           f"(it has q/k/v biases only)")
    scaling = field_value(reader, f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in tensor_names or scaling not in (None, "none"):
        log.warning("%s: the GGUF file asks for RoPE scaling (%s); specdec applies plain RoPE, so "
                    "outputs drift from llama.cpp's, most at long contexts", arch,
                    "rope_freqs.weight" if scaling in (None, "none") else f"{arch}.rope.scaling.type={scaling}")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=rms_norm_eps,
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=any(present),
    )


def dequantize(tensor) -> np.ndarray:
    """A GGUF tensor as float32 numpy, shaped like the Hugging Face weight (``[out, in]``)."""
    import gguf

    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_TYPES:
        raise SpecdecError(
            f"GGUF tensor '{tensor.name}' has type {type_name}; supported: {', '.join(SUPPORTED_TYPES)}"
        )
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dimensions fastest-first; numpy wants them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.ascontiguousarray(array.reshape(shape), dtype=np.float32)


def unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs back to rotate-half order).

    llama.cpp's converter reorders each head's rows from ``[first half | second half]`` to
    interleaved pairs; Hugging Face checkpoints (and our decoder) use the half-split order.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _unpermuted(array, num_heads: int):
    """:func:`unpermute_rope` of a float array, or of a quantized matrix's rows."""
    if isinstance(array, np.ndarray):
        return unpermute_rope(array, num_heads)
    order = unpermute_rope(np.arange(array.rows), num_heads)
    return array.take_rows(order)


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    return None


def quantized_matrix(tensor):
    """A GGUF matrix in one of the formats the quantized kernels read, as a
    :class:`~specdec.model.quant.QuantizedMatrix` over the file's bytes (not copied), or
    ``None`` for any other type."""
    from .quant import BLOCK_FORMATS, QuantizedMatrix, Segment

    if tensor.tensor_type.name not in BLOCK_FORMATS or len(tensor.shape) != 2:
        return None
    cols = int(tensor.shape[0])  # GGUF lists dimensions fastest-first
    return QuantizedMatrix(cols, (Segment(tensor.tensor_type.name, tensor.data),))


def load_gguf(path: str | Path, progress: bool = True, keep_quantized: bool = False):
    """Read ``path``: returns ``(ModelConfig, weights, tokenizer)`` with HF-named weights:
    float32 numpy arrays, except, with ``keep_quantized``, the matrices stored in a format the
    quantized kernels read, which stay :class:`~specdec.model.quant.QuantizedMatrix` blocks (no
    dequantized copy is made)."""
    from tqdm import tqdm

    from .tokenizer import Tokenizer

    reader = open_gguf_reader(path)
    config = read_config(reader)
    _, conventions = architecture(reader)
    weights: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="loading weights", unit="tensor", disable=not progress,
                       leave=False):
        name = hf_name(tensor.name)
        if name is None:
            continue  # rope_freqs and other tensors the decoder does not use
        blocks = quantized_matrix(tensor) if keep_quantized else None
        array = dequantize(tensor) if blocks is None else blocks
        if conventions.rope == "norm":  # rows interleaved for llama.cpp's RoPE: back to halves
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                array = _unpermuted(array, config.num_heads)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                array = _unpermuted(array, config.num_kv_heads)
        weights[name] = array
    if config.attention_bias:  # llama: a layer may carry some of the three biases; zeros for the rest
        for i in range(config.num_layers):
            for part, size in (("q", config.q_size), ("k", config.kv_size), ("v", config.kv_size)):
                weights.setdefault(f"model.layers.{i}.self_attn.{part}_proj.bias", np.zeros(size, np.float32))
    tokenizer = Tokenizer.from_gguf(reader)
    return config, weights, tokenizer
