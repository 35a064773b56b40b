"""``specdec.sdk.QuantizedDecoderLayer`` and ``QuantizedLinear(norm_gain=...)``: a plugin's own
layer on the quantized kernels equals a float32 reference layer within quantization error, and
bit for bit the calls the target's quantized path (``QuantizedWeights``) makes for the same
weights."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.errors import SpecdecError
from specdec.model.config import ModelConfig
from specdec.sdk import QuantizedDecoderLayer, QuantizedLinear

paddle = pytest.importorskip("paddle")

H, I, HEADS, KV_HEADS, D, EPS = 128, 256, 4, 2, 32, 1e-5


def random_layer(rng, bias: bool) -> dict:
    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    w = {"self_attn.q_proj.weight": matrix(HEADS * D, H), "self_attn.k_proj.weight": matrix(KV_HEADS * D, H),
         "self_attn.v_proj.weight": matrix(KV_HEADS * D, H), "self_attn.o_proj.weight": matrix(H, HEADS * D),
         "mlp.gate_proj.weight": matrix(I, H), "mlp.up_proj.weight": matrix(I, H), "mlp.down_proj.weight": matrix(H, I),
         "input_layernorm.weight": rng.uniform(0.5, 1.5, H).astype(np.float32),
         "post_attention_layernorm.weight": rng.uniform(0.5, 1.5, H).astype(np.float32)}
    if bias:
        for part, size in (("q", HEADS * D), ("k", KV_HEADS * D), ("v", KV_HEADS * D)):
            w[f"self_attn.{part}_proj.bias"] = rng.standard_normal(size).astype(np.float32) * 0.1
    return w


def rms(x, gain):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * gain


def reference_attention_input(w, x):
    h = rms(x, w["input_layernorm.weight"])
    parts = [h @ w[f"self_attn.{p}_proj.weight"].T.astype(np.float64) for p in "qkv"]
    if "self_attn.q_proj.bias" in w:
        parts = [part + w[f"self_attn.{p}_proj.bias"] for part, p in zip(parts, "qkv")]
    parts[0] = parts[0] / np.sqrt(D)
    return np.concatenate(parts, axis=1)


def reference_output(w, attn, x):
    x1 = x + attn @ w["self_attn.o_proj.weight"].T.astype(np.float64)
    h = rms(x1, w["post_attention_layernorm.weight"])
    g, u = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
    return x1 + (g / (1 + np.exp(-g)) * u) @ w["mlp.down_proj.weight"].T


def relative_error(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


#: Largest error relative to the largest output: int8 per channel, int4 in groups of 32.
TOLERANCE = {"wint8": 0.03, "wint4": 0.15}


@pytest.mark.parametrize("method", ["wint8", "wint4"])
@pytest.mark.parametrize("bias", [False, True])
def test_layer_is_the_float_layer_within_quantization_error(method, bias):
    rng = np.random.default_rng(1)
    w = random_layer(rng, bias)
    layer = QuantizedDecoderLayer(w, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D, eps=EPS, method=method)
    x = rng.standard_normal((5, H)).astype(np.float32) * 3
    attn = rng.standard_normal((5, HEADS * D)).astype(np.float32)
    qkv = layer.attention_input(paddle.to_tensor(x))
    assert list(qkv.shape) == [5, (HEADS + 2 * KV_HEADS) * D]
    assert relative_error(qkv, reference_attention_input(w, x)) < TOLERANCE[method]
    out = layer.output(paddle.to_tensor(attn), paddle.to_tensor(x))
    assert relative_error(out, reference_output(w, attn, x)) < TOLERANCE[method]
    # A layer that drops the queries' 1/sqrt(head_dim) or the biases is far outside that.
    scaled = reference_attention_input(w, x)
    scaled[:, :HEADS * D] *= np.sqrt(D)
    assert relative_error(qkv, scaled) > 0.5


@pytest.mark.parametrize("bias", [False, True])
def test_layer_makes_the_targets_own_calls(bias):
    """The SDK layer and the target's quantized path share their code: same weights, same bits."""
    from specdec.kernels.cpu import load_cpu_ops
    from specdec.model.quant_weights import QuantizedWeights

    rng = np.random.default_rng(2)
    w = random_layer(rng, bias)
    config = ModelConfig(vocab_size=64, hidden_size=H, intermediate_size=I, num_layers=1, num_heads=HEADS,
                         num_kv_heads=KV_HEADS, head_dim=D, rms_norm_eps=EPS, tie_word_embeddings=True,
                         attention_bias=bias)
    model = {f"model.layers.0.{name}": value for name, value in w.items()}
    model["model.embed_tokens.weight"] = rng.standard_normal((64, H)).astype(np.float32)
    model["model.norm.weight"] = np.ones(H, np.float32)
    target = QuantizedWeights(paddle, config, model, load_cpu_ops(), "wint8")
    layer = QuantizedDecoderLayer(w, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D, eps=EPS, method="wint8")
    x = paddle.to_tensor(rng.standard_normal((3, H)).astype(np.float32))
    attn = paddle.to_tensor(rng.standard_normal((3, HEADS * D)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(layer.attention_input(x)), np.asarray(target.attention_input(0, x)))
    np.testing.assert_array_equal(np.asarray(layer.output(attn, x)), np.asarray(target.layer_output(0, attn, x)))


@pytest.mark.parametrize("method", ["wint8", "wint4"])
def test_linear_with_a_norm_gain_normalizes_on_the_way_in(method):
    rng = np.random.default_rng(3)
    weight = (rng.standard_normal((96, H)) / np.sqrt(H)).astype(np.float32)
    gain = rng.uniform(0.5, 1.5, H).astype(np.float32)
    x = rng.standard_normal((4, H)).astype(np.float32) * 5
    want = rms(x, gain) @ weight.T.astype(np.float64)
    got = QuantizedLinear(weight, method, norm_gain=gain, eps=EPS)(paddle.to_tensor(x))
    assert relative_error(got, want) < TOLERANCE[method]
    # Without the gain it is the plain matmul, as before.
    plain = QuantizedLinear(weight, method)(paddle.to_tensor(x))
    assert relative_error(plain, x.astype(np.float64) @ weight.T) < TOLERANCE[method]
    assert relative_error(plain, want) > 0.5


def test_bad_layers_are_refused_in_one_line():
    w = random_layer(np.random.default_rng(4), False)
    with pytest.raises(SpecdecError, match="quantization: must be one of wint8, wint4"):
        QuantizedDecoderLayer(w, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D, eps=EPS, method="fp8")
    del w["mlp.down_proj.weight"]
    with pytest.raises(SpecdecError, match="missing weights mlp.down_proj.weight"):
        QuantizedDecoderLayer(w, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D, eps=EPS)


def test_a_stack_of_layers_read_once_runs_as_its_layers_do_until_released():
    """``specdec_q_register_layers`` + ``specdec_q_decoder_layers`` (the target's one call for
    every layer) equal the layers' own calls; a released handle is refused, not read."""
    from specdec.model.quant_layer import layer_operands
    from specdec.plugins.attention.cpu_backend import CpuAttention
    from specdec.sdk import AttentionMetadata

    rng = np.random.default_rng(9)
    layers = [QuantizedDecoderLayer(random_layer(rng, bias), num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D,
                                    eps=EPS, method="wint4") for bias in (False, True)]
    ops = layers[0]._ops
    positions = 40
    cos = np.cos(np.outer(np.arange(positions), np.ones(D))).astype(np.float32)
    sin = np.sin(np.outer(np.arange(positions), np.ones(D))).astype(np.float32)
    x = paddle.to_tensor(rng.standard_normal((5, H)).astype(np.float32))
    meta = AttentionMetadata.build([5], [0], [[0]], 16)
    outputs = []
    for one_call in (True, False):
        cache = CpuAttention()
        cache.setup(num_layers=2, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D, dtype="float16",
                    rope_cos=cos, rope_sin=sin)
        cache.init_cache(2, 16)
        cache.prepare(meta)
        if one_call:
            handle = ops.specdec_q_register_layers([t for layer in layers for t in layer_operands(layer._layer)],
                                                   HEADS * D)
            caches, c, s, packed, heads, kv_heads = cache.kernel_operands()
            outputs.append(ops.specdec_q_decoder_layers(x, layers[0].attention_input(x), caches, c, s, packed, handle,
                                                        heads, kv_heads, EPS).numpy())
        else:
            h = x
            for index, layer in enumerate(layers):
                h = layer.output(cache.forward(index, layer.attention_input(h), meta), h)
            outputs.append(h.numpy())
    np.testing.assert_array_equal(outputs[0], outputs[1])
    ops.specdec_q_release(handle)
    with pytest.raises(Exception, match="no such handle"):
        ops.specdec_q_decoder_layers(x, layers[0].attention_input(x), caches, c, s, packed, handle, heads, kv_heads,
                                     EPS)
