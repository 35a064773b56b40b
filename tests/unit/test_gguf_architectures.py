"""Every GGUF architecture the loader accepts, written the way llama.cpp's converter writes it.

For each architecture a tiny random model (2 layers, hidden 64, 4 query heads, 2 KV heads, 266
tokens) is made in the Hugging Face layout, then

- saved as a Hugging Face safetensors directory (``save_hf_dir``, with the ``config.json`` such a
  model ships), and
- written as a GGUF file as ``convert_hf_to_gguf.py`` lays it out for that architecture: the
  tensor names of ``gguf.get_tensor_name_map`` (what the converter maps with), the metadata keys
  its ``TextModel.set_gguf_parameters`` writes (plus ``vocab_size`` and ``rope.dimension_count``
  for ``LlamaModel``), the q/k rows reordered by ``LlamaModel.permute`` for ``llama`` (which is
  also the class the converter uses for ``MistralForCausalLM``) and left in Hugging Face order
  for ``qwen2`` (``Qwen2Model`` does not permute; llama.cpp runs it with NEOX RoPE), the qwen2
  q/k/v biases, 1-D tensors in F32 and matrices in F32 or F16;

and both files, loaded by specdec's loaders, must give the same logits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from specdec import SpecdecError
from specdec.attention import AttentionMetadata
from specdec.model.config import ModelConfig
from specdec.model.gguf_loader import load_gguf
from specdec.model.hf_loader import load_hf_dir, save_hf_dir
from specdec.model.llama import LlamaModel
from specdec.plugins.attention.paddle_backend import PaddleAttention
from byte_level import bytes_to_unicode  # tests/byte_level.py

gguf = pytest.importorskip("gguf")

MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
BLOCK_SIZE = 8
TABLE = [5, 2, 7, 0, 3, 6]

#: case -> ``arch`` (general.architecture) and how the converter (and the model's own Hugging Face
#: config) does it. ``hf_head_dim``: config.json names ``head_dim`` (then the converter writes
#: ``key_length``); ``bias``: q/k/v biases (``permuted`` applies to the q/k ones too).
CASES = {
    "llama": dict(arch="llama", hf_arch="LlamaForCausalLM", model_type="llama", converter="LlamaModel",
                  permuted=True, bias=False, head_dim=32, hf_head_dim=True, theta=500000.0, eps=2.0 ** -17,
                  pre="llama-bpe", dtype="F32"),
    "llama-qkv_bias": dict(arch="llama", hf_arch="LlamaForCausalLM", model_type="llama", converter="LlamaModel",
                           permuted=True, bias=True, head_dim=16, hf_head_dim=False, theta=10000.0,
                           eps=2.0 ** -17, pre="smollm", dtype="F32"),
    # llama.cpp itself writes Mistral models as "llama"; a "mistral" file has the llama layout.
    "mistral": dict(arch="mistral", hf_arch="MistralForCausalLM", model_type="mistral", converter="LlamaModel",
                    permuted=True, bias=False, head_dim=16, hf_head_dim=False, theta=1000000.0, eps=2.0 ** -17,
                    pre="gpt-2", dtype="F16"),
    "qwen2": dict(arch="qwen2", hf_arch="Qwen2ForCausalLM", model_type="qwen2", converter="Qwen2Model",
                  permuted=False, bias=True, head_dim=16, hf_head_dim=False, theta=1000000.0, eps=2.0 ** -20,
                  pre="qwen2", dtype="F32"),
}
ARCHS = sorted({case["arch"] for case in CASES.values()})


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute`` (rotate-half rows -> interleaved pairs)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def tiny_vocab():
    b2u = bytes_to_unicode()
    return ["<|endoftext|>"] + [b2u[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES]


def tiny_config(case: dict, tied: bool, vocab: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=case["head_dim"], rope_theta=case["theta"],
                       rms_norm_eps=case["eps"], max_position_embeddings=128, tie_word_embeddings=tied,
                       attention_bias=case["bias"])


def hf_weights(config: ModelConfig, f16: bool, seed: int) -> dict[str, np.ndarray]:
    """Random Hugging Face-layout weights; matrices rounded to float16 when the GGUF stores F16,
    so both files hold exactly the same values."""
    c = config
    rng = np.random.default_rng(seed)

    def mat(rows, cols, scale=None):
        m = (rng.standard_normal((rows, cols)) * (scale or cols ** -0.5)).astype(np.float32)
        return m.astype(np.float16).astype(np.float32) if f16 else m

    def vec(n, mean, scale):
        return (mean + scale * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(c.vocab_size, c.hidden_size, 1.0), "model.norm.weight": vec(c.hidden_size, 1, .3)}
    if not c.tie_word_embeddings:
        w["lm_head.weight"] = mat(c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = vec(c.hidden_size, 1, .3)
        w[p + "post_attention_layernorm.weight"] = vec(c.hidden_size, 1, .3)
        # Large q/k so that attention, and with it RoPE, matters.
        w[p + "self_attn.q_proj.weight"] = mat(c.q_size, c.hidden_size, 0.5)
        w[p + "self_attn.k_proj.weight"] = mat(c.kv_size, c.hidden_size, 0.5)
        w[p + "self_attn.v_proj.weight"] = mat(c.kv_size, c.hidden_size)
        w[p + "self_attn.o_proj.weight"] = mat(c.hidden_size, c.q_size)
        w[p + "mlp.gate_proj.weight"] = mat(c.intermediate_size, c.hidden_size)
        w[p + "mlp.up_proj.weight"] = mat(c.intermediate_size, c.hidden_size)
        w[p + "mlp.down_proj.weight"] = mat(c.hidden_size, c.intermediate_size)
        if c.attention_bias:
            w[p + "self_attn.q_proj.bias"] = vec(c.q_size, 0, .5)
            w[p + "self_attn.k_proj.bias"] = vec(c.kv_size, 0, .5)
            w[p + "self_attn.v_proj.bias"] = vec(c.kv_size, 0, .5)
    return w


def write_converted_gguf(path, case: dict, config: ModelConfig, weights: dict, tokens: list[str],
                         *, skip: tuple[str, ...] = (), rope_dim: int | None = None,
                         extra_tensors: dict | None = None, quantized: str | None = None) -> None:
    """What ``convert_hf_to_gguf.py`` writes for ``weights`` of a model of ``case`` (``skip``:
    tensors left out; ``rope_dim``: another ``rope.dimension_count``; ``extra_tensors``: GGUF
    name -> array, written as they are; ``quantized``: a GGML type, e.g. ``Q8_0``, that every
    matrix is stored in instead of the case's float type)."""
    c = config
    arch = case["arch"]
    writer = gguf.GGUFWriter(str(path), arch)
    # TextModel.set_gguf_parameters
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if case["hf_head_dim"]:
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if case["dtype"] == "F16" else gguf.LlamaFileType.ALL_F32)
    if case["converter"] == "LlamaModel":  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(c.vocab_size)
        writer.add_rope_dimension_count(rope_dim or c.head_dim)
    # The vocabulary (as write_tiny_llama in test_gguf.py and Qwen2's _set_vocab_gpt2 write it).
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(case["pre"])
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)
    # The tensors: converter names, LlamaModel.permute on q/k for LlamaModel architectures.
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2 if arch == "qwen2" else gguf.MODEL_ARCH.LLAMA,
                                        c.num_layers)
    for name, array in weights.items():
        if name.endswith(skip):
            continue
        if case["permuted"]:
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                array = llama_cpp_permute(array, c.num_heads, c.num_heads)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                array = llama_cpp_permute(array, c.num_heads, c.num_kv_heads)
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if array.ndim == 2 and quantized:
            qtype = gguf.GGMLQuantizationType[quantized]
            writer.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(array), qtype), raw_dtype=qtype)
            continue
        if array.ndim == 2 and case["dtype"] == "F16":
            array = array.astype(np.float16)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_config_json(case: dict, config: ModelConfig) -> dict:
    """The ``config.json`` such a model ships: its own class and model_type; Qwen2 configs name
    no ``attention_bias`` (the loader knows Qwen2 has q/k/v bias) and, like Mistral's, no
    ``head_dim``."""
    cfg = dict(config.to_hf(), architectures=[case["hf_arch"]], model_type=case["model_type"])
    if case["model_type"] != "llama":
        cfg.pop("attention_bias")
    if not case["hf_head_dim"]:
        cfg.pop("head_dim")
    return cfg


def build(tmp_path, case_id: str, tied: bool, *, skip: tuple[str, ...] = ()):
    """``(config, HF weights, GGUF-loaded (config, weights, tokenizer), HF-loaded (...))``; the
    ``skip``ped tensors are left out of the GGUF file and are zeros in the HF directory."""
    case = CASES[case_id]
    tokens = tiny_vocab()
    config = tiny_config(case, tied, len(tokens))
    weights = hf_weights(config, case["dtype"] == "F16", seed=len(case_id) * 2 + tied)
    for name in weights:
        if name.endswith(skip):
            weights[name] = np.zeros_like(weights[name])
    path = tmp_path / f"{case_id}.gguf"
    write_converted_gguf(path, case, config, weights, tokens, skip=skip)
    from_gguf = load_gguf(path, progress=False)
    directory = tmp_path / f"{case_id}-hf"
    save_hf_dir(directory, config, weights, from_gguf[2])
    (directory / "config.json").write_text(json.dumps(hf_config_json(case, config), indent=2))
    return config, weights, from_gguf, load_hf_dir(directory, progress=False)


def run_logits(config, weights, tokens: np.ndarray) -> np.ndarray:
    """Logits of a 10-token prefill, then a 3-row decode chunk from the cache."""
    model = LlamaModel(config, weights, PaddleAttention(), max_positions=64)
    model.attention.init_cache(8, BLOCK_SIZE)
    out = []
    for start, stop in ((0, 10), (10, len(tokens))):
        chunk = np.asarray(tokens[start:stop], np.int64)
        meta = AttentionMetadata.build([len(chunk)], [start], [TABLE], BLOCK_SIZE)
        out.append(np.asarray(model.forward(chunk, meta, np.arange(len(chunk), dtype=np.int64))))
    return np.concatenate(out)


TOKENS = np.random.default_rng(3).integers(0, 266, size=13)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_gguf_and_hf_give_the_same_logits(tmp_path, case_id, tied):
    config, weights, (g_config, g_weights, _), (h_config, h_weights, _) = build(tmp_path, case_id, tied)

    assert h_config == config  # the Hugging Face side reads back what was meant
    assert g_config == config  # the GGUF metadata, read per architecture
    g_logits = run_logits(g_config, g_weights, TOKENS)
    h_logits = run_logits(h_config, h_weights, TOKENS)
    assert g_logits.shape == (len(TOKENS), config.vocab_size)
    np.testing.assert_allclose(g_logits, h_logits, rtol=0, atol=1e-4)

    assert sorted(g_weights) == sorted(weights)  # and the weights are exactly the same
    for name, array in weights.items():
        np.testing.assert_array_equal(g_weights[name], array, err_msg=name)


def test_llama_with_only_some_qkv_biases(tmp_path):
    """llama.cpp's llama biases are each optional: the missing ones are zeros."""
    config, weights, (g_config, g_weights, _), (h_config, h_weights, _) = build(
        tmp_path, "llama-qkv_bias", False, skip=("v_proj.bias",))
    assert g_config == config and g_config.attention_bias
    for name, array in weights.items():
        np.testing.assert_array_equal(g_weights[name], array, err_msg=name)
    np.testing.assert_allclose(run_logits(g_config, g_weights, TOKENS), run_logits(h_config, h_weights, TOKENS),
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("case_id", list(CASES))
def test_the_logit_comparison_sees_the_qk_row_order(tmp_path, case_id):
    """Not vacuous: the same weights with the q/k rows in the other order (what the loader gets
    wrong when it applies the wrong convention) move the logits well beyond the tolerance."""
    config, weights, _, _ = build(tmp_path, case_id, tied=False)
    swapped = dict(weights)
    for name in weights:
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            swapped[name] = llama_cpp_permute(weights[name], config.num_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            swapped[name] = llama_cpp_permute(weights[name], config.num_kv_heads)
    delta = np.abs(run_logits(config, swapped, TOKENS) - run_logits(config, weights, TOKENS)).max()
    assert delta > 1e-2


@pytest.mark.parametrize("case_id", list(CASES))
def test_tokenizer_metadata_of_the_tiny_files(tmp_path, case_id):
    """The vocabulary the tiny files carry loads, and the HF directory written from it agrees."""
    _, _, (_, _, g_tok), (_, _, h_tok) = build(tmp_path, case_id, tied=True)
    hello, world = g_tok.token_to_id("hello"), g_tok.token_to_id("Ġworld")
    assert g_tok.encode("hello world") == [hello, world]
    assert g_tok.eos_token_ids == {0} and g_tok.vocab_size == 266
    for text in ("hello world", "hello wörld 123"):
        assert h_tok.encode(text) == g_tok.encode(text)
        assert g_tok.decode(g_tok.encode(text)) == text


def test_the_loader_table_lists_exactly_the_tested_architectures():
    """Adding an architecture to the loader's table means adding its case here."""
    from specdec.model.gguf_loader import ARCHITECTURES

    assert sorted(ARCHITECTURES) == ARCHS


# ------------------------------------------------------------------------------------------------
# Metadata and tensors the conventions require


def _write(tmp_path, case_id, weights=None, **kwargs):
    case = CASES[case_id]
    tokens = tiny_vocab()
    config = tiny_config(case, False, len(tokens))
    path = tmp_path / f"{case_id}.gguf"
    write_converted_gguf(path, case, config, dict(hf_weights(config, False, 0), **(weights or {})), tokens,
                         **kwargs)
    return path


def _error(path) -> str:
    with pytest.raises(SpecdecError) as info:
        load_gguf(path, progress=False)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("case_id,quantized,expected", [("llama", None, "none"), ("mistral", None, "none"),
                                                        ("llama", "Q8_0", "gguf")], ids=["F32", "F16", "Q8_0"])
def test_quantization_auto_follows_the_matrices_in_the_file(tmp_path, case_id, quantized, expected):
    """``quantization: auto`` on the CPU kernels is ``gguf`` for any GGUF file until loading looks
    inside: a file whose matrices are all F32 (or all F16) runs the float path (``none``), one of
    Q8_0 matrices computes on its blocks."""
    from specdec.config import EngineConfig
    from specdec.engine.build import build_model, resolve_quantization
    from specdec.kernels.cpu import cpu_ops_or_none
    from specdec.model.quant_weights import QuantizedWeights
    from specdec.plugin_manager import get_plugins

    if cpu_ops_or_none() is None:
        pytest.skip("the CPU kernels cannot be built here")
    case = CASES[case_id]
    tokens = tiny_vocab() + [f"<extra_{i}>" for i in range(6)]  # 272: float CPU kernels want 16s of columns
    model_config = tiny_config(case, False, len(tokens))
    path = tmp_path / f"{case_id}.gguf"
    write_converted_gguf(path, case, model_config, hf_weights(model_config, case["dtype"] == "F16", 0), tokens,
                         quantized=quantized)
    config = EngineConfig(model=str(path), quantization="auto", kernels="cpu")
    assert resolve_quantization(config, "cpu") == "gguf"  # from the file name alone
    built = build_model(config, get_plugins(), progress=False)
    assert built.quantization == expected
    assert isinstance(built.model.weights, QuantizedWeights) == (expected == "gguf")


def test_unknown_architecture_is_a_one_line_error_listing_the_supported_ones(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = _error(path)
    assert "'gpt2'" in message
    for arch in ARCHS:
        assert arch in message


def test_qwen2_without_its_qkv_biases_is_an_error(tmp_path):
    """llama.cpp's Qwen2 graph adds bq/bk/bv unconditionally: a qwen2 file without them is broken,
    not a bias-free model."""
    message = _error(_write(tmp_path, "qwen2", skip=("_proj.bias",)))
    assert "qwen2" in message and "blk.0.attn_q.bias" in message


def test_missing_rms_epsilon_is_an_error(tmp_path):
    """llama.cpp requires ``<arch>.attention.layer_norm_rms_epsilon``; guessing it (1e-5 vs the
    1e-6 of Qwen2) would silently change every norm."""
    path = tmp_path / "no_eps.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in (("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 96),
                       ("head_count", 4), ("context_length", 64)):
        getattr(writer, f"add_{key}")(value)
    writer.add_token_list(tiny_vocab())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "qwen2.attention.layer_norm_rms_epsilon" in _error(path)


def test_partial_rotary_is_an_error(tmp_path):
    """The decoder rotates the whole head; llama.cpp asserts n_rot == head_dim for these too."""
    message = _error(_write(tmp_path, "llama", rope_dim=16))
    assert "llama.rope.dimension_count" in message and "16" in message


@pytest.mark.parametrize("tensor", ["blk.1.attn_output.bias", "blk.0.ffn_down.bias", "output.bias"])
def test_a_bias_the_decoder_does_not_apply_is_an_error(tmp_path, tensor):
    """llama.cpp adds these biases when present; dropping them silently would change the model."""
    size = 266 if tensor == "output.bias" else 64
    message = _error(_write(tmp_path, "llama", extra_tensors={tensor: np.ones(size, np.float32)}))
    assert tensor in message


def test_rope_scaling_is_a_warning(tmp_path, caplog):
    """Llama 3's ``rope_freqs`` factors are not applied: loading works and says so."""
    path = _write(tmp_path, "llama", extra_tensors={"rope_freqs.weight": np.ones(16, np.float32)})
    with caplog.at_level("WARNING", logger="specdec.model.gguf_loader"):
        load_gguf(path, progress=False)
    assert "rope_freqs.weight" in caplog.text

