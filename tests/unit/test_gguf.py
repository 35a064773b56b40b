"""GGUF reading: dequantization per type, llama.cpp's q/k row permutation, errors.

Small GGUF files are written with ``gguf.GGUFWriter``. Quantized blocks are built by hand from
the GGML block layouts, so the expected float arrays are exact:

- Q8_0: fp16 scale ``d`` + 32 int8 ``q``; value ``q * d``;
- Q4_0: fp16 ``d`` + 16 bytes; value ``(q - 8) * d``;
- Q4_1: fp16 ``d``, fp16 ``m`` + 16 bytes; value ``q * d + m``;

where, for the 4-bit types, byte ``j`` holds element ``j`` in its low nibble and element
``j + 16`` in its high nibble.
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec import SpecdecError
from specdec.model.gguf_loader import SUPPORTED_TYPES, dequantize, load_gguf, unpermute_rope
from byte_level import bytes_to_unicode  # tests/byte_level.py

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


# ------------------------------------------------------------------------------------------------
# Hand-built blocks


def _scales(rng, n):
    # Powers of two times small odd numbers: exact in fp16, products exact in fp32.
    return (rng.choice([1, 3, 5, 7], n) * 2.0 ** rng.integers(-8, -2, n)).astype(np.float16)


def q8_0(rng, rows, cols):
    """``(bytes [rows, cols/32*34], expected float32 [rows, cols])``."""
    blocks = cols // 32
    d = _scales(rng, rows * blocks).reshape(rows, blocks)
    q = rng.integers(-128, 128, (rows, blocks, 32)).astype(np.int8)
    raw = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1)
    expected = q.astype(np.float32) * d.astype(np.float32)[..., None]
    return raw.reshape(rows, -1), expected.reshape(rows, cols)


def _nibbles(q):
    """16 bytes per block: element j in the low nibble of byte j, element j+16 in the high one."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def q4_0(rng, rows, cols):
    blocks = cols // 32
    d = _scales(rng, rows * blocks).reshape(rows, blocks)
    q = rng.integers(0, 16, (rows, blocks, 32)).astype(np.uint8)
    raw = np.concatenate([d[..., None].view(np.uint8), _nibbles(q)], axis=-1)
    expected = (q.astype(np.float32) - 8.0) * d.astype(np.float32)[..., None]
    return raw.reshape(rows, -1), expected.reshape(rows, cols)


def q4_1(rng, rows, cols):
    blocks = cols // 32
    d = _scales(rng, rows * blocks).reshape(rows, blocks)
    m = (-_scales(rng, rows * blocks).astype(np.float32) * 4).astype(np.float16).reshape(rows, blocks)
    q = rng.integers(0, 16, (rows, blocks, 32)).astype(np.uint8)
    raw = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), _nibbles(q)], axis=-1)
    expected = q.astype(np.float32) * d.astype(np.float32)[..., None] + m.astype(np.float32)[..., None]
    return raw.reshape(rows, -1), expected.reshape(rows, cols)


def _fifth_bits(q):
    """4 bytes per block: bit j of the little-endian word is bit 4 of element j."""
    bits = ((q >> 4) & 1).astype(np.uint8)  # [..., 32]
    return np.packbits(bits, axis=-1, bitorder="little")


def q5_0(rng, rows, cols):
    blocks = cols // 32
    d = _scales(rng, rows * blocks).reshape(rows, blocks)
    q = rng.integers(0, 32, (rows, blocks, 32)).astype(np.uint8)
    raw = np.concatenate([d[..., None].view(np.uint8), _fifth_bits(q), _nibbles(q & 0xF)], axis=-1)
    expected = (q.astype(np.float32) - 16.0) * d.astype(np.float32)[..., None]
    return raw.reshape(rows, -1), expected.reshape(rows, cols)


def q5_1(rng, rows, cols):
    blocks = cols // 32
    d = _scales(rng, rows * blocks).reshape(rows, blocks)
    m = (-_scales(rng, rows * blocks).astype(np.float32) * 4).astype(np.float16).reshape(rows, blocks)
    q = rng.integers(0, 32, (rows, blocks, 32)).astype(np.uint8)
    raw = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), _fifth_bits(q),
                          _nibbles(q & 0xF)], axis=-1)
    expected = q.astype(np.float32) * d.astype(np.float32)[..., None] + m.astype(np.float32)[..., None]
    return raw.reshape(rows, -1), expected.reshape(rows, cols)


def f16(rng, rows, cols):
    data = rng.standard_normal((rows, cols)).astype(np.float16)
    return data, data.astype(np.float32)


def f32(rng, rows, cols):
    data = rng.standard_normal((rows, cols)).astype(np.float32)
    return data, data.copy()


BUILDERS = {"F32": f32, "F16": f16, "Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1}


def _add(writer, name, raw, type_name):
    if type_name in ("F32", "F16"):
        writer.add_tensor(name, raw)
    else:
        writer.add_tensor(name, raw, raw_dtype=Q[type_name])


def _finish(writer):
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_block_layout_of_hand_builders():
    """The builders follow the GGML layout: check one Q4_0 block byte by byte."""
    raw, expected = q4_0(np.random.default_rng(0), 1, 32)
    assert raw.shape == (1, 18)
    d = raw[0, :2].view(np.float16)[0]
    q = np.concatenate([raw[0, 2:] & 0x0F, raw[0, 2:] >> 4]).astype(np.float32)
    np.testing.assert_array_equal(expected[0], (q - 8) * np.float32(d))
    assert gguf.GGML_QUANT_SIZES[Q.Q4_0] == (32, 18)
    assert gguf.GGML_QUANT_SIZES[Q.Q4_1] == (32, 20)
    assert gguf.GGML_QUANT_SIZES[Q.Q8_0] == (32, 34)


@pytest.mark.parametrize("type_name", list(BUILDERS))
def test_dequantize_hand_built(tmp_path, type_name):
    rng = np.random.default_rng(len(type_name))
    raw, expected = BUILDERS[type_name](rng, 3, 64)
    path = tmp_path / f"{type_name}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    _add(writer, "blk.0.ffn_up.weight", raw, type_name)
    _finish(writer)
    [tensor] = gguf.GGUFReader(str(path)).tensors
    assert tensor.tensor_type.name == type_name
    got = dequantize(tensor)
    assert got.dtype == np.float32 and got.shape == (3, 64)  # HF [out, in]
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_dequantize_after_gguf_quantize(tmp_path, type_name):
    """Where ``gguf.quants.quantize`` supports a type, its round trip stays within one step."""
    if type_name not in SUPPORTED_TYPES:
        pytest.skip(f"{type_name} not supported by this build")
    rng = np.random.default_rng(5)
    data = rng.standard_normal((4, 64)).astype(np.float32)
    try:
        raw = gguf.quants.quantize(data, Q[type_name])
    except NotImplementedError:
        pytest.skip(f"gguf cannot quantize {type_name}")
    path = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("output.weight", raw, raw_dtype=Q[type_name])
    _finish(writer)
    [tensor] = gguf.GGUFReader(str(path)).tensors
    got = dequantize(tensor)
    assert got.shape == data.shape
    bits = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5}[type_name]
    block_range = np.abs(data.reshape(4, 2, 32)).max(axis=-1).repeat(32, axis=-1).reshape(4, 64)
    step = 2 * block_range / (2 ** bits - 1)
    assert np.all(np.abs(got - data) <= step + 1e-6)
    assert not np.array_equal(got, np.zeros_like(got))


def _unsupported_type():
    for name in ("Q2_K", "Q3_K", "IQ2_XXS", "TQ1_0"):
        if name not in SUPPORTED_TYPES and hasattr(Q, name):
            return Q[name]
    pytest.skip("every candidate type is supported")


def test_unsupported_type_is_a_one_line_error(tmp_path):
    qtype = _unsupported_type()
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((2, size), np.uint8), raw_dtype=qtype)
    _finish(writer)
    [tensor] = gguf.GGUFReader(str(path)).tensors
    with pytest.raises(SpecdecError) as info:
        dequantize(tensor)
    message = str(info.value)
    assert "\n" not in message
    assert "blk.0.attn_q.weight" in message and qtype.name in message
    assert "supported: " in message and "Q4_1" in message


# ------------------------------------------------------------------------------------------------
# llama.cpp's q/k permutation


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute`` (rotate-half order -> interleaved pairs)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def test_unpermute_hand_case():
    # One head of dim 4: HF rows [a0, a1, b0, b1] (first half a, second half b) are stored by
    # llama.cpp interleaved as [a0, b0, a1, b1].
    hf = np.array([[10.0], [11.0], [20.0], [21.0]])
    stored = np.array([[10.0], [20.0], [11.0], [21.0]])
    np.testing.assert_array_equal(llama_cpp_permute(hf, 1), stored)
    np.testing.assert_array_equal(unpermute_rope(stored, 1), hf)


@pytest.mark.parametrize("heads, head_dim, cols", [(1, 8, 5), (4, 8, 3), (9, 64, 2), (3, 64, 7)])
def test_unpermute_inverts_llama_cpp(heads, head_dim, cols):
    rng = np.random.default_rng(heads)
    weight = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
    stored = llama_cpp_permute(weight, heads)
    assert not np.array_equal(stored, weight)
    np.testing.assert_array_equal(unpermute_rope(stored, heads), weight)
    bias = rng.standard_normal(heads * head_dim).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope(llama_cpp_permute(bias, heads), heads), bias)


# ------------------------------------------------------------------------------------------------
# A whole tiny Llama GGUF through load_gguf


TINY = dict(hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64, layers=1, theta=500000.0, eps=1e-5, ctx=256)
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]

#: GGUF tensor (per layer where ``{i}``) -> (HF name, type, (rows, cols) in HF order, q/k heads)
LAYOUT = {
    "token_embd.weight": ("model.embed_tokens.weight", "Q8_0", ("vocab", 32), None),
    "blk.{i}.attn_norm.weight": ("model.layers.{i}.input_layernorm.weight", "F32", (32,), None),
    "blk.{i}.attn_q.weight": ("model.layers.{i}.self_attn.q_proj.weight", "Q4_0", (32, 32), "heads"),
    "blk.{i}.attn_k.weight": ("model.layers.{i}.self_attn.k_proj.weight", "Q4_1", (16, 32), "kv_heads"),
    "blk.{i}.attn_v.weight": ("model.layers.{i}.self_attn.v_proj.weight", "F16", (16, 32), None),
    "blk.{i}.attn_output.weight": ("model.layers.{i}.self_attn.o_proj.weight", "Q8_0", (32, 32), None),
    "blk.{i}.ffn_norm.weight": ("model.layers.{i}.post_attention_layernorm.weight", "F32", (32,), None),
    "blk.{i}.ffn_gate.weight": ("model.layers.{i}.mlp.gate_proj.weight", "Q4_1", (64, 32), None),
    "blk.{i}.ffn_up.weight": ("model.layers.{i}.mlp.up_proj.weight", "Q4_0", (64, 32), None),
    "blk.{i}.ffn_down.weight": ("model.layers.{i}.mlp.down_proj.weight", "F16", (32, 64), None),
    "output_norm.weight": ("model.norm.weight", "F32", (32,), None),
    "output.weight": ("lm_head.weight", "F32", ("vocab", 32), None),
}


def write_tiny_llama(path, *, untied=True):
    """Write a tiny Llama GGUF; return ``(expected HF weights, vocab size)``."""
    b2u = bytes_to_unicode()
    tokens = ["<|endoftext|>"] + [b2u[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES]
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(TINY["ctx"])
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(TINY["theta"])
    writer.add_layer_norm_rms_eps(TINY["eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (vocab - 1))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    rng = np.random.default_rng(123)
    expected = {}
    for gguf_name, (hf_name, type_name, shape, rope_heads) in LAYOUT.items():
        if gguf_name == "output.weight" and not untied:
            continue
        for i in range(TINY["layers"]) if "{i}" in gguf_name else [None]:
            name, hf = gguf_name.format(i=i), hf_name.format(i=i)
            if len(shape) == 1:
                raw = (1.0 + 0.25 * rng.standard_normal(shape[0])).astype(np.float32)
                writer.add_tensor(name, raw)
                expected[hf] = raw.copy()
                continue
            rows = vocab if shape[0] == "vocab" else shape[0]
            raw, values = BUILDERS[type_name](rng, rows, shape[1])
            if rope_heads is not None:
                # What convert_hf_to_gguf.py stores: whole rows permuted (blocks run along rows).
                order = llama_cpp_permute(np.arange(rows), TINY[rope_heads])
                raw = np.ascontiguousarray(raw[order])
            _add(writer, name, raw, type_name)
            expected[hf] = values
    _finish(writer)
    return expected, vocab


@pytest.mark.parametrize("untied", [True, False], ids=["untied", "tied"])
def test_load_tiny_llama(tmp_path, untied):
    path = tmp_path / "tiny.gguf"
    expected, vocab = write_tiny_llama(path, untied=untied)
    config, weights, tokenizer = load_gguf(path, progress=False)

    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers) == (vocab, 32, 64, 1)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 8)
    assert config.rope_theta == TINY["theta"] and config.max_position_embeddings == TINY["ctx"]
    assert config.rms_norm_eps == pytest.approx(TINY["eps"], rel=1e-6)
    assert config.tie_word_embeddings is (not untied)
    assert config.attention_bias is False

    assert sorted(weights) == sorted(expected)
    for name, values in expected.items():
        assert weights[name].dtype == np.float32, name
        assert weights[name].shape == values.shape, name
        np.testing.assert_array_equal(weights[name], values, err_msg=name)

    hello, world = tokenizer.token_to_id("hello"), tokenizer.token_to_id("Ġworld")
    assert tokenizer.encode("hello world") == [hello, world]
    assert tokenizer.decode(tokenizer.encode("hello wörld")) == "hello wörld"
    assert tokenizer.eos_token_ids == {0}


def test_q5_matrices_stay_blocks_with_keep_quantized(tmp_path, monkeypatch):
    """Q5_0 / Q5_1 matrices (the q rows permuted back for RoPE) load as the file's blocks, which
    dequantize to what the float loader reads; Q8_0 / Q4 ones too, F16 ones as float32."""
    from specdec.model.quant import QuantizedMatrix

    monkeypatch.setitem(LAYOUT, "blk.{i}.attn_q.weight",
                        ("model.layers.{i}.self_attn.q_proj.weight", "Q5_0", (32, 32), "heads"))
    monkeypatch.setitem(LAYOUT, "blk.{i}.ffn_gate.weight", ("model.layers.{i}.mlp.gate_proj.weight", "Q5_1", (64, 32),
                                                             None))
    path = tmp_path / "tiny.gguf"
    expected, _ = write_tiny_llama(path)
    _, weights, _ = load_gguf(path, progress=False, keep_quantized=True)
    for name, type_name in (("model.layers.0.self_attn.q_proj.weight", "Q5_0"),
                            ("model.layers.0.mlp.gate_proj.weight", "Q5_1"),
                            ("model.layers.0.mlp.up_proj.weight", "Q4_0")):
        matrix = weights[name]
        assert isinstance(matrix, QuantizedMatrix) and [s.type_name for s in matrix.segments] == [type_name], name
        np.testing.assert_array_equal(matrix.dequantize(), expected[name], err_msg=name)
    assert isinstance(weights["model.layers.0.mlp.down_proj.weight"], np.ndarray)  # F16


def test_load_tiny_llama_with_an_unsupported_tensor(tmp_path):
    path = tmp_path / "odd.gguf"
    qtype = _unsupported_type()
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 256), ("feed_forward_length", 256),
                       ("head_count", 4), ("context_length", 64), ("layer_norm_rms_eps", 1e-5)):
        getattr(writer, f"add_{key}")(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b"])
    writer.add_token_merges([])
    writer.add_tensor("output_norm.weight", np.ones(256, np.float32))
    writer.add_tensor("token_embd.weight", np.zeros((2, size), np.uint8), raw_dtype=qtype)
    _finish(writer)
    with pytest.raises(SpecdecError) as info:
        load_gguf(path, progress=False)
    assert "\n" not in str(info.value) and "token_embd.weight" in str(info.value)


# ------------------------------------------------------------------------------------------------
# Model aliases


def test_missing_alias_package_names_the_pip_command(monkeypatch):
    from specdec.model import resolve

    command = "pip install --no-deps specdec-test-ghost-model==9.9"
    monkeypatch.setitem(resolve.MODEL_ALIASES, "ghost-model",
                        ("specdec_test_no_such_package_xyz", "ghost.gguf", command))
    with pytest.raises(SpecdecError) as info:
        resolve.resolve_model_path("ghost-model")
    message = str(info.value)
    assert message == f"model 'ghost-model' is not installed: {command}"


def test_alias_package_without_the_file_names_the_pip_command(monkeypatch):
    from specdec.model import resolve

    command = "pip install --no-deps specdec-test-ghost-model==9.9"
    # A package that exists (specdec itself) but does not ship the file.
    monkeypatch.setitem(resolve.MODEL_ALIASES, "hollow-model", ("specdec", "hollow.gguf", command))
    with pytest.raises(SpecdecError) as info:
        resolve.resolve_model_path("hollow-model")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("model 'hollow-model': ") and "hollow.gguf is missing" in message
    assert message.endswith(f"reinstall with {command}")


def test_unknown_model_suggests_an_alias():
    from specdec.model import resolve

    with pytest.raises(SpecdecError) as info:
        resolve.resolve_model_path("smollm2-135m-instruc")
    message = str(info.value)
    assert "\n" not in message and "did you mean 'smollm2-135m-instruct'" in message


def test_llm_with_a_missing_alias_fails_before_loading(monkeypatch):
    import specdec
    from specdec.model import resolve

    command = "pip install --no-deps specdec-test-ghost-model==9.9"
    monkeypatch.setitem(resolve.MODEL_ALIASES, "ghost-model",
                        ("specdec_test_no_such_package_xyz", "ghost.gguf", command))
    with pytest.raises(SpecdecError, match="not installed: pip install --no-deps specdec-test-ghost-model==9.9"):
        specdec.LLM(model="ghost-model", progress=False)



# ------------------------------------------------------------------------------------------------
# The fast metadata parse


def _field_values(field):
    """A field's elements as plain Python values (bytes for strings), from parts/data."""
    return [bytes(part) if field.types[-1] == gguf.GGUFValueType.STRING else part.tolist()
            for part in (field.parts[i] for i in field.data)]


def _same_reader(fast, reference):
    assert list(fast.fields) == list(reference.fields)
    for name, expected in reference.fields.items():
        field = fast.fields[name]
        assert field.types == expected.types, name
        assert field.contents() == expected.contents(), name
        assert _field_values(field) == _field_values(expected), name
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset, t.data.shape) for t in fast.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset, t.data.shape) for t in reference.tensors]
    assert fast.data_offset == reference.data_offset


def _default_model_file() -> str:
    from specdec.model.resolve import resolve_model_path

    return str(resolve_model_path("smollm2-135m-instruct"))  # a one-line error names the pip command


def test_the_fast_reader_reads_what_gguf_reads_from_the_default_model():
    from specdec.model.gguf_file import fast_gguf_reader_class

    path = _default_model_file()
    _same_reader(fast_gguf_reader_class()(path), gguf.GGUFReader(path))


def test_the_fast_reader_reads_every_value_type(tmp_path):
    """Scalars of every type, strings (one not UTF-8), arrays of numbers, bools and strings."""
    from specdec.model.gguf_file import fast_gguf_reader_class

    path = tmp_path / "values.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 0.25])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.strs", ["a", "ü", ""])
    writer.add_tensor("w", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fast, reference = fast_gguf_reader_class()(str(path)), gguf.GGUFReader(str(path))
    _same_reader(fast, reference)
    assert fast.fields["t.strs"].contents() == ["a", "ü", ""]
    assert fast.fields["t.strs"].contents(1) == "ü"
    np.testing.assert_array_equal(fast.tensors[0].data, reference.tensors[0].data)


def test_a_truncated_gguf_is_a_one_line_error(tmp_path):
    from specdec.model.gguf_file import open_gguf_reader

    path = tmp_path / "truncated.gguf"
    path.write_bytes(open(_default_model_file(), "rb").read(100_000))
    with pytest.raises(SpecdecError, match="cannot read GGUF file"):
        open_gguf_reader(path)
