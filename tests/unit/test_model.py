"""The paddle decoder against a plain numpy reference forward, the two checkpoint loaders against
each other, and one sanity answer from the real model.

The reference below is written from the Llama / Qwen2 definitions, independently of
``specdec.model.llama``: RMSNorm, grouped-query attention with a causal mask, rotate-half RoPE
with the config's theta, SwiGLU, a tied or untied head. It runs in float64; the decoder runs in
float32 and must agree to 1e-3 on every logit, for a prefill and then for multi-row decode
chunks that continue from the KV cache (including rows a later chunk overwrites, as rejected
drafts are).
"""

from __future__ import annotations


import numpy as np
import pytest

from specdec.attention import AttentionMetadata
from specdec.model.config import ModelConfig
from specdec.model.llama import LlamaModel
from specdec.plugins.attention.paddle_backend import PaddleAttention

TOLERANCE = 1e-3


# ------------------------------------------------------------------------------------------------
# The numpy reference


def _rms_norm(x, gain, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rope(x, positions, theta):
    """x: [T, heads, D]; HF's rotate-half RoPE."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    angles = np.outer(positions.astype(np.float64), inv_freq)  # [T, D/2]
    emb = np.concatenate([angles, angles], axis=-1)[:, None, :]  # [T, 1, D]
    return x * np.cos(emb) + _rotate_half(x) * np.sin(emb)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def reference_logits(config: ModelConfig, weights: dict, token_ids) -> np.ndarray:
    """``[T, V]`` float64 logits of the whole sequence ``token_ids`` (positions 0..T-1)."""
    c = config
    w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    ids = np.asarray(token_ids)
    n = len(ids)
    positions = np.arange(n)
    x = w["model.embed_tokens.weight"][ids]
    causal = np.triu(np.full((n, n), -np.inf), k=1)
    group = c.num_heads // c.num_kv_heads
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = h @ w[p + "self_attn.q_proj.weight"].T
        k = h @ w[p + "self_attn.k_proj.weight"].T
        v = h @ w[p + "self_attn.v_proj.weight"].T
        if c.attention_bias:
            q = q + w[p + "self_attn.q_proj.bias"]
            k = k + w[p + "self_attn.k_proj.bias"]
            v = v + w[p + "self_attn.v_proj.bias"]
        q = _rope(q.reshape(n, c.num_heads, c.head_dim), positions, c.rope_theta)
        k = _rope(k.reshape(n, c.num_kv_heads, c.head_dim), positions, c.rope_theta)
        v = v.reshape(n, c.num_kv_heads, c.head_dim)
        out = np.empty((n, c.num_heads, c.head_dim))
        for head in range(c.num_heads):
            kv = head // group  # HF repeat_kv: query head h reads KV head h // group
            scores = q[:, head] @ k[:, kv].T / np.sqrt(c.head_dim) + causal
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[:, head] = (scores / scores.sum(axis=-1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (_silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x, w["model.norm.weight"], c.rms_norm_eps)
    head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
    return x @ head.T


def test_reference_itself_on_a_hand_case():
    """The reference's pieces on values worked out by hand, so it cannot be wrong in the same
    way as the code under test."""
    x = np.array([[[1.0, 2.0, 3.0, 4.0]]])
    np.testing.assert_allclose(_rotate_half(x), [[[-3.0, -4.0, 1.0, 2.0]]])
    # position 0: identity; position 1 with theta 1: angle 1 on every pair
    np.testing.assert_allclose(_rope(x, np.array([0]), 10000.0), x)
    got = _rope(x, np.array([1]), 1.0)[0, 0]
    c, s = np.cos(1.0), np.sin(1.0)
    np.testing.assert_allclose(got, [1 * c - 3 * s, 2 * c - 4 * s, 3 * c + 1 * s, 4 * c + 2 * s])
    np.testing.assert_allclose(_rms_norm(np.array([3.0, 4.0]), np.array([1.0, 2.0]), 0.0),
                               [3 / np.sqrt(12.5), 8 / np.sqrt(12.5)])


# ------------------------------------------------------------------------------------------------
# Driving the decoder as the engine does


BLOCK_SIZE = 8
#: Block tables of the (at most two) sequences a test runs at once: shuffled, non-contiguous.
TABLE_A = [9, 2, 14, 5, 12, 1]
TABLE_B = [0, 11, 7, 3, 13, 4]


def _with_cache(model):
    """Give ``model``'s attention backend a small paged cache (16 blocks of 8 positions)."""
    model.attention.init_cache(16, BLOCK_SIZE)
    return model


def _forward(model, table, tokens, context, logit_rows=None):
    tokens = np.asarray(tokens, dtype=np.int64)
    meta = AttentionMetadata.build([len(tokens)], [context], [table], BLOCK_SIZE)
    rows = np.arange(len(tokens), dtype=np.int64) if logit_rows is None else np.asarray(logit_rows, np.int64)
    return np.asarray(model.forward(tokens, meta, rows))


def _check(got, expected, what, tolerance=TOLERANCE):
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    error = float(np.max(np.abs(got - expected)))
    assert error < tolerance, f"{what}: max abs logit error {error:.3g} >= {tolerance}"
    if tolerance > TOLERANCE:  # a looser check (float16 weights): the choices must still agree
        assert np.array_equal(got.argmax(-1), expected.argmax(-1)), f"{what}: a different top-1 token"
    return error


def check_against_reference(model, config, weights, sequence, prefill: int, vocab_junk: int,
                            tolerance: float = TOLERANCE, expected=None):
    """Prefill ``sequence[:prefill]``, then decode chunks that continue from the cache.

    Chunk A writes 4 rows, of which only the first is real (the others play rejected drafts);
    chunk B then rewrites positions from ``prefill + 1`` on with the true tokens; a last chunk
    asks for a subset of its logit rows. ``expected`` defaults to the numpy reference's logits.
    """
    sequence = np.asarray(sequence, dtype=np.int64)
    total = len(sequence)
    assert total >= prefill + 6
    if expected is None:
        expected = reference_logits(config, weights, sequence)
    assert total + 8 <= len(TABLE_A) * BLOCK_SIZE
    _check(_forward(model, TABLE_A, sequence[:prefill], 0), expected[:prefill], "prefill", tolerance)
    junk = (sequence[prefill + 1: prefill + 4] + vocab_junk) % config.vocab_size
    chunk_a = np.concatenate([sequence[prefill: prefill + 1], junk])
    got_a = _forward(model, TABLE_A, chunk_a, prefill)
    _check(got_a[:1], expected[prefill: prefill + 1], "decode chunk A, row 0", tolerance)
    b_end = prefill + 4
    _check(_forward(model, TABLE_A, sequence[prefill + 1: b_end], prefill + 1),
           expected[prefill + 1: b_end], "decode chunk B (over rows chunk A left behind)", tolerance)
    last = sequence[b_end: total]
    rows = [0, len(last) - 1]
    _check(_forward(model, TABLE_A, last, b_end, rows), expected[b_end:][rows],
           "decode chunk C (subset of logit rows)", tolerance)


# ------------------------------------------------------------------------------------------------
# (a) small random configs: tied / untied head, with and without q/k/v bias (Qwen2-style)


def small_config(tied: bool, bias: bool) -> ModelConfig:
    # head_dim * num_heads (96) != hidden (48): o_proj is not square. Widths are multiples of 16
    # so that the CPU kernels can pack them too.
    return ModelConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6,
                       num_kv_heads=2, head_dim=16, rope_theta=500.0, rms_norm_eps=1e-6,
                       max_position_embeddings=64, tie_word_embeddings=tied, attention_bias=bias)


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    c = config
    rng = np.random.default_rng(seed)

    def mat(rows, cols, scale=None):
        return (rng.standard_normal((rows, cols)) * (scale or cols ** -0.5)).astype(np.float32)

    def gain(n):
        return (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(c.vocab_size, c.hidden_size, 1.0),
         "model.norm.weight": gain(c.hidden_size)}
    if not c.tie_word_embeddings:
        w["lm_head.weight"] = mat(c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = gain(c.hidden_size)
        w[p + "post_attention_layernorm.weight"] = gain(c.hidden_size)
        # Large enough query/key weights that attention is far from uniform.
        w[p + "self_attn.q_proj.weight"] = mat(c.q_size, c.hidden_size, 0.5)
        w[p + "self_attn.k_proj.weight"] = mat(c.kv_size, c.hidden_size, 0.5)
        w[p + "self_attn.v_proj.weight"] = mat(c.kv_size, c.hidden_size)
        w[p + "self_attn.o_proj.weight"] = mat(c.hidden_size, c.q_size)
        w[p + "mlp.gate_proj.weight"] = mat(c.intermediate_size, c.hidden_size)
        w[p + "mlp.up_proj.weight"] = mat(c.intermediate_size, c.hidden_size)
        w[p + "mlp.down_proj.weight"] = mat(c.hidden_size, c.intermediate_size)
        if c.attention_bias:
            w[p + "self_attn.q_proj.bias"] = (0.5 * rng.standard_normal(c.q_size)).astype(np.float32)
            w[p + "self_attn.k_proj.bias"] = (0.5 * rng.standard_normal(c.kv_size)).astype(np.float32)
            w[p + "self_attn.v_proj.bias"] = (0.5 * rng.standard_normal(c.kv_size)).astype(np.float32)
    return w


def _cpu_kernel_model(config, weights):
    """The engine's default path on these machines (CPU kernels + ``cpu`` attention). The
    kernels must build here (AVX2 and a C++ compiler): a failure to build fails the test."""
    from specdec.kernels.cpu import load_cpu_ops
    from specdec.plugins.attention.cpu_backend import CpuAttention

    load_cpu_ops()
    return _with_cache(LlamaModel(config, weights, CpuAttention(), max_positions=64, kernels="cpu",
                                  weight_dtype="float32"))


@pytest.mark.parametrize("tied, bias", [(True, False), (False, False), (True, True), (False, True)],
                         ids=["tied", "untied", "tied-qkv_bias", "untied-qkv_bias"])
@pytest.mark.parametrize("path", ["paddle", "cpu_kernels"])
def test_small_model_matches_reference(tied, bias, path):
    config = small_config(tied, bias)
    weights = random_weights(config, seed=int(tied) * 2 + int(bias))
    if path == "paddle":
        model = _with_cache(LlamaModel(config, weights, PaddleAttention()))
    else:
        model = _cpu_kernel_model(config, weights)
    sequence = np.random.default_rng(7).integers(0, config.vocab_size, size=20)
    check_against_reference(model, config, weights, sequence, prefill=12, vocab_junk=17)


def test_cpu_path_with_many_rows_matches_reference():
    """A prefill of several 6-row tiles plus a remainder (23 rows), then 1-row steps."""
    config = small_config(tied=False, bias=True)
    weights = random_weights(config, seed=5)
    model = _cpu_kernel_model(config, weights)
    sequence = np.random.default_rng(9).integers(0, config.vocab_size, size=33)
    check_against_reference(model, config, weights, sequence, prefill=23, vocab_junk=17)


def quantizable_config(tied: bool, bias: bool) -> ModelConfig:
    """Widths that are multiples of 64, as the quantized formats need."""
    return ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, rope_theta=500.0, rms_norm_eps=1e-6,
                       max_position_embeddings=64, tie_word_embeddings=tied, attention_bias=bias)


@pytest.mark.parametrize("tied, bias", [(True, False), (False, True)], ids=["tied", "untied-qkv_bias"])
@pytest.mark.parametrize("quantization", ["wint8", "wint4"])
def test_quantized_small_model_tracks_the_reference(tied, bias, quantization):
    """Float weights (as a safetensors checkpoint gives them) quantized at load, biases, the
    attention scale and an untied head included. Against the reference over the same
    quantized-then-dequantized weights, what is left is the kernels' int8 activations: a few
    percent of the logits' spread (measured 3.0-4.6%; a wrong scale, bias or row order is
    100%), the same top-1 almost everywhere. And chunked steps equal one prefill exactly, as
    each row's activations are quantized on their own."""
    from specdec.kernels.cpu import load_cpu_ops
    from specdec.model.quant import quantize
    from specdec.plugins.attention.cpu_backend import CpuAttention

    load_cpu_ops()
    config = quantizable_config(tied, bias)
    weights = random_weights(config, seed=21)
    model = _with_cache(LlamaModel(config, weights, CpuAttention(), max_positions=64, kernels="cpu",
                                   quantization=quantization))
    sequence = np.random.default_rng(4).integers(0, config.vocab_size, size=20)
    whole = _forward(model, TABLE_B, sequence, 0)
    rounded = {name: quantize(w, quantization).dequantize() if w.ndim == 2 else w for name, w in weights.items()}
    reference = reference_logits(config, rounded, sequence)
    relative = np.sqrt(((whole - reference) ** 2).mean()) / reference.std()
    assert relative < 0.08, relative
    assert np.mean(whole.argmax(-1) == reference.argmax(-1)) >= 0.85
    float_reference = reference_logits(config, weights, sequence)
    assert np.abs(whole - float_reference).max() > 1e-3  # the weights really are quantized
    check_against_reference(model, config, weights, sequence, prefill=12, vocab_junk=17, expected=whole)


def test_small_model_logits_are_not_trivial():
    """Guard against a vacuous comparison: logits vary across positions and the head matters."""
    config = small_config(tied=False, bias=True)
    weights = random_weights(config)
    sequence = np.arange(10) % config.vocab_size
    logits = reference_logits(config, weights, sequence)
    assert np.ptp(logits, axis=-1).min() > 1.0
    changed = dict(weights, **{"lm_head.weight": weights["lm_head.weight"] * 2})
    assert np.abs(reference_logits(config, changed, sequence) - logits).max() > 1.0


def test_packed_batch_of_two_requests():
    """Two requests in one forward (one prefilling, one decoding) equal their own references."""
    config = small_config(tied=False, bias=True)
    weights = random_weights(config, seed=3)
    model = _with_cache(LlamaModel(config, weights, PaddleAttention()))
    rng = np.random.default_rng(11)
    seq_a, seq_b = rng.integers(0, config.vocab_size, 14), rng.integers(0, config.vocab_size, 9)
    ref_a, ref_b = reference_logits(config, weights, seq_a), reference_logits(config, weights, seq_b)
    _forward(model, TABLE_A, seq_a[:10], 0, logit_rows=[])
    tokens = np.concatenate([seq_a[10:14], seq_b])
    meta = AttentionMetadata.build([4, 9], [10, 0], [TABLE_A, TABLE_B], BLOCK_SIZE)
    got = np.asarray(model.forward(tokens, meta, np.arange(13)))
    _check(got[:4], ref_a[10:14], "request A (decode rows)")
    _check(got[4:], ref_b, "request B (prefill rows)")


# ------------------------------------------------------------------------------------------------
# (b) the real model's weights



PROMPT_12 = ("The capital of France is Paris, and the capital of Italy is Rome. "
             "The capital of Spain is Madrid, and the capital of Germany is")


def _real_sequence(tokenizer, length):
    ids = tokenizer.encode(PROMPT_12)
    assert len(ids) >= length, len(ids)
    return np.asarray(ids[:length], dtype=np.int64)


@pytest.fixture(scope="module")
def gguf_model(real_checkpoint):
    config, weights, _ = real_checkpoint
    return _with_cache(LlamaModel(config, weights, PaddleAttention(), max_positions=64))


@pytest.mark.slow
def test_real_model_matches_reference(real_checkpoint, gguf_model):
    config, weights, tokenizer = real_checkpoint
    sequence = _real_sequence(tokenizer, 18)  # 12-token prefill, then decode chunks
    check_against_reference(gguf_model, config, weights, sequence, prefill=12, vocab_junk=1000)


@pytest.mark.slow
def test_real_model_cpu_kernels_match_reference(real_checkpoint):
    """The CPU kernels (float32 weights) on the real weights, to the same 1e-3."""
    config, weights, tokenizer = real_checkpoint
    model = _cpu_kernel_model(config, weights)
    check_against_reference(model, config, weights, _real_sequence(tokenizer, 18), prefill=12,
                            vocab_junk=1000)


#: float16 weights move the real model's logits (up to ~30) by a few hundredths; a wrong RoPE,
#: mask or cache row moves them by whole units.
FLOAT16_TOLERANCE = 0.15


@pytest.mark.slow
def test_engine_model_matches_reference(real_checkpoint, llm):
    """The model the engine actually runs (its default kernels, weights and attention backend).

    Float weights: 1e-3 from the numpy reference with float32 weights; with float16 weights
    within FLOAT16_TOLERANCE and the same top-1 token at every position. Quantized weights (the
    default GGUF file runs ``quantization: gguf``): the kernels quantize each row's activations
    on its own, so a row's logits cannot depend on how the rows were chunked: the chunks must
    give the logits of one prefill of the whole sequence within 1e-3 (their distance from the
    float path is tests/e2e/test_quantization.py's)."""
    config, weights, tokenizer = real_checkpoint
    weight_dtype = getattr(llm.engine, "weight_dtype", "float32")
    tolerance = TOLERANCE if weight_dtype == "float32" else FLOAT16_TOLERANCE
    sequence = _real_sequence(tokenizer, 18)
    expected = None
    if llm.engine.quantization != "none":
        expected = _forward(llm.engine.model, TABLE_B, sequence, 0)
        tolerance = TOLERANCE
    try:
        check_against_reference(llm.engine.model, config, weights, sequence, prefill=12, vocab_junk=1000,
                                tolerance=tolerance, expected=expected)
    finally:
        # The check wrote into blocks of the engine's cache behind the engine's back: prompt
        # prefixes cached there by earlier tests are gone, and a later request that reused
        # one would attend over these rows instead.
        llm.engine.reset_prefix_cache()


# ------------------------------------------------------------------------------------------------
# GGUF and safetensors loaders agree


@pytest.mark.slow
def test_gguf_and_safetensors_loaders_agree(real_checkpoint, gguf_model, tmp_path_factory):
    from specdec.model.hf_loader import load_hf_dir, save_hf_dir

    config, weights, tokenizer = real_checkpoint
    directory = tmp_path_factory.mktemp("hf_checkpoint")
    save_hf_dir(directory, config, weights, tokenizer)
    hf_config, hf_weights, hf_tokenizer = load_hf_dir(directory, progress=False)

    assert hf_config == config
    assert sorted(hf_weights) == sorted(weights)
    for name, array in weights.items():
        assert hf_weights[name].dtype == np.float32 and hf_weights[name].shape == array.shape, name
        assert np.array_equal(hf_weights[name], array), name

    hf_model = _with_cache(LlamaModel(hf_config, hf_weights, PaddleAttention(), max_positions=64))
    del hf_weights
    ids = _real_sequence(tokenizer, 12)
    logits = {}
    for label, model in (("gguf", gguf_model), ("hf", hf_model)):
        logits[label] = _forward(model, TABLE_A, ids, 0)
    assert np.max(np.abs(logits["gguf"] - logits["hf"])) < 1e-5

    texts = ["Hello world!", "def f(x):\n    return x ** 2  # café 🤗\n", "<|im_start|>user\nhi<|im_end|>",
             "Numbers 12345 and 3.14159", "  spaces   and\n\n\nnewlines  "]
    for text in texts:
        assert hf_tokenizer.encode(text) == tokenizer.encode(text), text
        assert hf_tokenizer.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    assert hf_tokenizer.chat_template == tokenizer.chat_template and tokenizer.chat_template
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert hf_tokenizer.apply_chat_template(chat) == tokenizer.apply_chat_template(chat)
    assert hf_tokenizer.encode_chat(chat) == tokenizer.encode_chat(chat)
    assert hf_tokenizer.eos_token_ids == tokenizer.eos_token_ids
    assert hf_tokenizer.bos_token_id == tokenizer.bos_token_id
    assert hf_tokenizer.vocab_size == tokenizer.vocab_size == config.vocab_size


@pytest.mark.slow
def test_default_model_knows_the_capital_of_germany(model_session):
    from specdec import SamplingParams

    [output] = model_session.run(None, ["What is the capital of Germany?"],
                                 SamplingParams(max_tokens=32, temperature=0.0))
    assert "Berlin" in output.text, output.text


def test_the_cpu_kernels_refuse_a_matrix_width_they_cannot_pack_in_one_line():
    import paddle

    from specdec.errors import SpecdecError
    from specdec.model.linear import CpuKernelLinear

    with pytest.raises(SpecdecError, match="multiple of 16; this model has one 20 wide: use --kernels paddle"):
        CpuKernelLinear(paddle, 1e-5, ops=None).pack(np.zeros((8, 20), dtype=np.float32))
