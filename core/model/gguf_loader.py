"""Load a Llama-family GGUF file: config, dequantized weights (Hugging Face names), tokenizer."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..errors import SpecdecError
from .config import ModelConfig

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


def field_value(reader, key: str, default=None):
    """A scalar, string or array field of the GGUF metadata, or ``default`` when absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_config(reader) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise SpecdecError(f"unsupported GGUF architecture '{arch}': specdec runs Llama-family models (llama, qwen2)")

    def meta(name, default=None):
        value = field_value(reader, f"{arch}.{name}", default)
        if value is None:
            raise SpecdecError(f"GGUF metadata lacks '{arch}.{name}'")
        return value

    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = field_value(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(field_value(reader, "tokenizer.ggml.tokens"))
    head_dim = int(field_value(reader, f"{arch}.attention.key_length", hidden // num_heads))
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
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


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    return None


def load_gguf(path: str | Path, progress: bool = True):
    """Read ``path``: returns ``(ModelConfig, weights, tokenizer)`` with HF-named float32 weights."""
    import gguf
    from tqdm import tqdm

    from .tokenizer import Tokenizer

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise SpecdecError(f"cannot read GGUF file {path}: {exc}") from exc
    config = read_config(reader)
    weights: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="loading weights", unit="tensor", disable=not progress,
                       leave=False):
        name = hf_name(tensor.name)
        if name is None:
            continue  # rope_freqs and other tensors the decoder recomputes
        array = dequantize(tensor)
        if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            array = unpermute_rope(array, config.num_heads)
        elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
            array = unpermute_rope(array, config.num_kv_heads)
        weights[name] = array
    tokenizer = Tokenizer.from_gguf(reader)
    return config, weights, tokenizer
