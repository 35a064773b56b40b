"""MTP head weights: loading the two layouts specdec reads into one form.

**specdec's own layout** (what ``specdec train-mtp`` writes), DeepSeek-V3 order::

    mtp.layers.{i}.enorm.weight            [H]       RMSNorm of the next token's embedding
    mtp.layers.{i}.hnorm.weight            [H]       RMSNorm of the target's hidden state
    mtp.layers.{i}.eh_proj.weight          [H, 2H]   on concat(embedding, hidden), no bias
    mtp.layers.{i}.input_layernorm.weight, self_attn.{q,k,v,o}_proj.weight (q/k/v .bias optional),
    mtp.layers.{i}.post_attention_layernorm.weight, mlp.{gate,up,down}_proj.weight
    mtp.layers.{i}.final_norm.weight       [H]       optional: absent means the target's final norm
    mtp.draft_vocab                        [K] int64 optional: the token ids the head drafts among
                                                     (EAGLE-3's reduced vocabulary); absent: all

**Xiaomi MiMo** (``MiMoForCausalLM``, a Qwen2-family dense model shipping MTP layers)::

    model.mtp_layers.{i}.token_layernorm.weight, hidden_layernorm.weight   [H]
    model.mtp_layers.{i}.input_proj.weight   [H, 2H] on concat(hidden, embedding): hidden first
    model.mtp_layers.{i}.<the Qwen2 decoder layer's names>, final_layernorm.weight  [H]

Weights are ``[out, in]`` (torch order) in both; the head computes ``x @ W.T``. The head uses the
target's embedding and LM head (a MiMo file may also hold the target's own tensors: they are
ignored).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import attrs
import numpy as np

from specdec.sdk import SpecdecError

SPECDEC_PREFIX = "mtp.layers."
DRAFT_VOCAB = "mtp.draft_vocab"
MIMO_PREFIX = "model.mtp_layers."
DECODER_NAMES = (
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
BIAS_NAMES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


@attrs.define
class MtpLayerWeights:
    """One MTP layer, float32 numpy, ``[out, in]`` matrices.

    :ivar embed_proj: ``[H, H]``, the half of the input projection that takes the embedding.
    :ivar hidden_proj: ``[H, H]``, the half that takes the hidden state.
    :ivar decoder: the decoder layer's tensors by their Llama names (:data:`DECODER_NAMES`, and
        the q/k/v biases when present).
    :ivar final_norm: ``[H]``, the layer's own norm before the LM head, or ``None`` for the
        target's final norm (with its LM head, exactly the target's logits).
    :ivar draft_vocab: ``[K]`` int64 token ids the head drafts among (its LM head is those rows
        of the target's), or ``None`` for the whole vocabulary.
    """

    enorm: np.ndarray
    hnorm: np.ndarray
    embed_proj: np.ndarray
    hidden_proj: np.ndarray
    decoder: dict[str, np.ndarray]
    final_norm: Optional[np.ndarray] = None
    draft_vocab: Optional[np.ndarray] = None


def read_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a ``.safetensors`` file, or of all such files in a directory."""
    from safetensors.numpy import load_file

    path = Path(path).expanduser()
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise SpecdecError(f"speculative_config.model: no .safetensors file in {path}")
    elif path.is_file():
        files = [path]
    else:
        raise SpecdecError(f"speculative_config.model: {path} does not exist")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:  # noqa: BLE001 - a corrupt file is the user's input error
            raise SpecdecError(f"speculative_config.model: cannot read {file}: {exc}") from None
    return tensors


def load_mtp_layers(path: str | Path, hidden_size: int) -> list[MtpLayerWeights]:
    """The MTP layers in the file(s) at ``path``, in either layout, checked against the target's
    ``hidden_size``; a one-line :class:`SpecdecError` for anything else."""
    tensors = read_tensors(path)
    if any(name.startswith(SPECDEC_PREFIX) for name in tensors):
        layers = [_specdec_layer(tensors, f"{SPECDEC_PREFIX}{i}.") for i in _layer_indices(tensors, SPECDEC_PREFIX)]
        if DRAFT_VOCAB in tensors:
            vocab = np.asarray(tensors[DRAFT_VOCAB], dtype=np.int64)
            layers = [attrs.evolve(layer, draft_vocab=vocab) for layer in layers]
    elif any(name.startswith(MIMO_PREFIX) for name in tensors):
        layers = [_mimo_layer(tensors, f"{MIMO_PREFIX}{i}.") for i in _layer_indices(tensors, MIMO_PREFIX)]
    else:
        raise SpecdecError(f"speculative_config.model: {path} holds no MTP layer (expected tensors named "
                           f"{SPECDEC_PREFIX}0.* or {MIMO_PREFIX}0.*)")
    for i, layer in enumerate(layers):
        _check_shapes(layer, hidden_size, f"{path}: MTP layer {i}")
    return layers


def _layer_indices(tensors: dict, prefix: str) -> list[int]:
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    indices = sorted({int(m.group(1)) for name in tensors if (m := pattern.match(name))})
    if indices != list(range(len(indices))):
        raise SpecdecError(f"speculative_config.model: MTP layers {indices} are not numbered 0..{len(indices) - 1}")
    return indices


def _take(tensors: dict, name: str) -> np.ndarray:
    if name not in tensors:
        raise SpecdecError(f"speculative_config.model: missing tensor {name}")
    return np.asarray(tensors[name], dtype=np.float32)


def _decoder(tensors: dict, prefix: str) -> dict[str, np.ndarray]:
    decoder = {name: _take(tensors, prefix + name) for name in DECODER_NAMES}
    decoder.update({name: _take(tensors, prefix + name) for name in BIAS_NAMES if prefix + name in tensors})
    return decoder


def _specdec_layer(tensors: dict, prefix: str) -> MtpLayerWeights:
    proj = _take(tensors, prefix + "eh_proj.weight")
    half = proj.shape[1] // 2
    final = prefix + "final_norm.weight"
    return MtpLayerWeights(enorm=_take(tensors, prefix + "enorm.weight"), hnorm=_take(tensors, prefix + "hnorm.weight"),
                           embed_proj=proj[:, :half], hidden_proj=proj[:, half:], decoder=_decoder(tensors, prefix),
                           final_norm=_take(tensors, final) if final in tensors else None)


def _mimo_layer(tensors: dict, prefix: str) -> MtpLayerWeights:
    proj = _take(tensors, prefix + "input_proj.weight")
    half = proj.shape[1] // 2
    return MtpLayerWeights(enorm=_take(tensors, prefix + "token_layernorm.weight"),
                           hnorm=_take(tensors, prefix + "hidden_layernorm.weight"),
                           embed_proj=proj[:, half:], hidden_proj=proj[:, :half], decoder=_decoder(tensors, prefix),
                           final_norm=_take(tensors, prefix + "final_layernorm.weight"))


def _check_shapes(layer: MtpLayerWeights, hidden: int, where: str) -> None:
    expected = {"enorm": (hidden,), "hnorm": (hidden,), "embed_proj": (hidden, hidden),
                "hidden_proj": (hidden, hidden)}
    for name, shape in expected.items():
        got = getattr(layer, name).shape
        if got != shape:
            raise SpecdecError(f"speculative_config.model: {where}: {name} has shape {list(got)}, the target's "
                               f"hidden size {hidden} needs {list(shape)}")
    if layer.final_norm is not None and layer.final_norm.shape != (hidden,):
        raise SpecdecError(f"speculative_config.model: {where}: final norm has shape {list(layer.final_norm.shape)}")
    vocab = layer.draft_vocab
    if vocab is not None and (vocab.ndim != 1 or len(vocab) == 0 or vocab.min() < 0):
        raise SpecdecError(f"speculative_config.model: {where}: {DRAFT_VOCAB} must be a non-empty list of token ids")


def save_mtp_layers(layers: list[MtpLayerWeights], path: str | Path, dtype: str = "float16",
                    metadata: Optional[dict[str, str]] = None, draft_vocab: Optional[np.ndarray] = None) -> None:
    """Write ``layers`` in specdec's layout (``dtype`` storage) to one ``.safetensors`` file, with
    ``draft_vocab`` (default: the first layer's) when given."""
    from safetensors.numpy import save_file

    tensors = {}
    for i, layer in enumerate(layers):
        prefix = f"{SPECDEC_PREFIX}{i}."
        tensors[prefix + "enorm.weight"] = layer.enorm
        tensors[prefix + "hnorm.weight"] = layer.hnorm
        tensors[prefix + "eh_proj.weight"] = np.concatenate([layer.embed_proj, layer.hidden_proj], axis=1)
        for name, value in layer.decoder.items():
            tensors[prefix + name] = value
        if layer.final_norm is not None:
            tensors[prefix + "final_norm.weight"] = layer.final_norm
    tensors = {name: np.ascontiguousarray(value, dtype=dtype) for name, value in tensors.items()}
    vocab = draft_vocab if draft_vocab is not None else layers[0].draft_vocab
    if vocab is not None:
        tensors[DRAFT_VOCAB] = np.ascontiguousarray(vocab, dtype=np.int64)
    save_file(tensors, str(path), metadata=metadata)
