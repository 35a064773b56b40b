"""The weight-only quantized CPU kernels against their numpy twins, on random GGML blocks of
every format they read, under every instruction-set path the CPU has (AVX2; AVX-512 VNNI; AMX
tiles for Q4_K and Q6_K matmuls of 32 rows or more)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from specdec.kernels.cpu import reference
from specdec.model.quant import (BLOCK_FORMATS, INTERLEAVED_TYPE_IDS, Q4K_INTERLEAVED_TYPE_ID,
                                 Q6K_INTERLEAVED_TYPE_ID, SLACK_BYTES, SPLIT_TYPE_IDS, QuantizedMatrix, Segment,
                                 deinterleave_q4k_rows, deinterleave_q6k_rows, deinterleave_rows, interleave_q4k_rows,
                                 interleave_q6k_rows, interleave_rows, layout_array, quantize, split_rows,
                                 unsplit_rows)

paddle = pytest.importorskip("paddle")


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


_VNNI = {"avx512_vnni", "avx512vl", "avx512bw"} <= _cpu_flags()
#: SPECDEC_CPU_ISA values: "avx2" and "avx512" force those paths; "amx" (not a value the kernels
#: know) leaves them the best the CPU has.
ISAS = ["avx2"] + (["avx512"] if _VNNI else []) + (["amx"] if _VNNI and {"amx_tile", "amx_int8"} <= _cpu_flags() else [])

#: Byte offsets of the half-precision scale fields in each block format (the rest of a block is
#: any bytes at all: nibbles, 6-bit scales, int8 values).
HALF_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.fixture(scope="module")
def ops():
    from specdec.kernels.cpu import load_cpu_ops

    return load_cpu_ops()


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    """Runs the test with the kernels on one instruction set (read at every call)."""
    monkeypatch.setenv("SPECDEC_CPU_ISA", request.param)
    return request.param


def random_blocks(rng, type_name: str, rows: int, cols: int) -> Segment:
    """``rows`` rows of random blocks: random bytes, with finite half-precision scales."""
    _, elems, size = BLOCK_FORMATS[type_name]
    blocks = rng.integers(0, 256, size=(rows, cols // elems, size), dtype=np.uint8)
    for offset in HALF_FIELDS[type_name]:
        scales = (rng.uniform(0.002, 0.05, size=(rows, cols // elems)) * rng.choice([-1, 1], (rows, cols // elems)))
        blocks[:, :, offset:offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(rows, cols // elems, 2)
    return Segment(type_name, blocks.reshape(rows, -1))


def tensors(matrix: QuantizedMatrix):
    data, layout = layout_array(matrix)
    return data, layout, paddle.to_tensor(data), paddle.to_tensor(layout)


def _close(got, want):
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * scale)


#: 19 weight rows: for Q4_0 / Q4_1 / Q8_0, a group of 16 interleaved and 3 rows split (Q8_0, and
#: Q4 rows whose length is a multiple of 64; Q4 rows of 160 and 96 stay as stored: layout_array).
@pytest.mark.parametrize("type_name,cols", [("Q8_0", 96), ("Q4_0", 160), ("Q4_0", 128), ("Q4_1", 96),
                                            ("Q4_1", 576), ("Q4_K", 256), ("Q4_K", 768), ("Q6_K", 512),
                                            ("Q5_0", 96), ("Q5_0", 896), ("Q5_1", 160), ("Q5_K", 256),
                                            ("Q5_K", 768)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16, 37])
def test_q_matmul_matches_reference(ops, isa, type_name, cols, rows):
    rng = np.random.default_rng(rows * 1000 + cols)
    matrix = QuantizedMatrix(cols, (random_blocks(rng, type_name, 19, cols),))  # odd N
    data, layout, data_t, layout_t = tensors(matrix)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    got = ops.specdec_q_matmul(paddle.to_tensor(x), paddle.empty([0]), data_t, layout_t, paddle.empty([0]),
                               1e-5, False).numpy()
    _close(got, reference.q_matmul(x, [], data, layout, [], 1e-5, False))
    # The twin is a faithful model: against float x, the int8 activations err by far more.
    exact = x.astype(np.float64) @ matrix.dequantize().T.astype(np.float64)
    assert np.abs(got - exact).max() > 10 * np.abs(got - reference.q_matmul(x, [], data, layout, [], 1e-5,
                                                                            False)).max()


@pytest.mark.parametrize("rows", [1, 4, 7])
def test_q_matmul_mixed_segments_norm_and_epilogue(ops, isa, rows):
    """q (Q4_K), k (Q4_K) and v (Q6_K) as one matrix, with RMSNorm, gain, column scale and bias."""
    rng = np.random.default_rng(rows)
    cols = 512
    matrix = QuantizedMatrix.stacked([
        QuantizedMatrix(cols, (random_blocks(rng, "Q4_K", 24, cols),)),
        QuantizedMatrix(cols, (random_blocks(rng, "Q4_K", 8, cols),)),
        QuantizedMatrix(cols, (random_blocks(rng, "Q6_K", 8, cols),)),
    ])
    assert [s.type_name for s in matrix.segments] == ["Q4_K", "Q6_K"]
    data, layout, data_t, layout_t = tensors(matrix)
    x = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    gain = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    epilogue = np.stack([rng.uniform(0.1, 1, 40), rng.standard_normal(40)]).astype(np.float32)
    got = ops.specdec_q_matmul(paddle.to_tensor(x), paddle.to_tensor(gain), data_t, layout_t,
                               paddle.to_tensor(epilogue), 1e-5, True).numpy()
    _close(got, reference.q_matmul(x, gain, data, layout, epilogue, 1e-5, True))


@pytest.mark.parametrize("cols,q4k_rows,q6k_rows", [(256, 19, 5), (768, 37, 11)])
@pytest.mark.parametrize("rows", range(1, 17))
def test_all_q4k_weight_matches_reference_and_mixed(ops, isa, cols, q4k_rows, q6k_rows, rows):
    """A weight of Q4_K rows only quantizes its activations per 256 alone (what the Q4_K kernel
    reads): it matches the twin, and gives bit for bit the Q4_K columns of the same rows stacked
    with Q6_K rows (whose activations are also quantized per 32)."""
    rng = np.random.default_rng(cols + rows)
    q4k = QuantizedMatrix(cols, (random_blocks(rng, "Q4_K", q4k_rows, cols),))
    q6k = QuantizedMatrix(cols, (random_blocks(rng, "Q6_K", q6k_rows, cols),))
    mixed = QuantizedMatrix.stacked([q4k, q6k])
    x = (rng.standard_normal((rows, cols)) * 2).astype(np.float32)
    x[0, :40] = 0  # an all-zero block of 32 (scale 0) inside a block of 256
    outputs = {}
    for name, matrix in (("q4k", q4k), ("q6k", q6k), ("mixed", mixed)):
        data, layout, data_t, layout_t = tensors(matrix)
        outputs[name] = ops.specdec_q_matmul(paddle.to_tensor(x), paddle.empty([0]), data_t, layout_t,
                                             paddle.empty([0]), 1e-5, False).numpy()
        _close(outputs[name], reference.q_matmul(x, [], data, layout, [], 1e-5, False))
    np.testing.assert_array_equal(outputs["mixed"][:, :q4k_rows], outputs["q4k"])
    np.testing.assert_array_equal(outputs["mixed"][:, q4k_rows:], outputs["q6k"])


def _run_on(monkeypatch, isa, op, *args):
    monkeypatch.setenv("SPECDEC_CPU_ISA", isa)
    out = op(*args)
    return [t.numpy() for t in out] if isinstance(out, (list, tuple)) else [out.numpy()]


@pytest.mark.parametrize("type_names", [("Q4_K",), ("Q6_K",), ("Q4_K", "Q6_K"), ("Q4_1",), ("Q4_0", "Q8_0"),
                                        ("Q5_0",), ("Q5_1",), ("Q5_K",), ("Q5_0", "Q8_0"), ("Q5_K", "Q6_K"),
                                        ("Q4_K", "Q5_K")])
@pytest.mark.parametrize("rows", [2, 6, 16, 50])
def test_a_row_is_the_same_bit_for_bit_alone_batched_and_on_every_isa(ops, monkeypatch, type_names, rows):
    """A row's output depends on that row alone: not on the rows it shares a matmul with (a
    prompt's prefill shares a step with other requests' decode rows) nor on the path (AVX2,
    AVX-512 VNNI, AMX tiles from 32 rows for Q4_K/Q6_K), which all do the same integer sums and
    the same float steps. With RMSNorm, gain, column scale and bias; 35 + 21 weight rows, so that
    some fall outside whole 16-row panels (K-quants) and groups (Q4_0, Q4_1, Q8_0: split)."""
    rng = np.random.default_rng(rows + len(type_names))
    cols = 768
    matrix = QuantizedMatrix.stacked([QuantizedMatrix(cols, (random_blocks(rng, name, count, cols),))
                                      for name, count in zip(type_names, (35, 21))])
    _, _, data_t, layout_t = tensors(matrix)
    x = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    gain = paddle.to_tensor(rng.uniform(0.5, 1.5, cols).astype(np.float32))
    n = sum(s.rows for s in matrix.segments)
    epilogue = paddle.to_tensor(np.stack([rng.uniform(0.1, 1, n), rng.standard_normal(n)]).astype(np.float32))
    run = lambda isa, rows_x: _run_on(monkeypatch, isa, ops.specdec_q_matmul, paddle.to_tensor(rows_x), gain, data_t,  # noqa: E731
                                      layout_t, epilogue, 1e-5, True)[0]
    together = run(ISAS[-1], x)
    for isa in ISAS[:-1]:
        np.testing.assert_array_equal(run(isa, x), together, err_msg=isa)
    alone = np.concatenate([run(ISAS[-1], x[i:i + 1]) for i in range(rows)])
    np.testing.assert_array_equal(alone, together)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_values_sum_exactly_on_every_isa(ops, monkeypatch, type_name, sign):
    """Every weight at its largest value (nibbles of 15, Q5's fifth bits set: 31; Q4_K's scales
    and mins 63; Q6_K's values 63, its scales -1; Q8_0's bytes of 0x80, -128) against
    activations at +-127: the AVX2 kernels add up 16-bit pair sums (eight of 4-bit values, as
    Q4_K's group kernel does a sub-block's, four of 5-bit ones) before widening them, and
    maddubs saturates a pair of Q6_K's 6-bit values (2 * 63 * 127) at 16 bits: a sum that
    wrapped or saturated would be off by thousands of steps. 6 rows (one AVX2 tile) and one row."""
    cols = 768 if type_name.endswith("_K") else 576
    _, elems, size = BLOCK_FORMATS[type_name]
    blocks = np.full((19, cols // elems, size), 0x80 if type_name == "Q8_0" else 0xFF, dtype=np.uint8)
    for offset in HALF_FIELDS[type_name]:
        blocks[:, :, offset:offset + 2] = np.float16(0.01).reshape(1).view(np.uint8)
    matrix = QuantizedMatrix(cols, (Segment(type_name, blocks.reshape(19, -1)),))
    data, layout, data_t, layout_t = tensors(matrix)
    for rows in (6, 1):
        x = np.full((rows, cols), sign, dtype=np.float32)
        results = [_run_on(monkeypatch, isa, ops.specdec_q_matmul, paddle.to_tensor(x), paddle.empty([0]), data_t,
                           layout_t, paddle.empty([0]), 1e-5, False)[0] for isa in ISAS]
        _close(results[0], reference.q_matmul(x, [], data, layout, [], 1e-5, False))
        for isa, got in zip(ISAS[1:], results[1:]):
            np.testing.assert_array_equal(got, results[0], err_msg=isa)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_activation_blocks_quantize_alike_on_every_isa(ops, monkeypatch, type_name):
    """An activation row's blocks of 32 are quantized sixteen at a time on AVX-512 and eight at
    a time on AVX2 (their maxima, scales and int8 sums as vectors), the rest one by one. 33
    blocks (groups of 16 or 8 and one left over) with all-zero blocks (scale 0) in and out of
    the groups, a block of one tiny value and one of huge ones: the same floats on every path."""
    rng = np.random.default_rng(33)
    cols = 33 * 32
    matrix = QuantizedMatrix(cols, (random_blocks(rng, type_name, 21, cols),))
    data, layout, data_t, layout_t = tensors(matrix)
    for rows in (1, 6):
        x = (rng.standard_normal((rows, cols)) * 2).astype(np.float32)
        for zero_block in (3, 17, 32):
            x[:, 32 * zero_block: 32 * zero_block + 32] = 0
        x[:, 32 * 20: 32 * 21] = 0
        x[:, 32 * 20 + 7] = 1e-30
        x[:, 32 * 25: 32 * 26] *= 1e30
        results = [_run_on(monkeypatch, isa, ops.specdec_q_matmul, paddle.to_tensor(x), paddle.empty([0]), data_t,
                           layout_t, paddle.empty([0]), 1e-5, False)[0] for isa in ISAS]
        for isa, got in zip(ISAS[1:], results[1:]):
            np.testing.assert_array_equal(got, results[0], err_msg=isa)
        assert np.isfinite(results[0]).all()


@pytest.mark.parametrize("rows", [5, 20])
def test_a_k_quant_layer_is_the_same_bit_for_bit_alone_batched_and_on_every_isa(ops, monkeypatch, rows):
    """The same for q_layer_tail_qkv on a Q4_K_M-like layer (o, gate/up Q4_K; down Q6_K; qkv
    Q4_K with Q6_K v): residual epilogues, SwiGLU and the next layer's projection."""
    rng = np.random.default_rng(90 + rows)
    hidden, inner = 512, 768
    mats = [QuantizedMatrix(hidden, (random_blocks(rng, "Q4_K", hidden, hidden),)),
            QuantizedMatrix(hidden, (random_blocks(rng, "Q4_K", 2 * inner, hidden),)),
            QuantizedMatrix(inner, (random_blocks(rng, "Q6_K", hidden, inner),)),
            QuantizedMatrix.stacked([QuantizedMatrix(hidden, (random_blocks(rng, "Q4_K", 96, hidden),)),
                                     QuantizedMatrix(hidden, (random_blocks(rng, "Q6_K", 32, hidden),))])]
    parts = [tensors(m) for m in mats]
    gain, next_gain = (paddle.to_tensor(rng.uniform(0.5, 1.5, hidden).astype(np.float32)) for _ in range(2))
    epilogue = paddle.to_tensor(np.stack([rng.uniform(0.1, 1, 128), rng.standard_normal(128)]).astype(np.float32))
    attn = rng.standard_normal((rows, hidden)).astype(np.float32)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)

    def run(isa, lo, hi):
        return _run_on(monkeypatch, isa, ops.specdec_q_layer_tail_qkv, paddle.to_tensor(attn[lo:hi]),
                       paddle.to_tensor(x[lo:hi]), parts[0][2], parts[0][3], gain, parts[1][2], parts[1][3],
                       parts[2][2], parts[2][3], next_gain, parts[3][2], parts[3][3], epilogue, 1e-5)

    together = run(ISAS[-1], 0, rows)
    for isa in ISAS[:-1]:
        for got, want in zip(run(isa, 0, rows), together):
            np.testing.assert_array_equal(got, want, err_msg=isa)
    alone = [run(ISAS[-1], i, i + 1) for i in range(rows)]
    for k, want in enumerate(together):
        np.testing.assert_array_equal(np.concatenate([a[k] for a in alone]), want)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q5_K"])
@pytest.mark.parametrize("rows", [1, 6, 9, 40])
def test_long_rows_in_several_row_tiles_and_chunks(ops, isa, type_name, rows):
    """Rows of 4096 elements against 41 weight rows (three parallel chunks of up to 16), one to
    three tiles of activation rows, with the epilogue: every output written once, correctly."""
    rng = np.random.default_rng(rows)
    cols = 4096
    matrix = QuantizedMatrix(cols, (random_blocks(rng, type_name, 41, cols),))
    data, layout, data_t, layout_t = tensors(matrix)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    epilogue = np.stack([rng.uniform(0.1, 1, 41), rng.standard_normal(41)]).astype(np.float32)
    got = ops.specdec_q_matmul(paddle.to_tensor(x), paddle.empty([0]), data_t, layout_t, paddle.to_tensor(epilogue),
                               1e-5, False).numpy()
    _close(got, reference.q_matmul(x, [], data, layout, epilogue, 1e-5, False))


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_q_layer_tail_matches_reference(ops, isa, rows):
    rng = np.random.default_rng(50 + rows)
    hidden, inner = 128, 192
    wo = QuantizedMatrix(hidden, (random_blocks(rng, "Q4_1", hidden, hidden),))
    gate_up = QuantizedMatrix.stacked([QuantizedMatrix(hidden, (random_blocks(rng, "Q4_0", inner, hidden),)),
                                       QuantizedMatrix(hidden, (random_blocks(rng, "Q8_0", inner, hidden),))])
    down = QuantizedMatrix(inner, (random_blocks(rng, "Q4_1", hidden, inner),))
    attn = rng.standard_normal((rows, hidden)).astype(np.float32)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    gain = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    parts = [tensors(m) for m in (wo, gate_up, down)]
    got = ops.specdec_q_layer_tail(paddle.to_tensor(attn), paddle.to_tensor(x), parts[0][2], parts[0][3],
                                   paddle.to_tensor(gain), parts[1][2], parts[1][3], parts[2][2], parts[2][3],
                                   1e-5).numpy()
    want = reference.q_layer_tail(attn, x, parts[0][0], parts[0][1], gain, parts[1][0], parts[1][1], parts[2][0],
                                  parts[2][1], 1e-5)
    _close(got, want)


def test_q_layer_tail_in_row_chunks_gives_each_row_its_own_floats(ops, isa):
    """A long prompt's MLP runs in chunks of rows (its [rows, 2 * inner] gate/up output under
    30 MiB: 240 rows at inner 16384): 500 rows in one call are the same floats, bit for bit,
    as the same rows in three calls of at most one chunk each."""
    rng = np.random.default_rng(57)
    hidden, inner, rows = 64, 16384, 500
    wo = QuantizedMatrix(hidden, (random_blocks(rng, "Q4_1", hidden, hidden),))
    gate_up = QuantizedMatrix(hidden, (random_blocks(rng, "Q4_0", 2 * inner, hidden),))
    down = QuantizedMatrix(inner, (random_blocks(rng, "Q4_1", hidden, inner),))
    attn = rng.standard_normal((rows, hidden)).astype(np.float32)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    gain = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    parts = [tensors(m) for m in (wo, gate_up, down)]

    def tail(a, b):
        return ops.specdec_q_layer_tail(paddle.to_tensor(attn[a:b]), paddle.to_tensor(x[a:b]), parts[0][2],
                                        parts[0][3], paddle.to_tensor(gain), parts[1][2], parts[1][3], parts[2][2],
                                        parts[2][3], 1e-5).numpy()

    np.testing.assert_array_equal(tail(0, rows), np.concatenate([tail(0, 200), tail(200, 400), tail(400, rows)]))


@pytest.mark.parametrize("rows", [1, 5])
def test_q_layer_tail_qkv_matches_reference(ops, isa, rows):
    """The tail of one layer and the next layer's attention input, in one call."""
    rng = np.random.default_rng(70 + rows)
    hidden, inner, qkv_rows = 256, 256, 96
    mats = [QuantizedMatrix(hidden, (random_blocks(rng, "Q4_K", hidden, hidden),)),
            QuantizedMatrix(hidden, (random_blocks(rng, "Q4_1", 2 * inner, hidden),)),
            QuantizedMatrix(inner, (random_blocks(rng, "Q6_K", hidden, inner),)),
            QuantizedMatrix.stacked([QuantizedMatrix(hidden, (random_blocks(rng, "Q4_K", 64, hidden),)),
                                     QuantizedMatrix(hidden, (random_blocks(rng, "Q8_0", 32, hidden),))])]
    parts = [tensors(m) for m in mats]
    attn = rng.standard_normal((rows, hidden)).astype(np.float32)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    gain, next_gain = (rng.uniform(0.5, 1.5, hidden).astype(np.float32) for _ in range(2))
    epilogue = np.stack([rng.uniform(0.1, 1, qkv_rows), rng.standard_normal(qkv_rows)]).astype(np.float32)
    got_x, got_qkv = ops.specdec_q_layer_tail_qkv(
        paddle.to_tensor(attn), paddle.to_tensor(x), parts[0][2], parts[0][3], paddle.to_tensor(gain), parts[1][2],
        parts[1][3], parts[2][2], parts[2][3], paddle.to_tensor(next_gain), parts[3][2], parts[3][3],
        paddle.to_tensor(epilogue), 1e-5)
    want_x, want_qkv = reference.q_layer_tail_qkv(attn, x, parts[0][0], parts[0][1], gain, parts[1][0], parts[1][1],
                                                  parts[2][0], parts[2][1], next_gain, parts[3][0], parts[3][1],
                                                  epilogue, 1e-5)
    _close(got_x.numpy(), want_x)
    _close(got_qkv.numpy(), want_qkv)


@pytest.mark.parametrize("type_name,cols", [("Q8_0", 64), ("Q4_0", 64), ("Q4_1", 96), ("Q4_K", 256),
                                            ("Q6_K", 256), ("Q5_0", 96), ("Q5_1", 64), ("Q5_K", 512)])
def test_q_embedding_matches_gguf_dequantize(ops, type_name, cols):
    """Rows from whole groups of 16 (interleaved, for Q4_0 / Q4_1 / Q8_0, and for Q4_K and Q6_K
    whatever this CPU's own layout) and from the rest."""
    rng = np.random.default_rng(cols)
    matrix = QuantizedMatrix(cols, (random_blocks(rng, type_name, 37, cols),))
    data, layout = layout_array(matrix, interleave_k=True)
    data_t, layout_t = paddle.to_tensor(data), paddle.to_tensor(layout)
    ids = np.array([3, 0, 36, 17, 31, 3], dtype=np.int64)
    got = ops.specdec_q_embedding(paddle.to_tensor(ids), data_t, layout_t, cols).numpy()
    np.testing.assert_allclose(got, reference.q_embedding(ids, data, layout, cols), rtol=1e-6, atol=1e-7)


def _ggml_q5_dequantize(type_name: str, blocks: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 / Q5_K blocks ``[n, size]`` dequantized as ggml-common.h's layouts and
    ggml's dequantize_row_q5_* read them, written out element by element (float64): a second
    reference, independent of both the kernels and the ``gguf`` package."""
    def half(field):
        return np.ascontiguousarray(field).view(np.float16).astype(np.float64)[:, 0]

    n = len(blocks)
    out = np.zeros((n, BLOCK_FORMATS[type_name][1]))
    if type_name in ("Q5_0", "Q5_1"):
        d = half(blocks[:, 0:2])
        m = half(blocks[:, 2:4]) if type_name == "Q5_1" else -16 * d
        start = 4 if type_name == "Q5_1" else 2
        qh = blocks[:, start:start + 4].astype(np.uint32)
        qh = qh[:, 0] | qh[:, 1] << 8 | qh[:, 2] << 16 | qh[:, 3] << 24
        qs = blocks[:, start + 4:start + 20]
        for j in range(16):
            out[:, j] = d * ((qs[:, j] & 0xF) | ((qh >> j) & 1) << 4) + m
            out[:, j + 16] = d * ((qs[:, j] >> 4) | ((qh >> (j + 16)) & 1) << 4) + m
        return out
    d, dmin = half(blocks[:, 0:2]), half(blocks[:, 2:4])
    scales, qh, ql = blocks[:, 4:16].astype(np.int64), blocks[:, 16:48], blocks[:, 48:176]

    def scale_min(j):  # ggml's get_scale_min_k4
        if j < 4:
            return scales[:, j] & 63, scales[:, j + 4] & 63
        return ((scales[:, j + 4] & 0xF) | ((scales[:, j - 4] >> 6) << 4),
                (scales[:, j + 4] >> 4) | ((scales[:, j] >> 6) << 4))

    for pair in range(4):
        (sc1, m1), (sc2, m2) = scale_min(2 * pair), scale_min(2 * pair + 1)
        q = ql[:, 32 * pair:32 * pair + 32]
        for e in range(32):
            high1 = ((qh[:, e] >> (2 * pair)) & 1) * 16
            high2 = ((qh[:, e] >> (2 * pair + 1)) & 1) * 16
            out[:, 64 * pair + e] = d * sc1 * ((q[:, e] & 0xF) + high1) - dmin * m1
            out[:, 64 * pair + 32 + e] = d * sc2 * ((q[:, e] >> 4) + high2) - dmin * m2
    return out


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1", "Q5_K"])
def test_q5_blocks_dequantize_as_ggml_and_the_kernels_read_them(ops, type_name):
    """The 5-bit formats' fields as ggml lays them out (written out here) give what the ``gguf``
    package dequantizes (the twin's ground truth), and the kernels' embedding lookup (their
    unpacking of the blocks, as stored and interleaved) gives the same values."""
    import gguf

    rng = np.random.default_rng(11)
    _, elems, size = BLOCK_FORMATS[type_name]
    cols = 2 * elems
    segment = random_blocks(rng, type_name, 21, cols)
    blocks = np.asarray(segment.data).reshape(-1, size)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name]).reshape(-1, elems)
    np.testing.assert_allclose(want, _ggml_q5_dequantize(type_name, blocks), rtol=1e-6, atol=1e-7)
    data, layout, data_t, layout_t = tensors(QuantizedMatrix(cols, (segment,)))
    # Q5_0 / Q5_1: a group of 16 interleaved, 5 rows as stored; Q5_K: 21 rows as stored.
    assert layout[-1, :2].tolist() == [BLOCK_FORMATS[type_name][0], 5 if type_name in INTERLEAVED_TYPE_IDS else 21]
    got = ops.specdec_q_embedding(paddle.to_tensor(np.arange(21, dtype=np.int64)), data_t, layout_t, cols).numpy()
    np.testing.assert_allclose(got, want.reshape(21, cols), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_split_rows_move_bytes_only(type_name):
    rng = np.random.default_rng(3)
    segment = random_blocks(rng, type_name, 5, 192)
    split = split_rows(type_name, segment.data)
    assert split.shape == segment.data.shape
    assert sorted(split.reshape(-1).tolist()) == sorted(segment.data.reshape(-1).tolist())
    np.testing.assert_array_equal(unsplit_rows(type_name, split), segment.data)
    data, layout = layout_array(QuantizedMatrix(192, (segment,)))
    assert layout[0, 0] == SPLIT_TYPE_IDS[type_name] and len(data) == segment.data.nbytes + SLACK_BYTES


@pytest.mark.parametrize("type_name,cols", [("Q4_0", 192), ("Q4_1", 96), ("Q8_0", 64)])
def test_interleaved_rows_move_bytes_only(type_name, cols):
    """Whole groups of 16 rows interleave; the 5 rows left over are split (or, for Q4 rows of a
    length that is not a multiple of 64, stay as stored)."""
    rng = np.random.default_rng(4)
    segment = random_blocks(rng, type_name, 37, cols)
    grouped = interleave_rows(type_name, segment.data[:32])
    assert grouped.shape == (32, segment.data.shape[1])
    assert sorted(grouped.reshape(-1).tolist()) == sorted(segment.data[:32].reshape(-1).tolist())
    np.testing.assert_array_equal(deinterleave_rows(type_name, grouped), segment.data[:32])
    # Lane r of the first 64 bytes is row r's first 4 quant bytes.
    quant_start = BLOCK_FORMATS[type_name][2] - (32 if type_name == "Q8_0" else 16)
    np.testing.assert_array_equal(grouped.reshape(-1)[:64].reshape(16, 4),
                                  segment.data[:16, quant_start:quant_start + 4])
    data, layout = layout_array(QuantizedMatrix(cols, (segment,)))
    rest = SPLIT_TYPE_IDS[type_name] if type_name == "Q8_0" or cols % 64 == 0 else BLOCK_FORMATS[type_name][0]
    assert layout[:, :2].tolist() == [[INTERLEAVED_TYPE_IDS[type_name], 32], [rest, 5]]
    np.testing.assert_array_equal(data[:grouped.nbytes], grouped.reshape(-1))
    with pytest.raises(ValueError, match="groups of 16"):
        interleave_rows(type_name, segment.data[:20])


#: Per K-quant: how it interleaves and back, its kernel type id, its interleaved super-block's
#: bytes, and (interleaved bytes, the first 16 rows' bytes they hold) pairs to check.
K_INTERLEAVINGS = {
    # nibble bytes 4..7, scale word 1, d, dmin
    "Q4_K": (interleave_q4k_rows, deinterleave_q4k_rows, Q4K_INTERLEAVED_TYPE_ID, 2304,
             [((64, 128, 4), (20, 24)), ((2112, 2176, 4), (8, 12)), ((2240, 2272, 2), (0, 2)),
              ((2272, 2304, 2), (2, 4))]),
    # ql bytes 4..7, qh bytes 4..7, scales 4..7, d
    "Q6_K": (interleave_q6k_rows, deinterleave_q6k_rows, Q6K_INTERLEAVED_TYPE_ID, 3360,
             [((64, 128, 4), (4, 8)), ((2112, 2176, 4), (132, 136)), ((3136, 3200, 4), (196, 200)),
              ((3328, 3360, 2), (208, 210))]),
}


@pytest.mark.parametrize("type_name", sorted(K_INTERLEAVINGS))
def test_interleaved_k_quant_rows_move_bytes_only(type_name):
    """Q4_K / Q6_K groups of 16 rows: each field of a super-block 4 (or, d and dmin, 2) bytes a
    row, row after row (Q4_K: nibbles, the 12 scale bytes as three words, d, dmin; Q6_K: ql,
    qh, the 16 scales as four words, d); the 5 rows left over stay as stored."""
    interleave, deinterleave, type_id, block_bytes, fields = K_INTERLEAVINGS[type_name]
    rng = np.random.default_rng(5)
    segment = random_blocks(rng, type_name, 37, 512)
    grouped = interleave(segment.data[:32])
    assert grouped.shape == (32, segment.data.shape[1])
    np.testing.assert_array_equal(deinterleave(grouped), segment.data[:32])
    block = grouped.reshape(-1)[:block_bytes]  # the first group's first super-block
    for (start, end, word), (a, b) in fields:
        np.testing.assert_array_equal(block[start:end].reshape(16, word), segment.data[:16, a:b])
    data, layout = layout_array(QuantizedMatrix(512, (segment,)), interleave_k=True)
    assert layout[:, :2].tolist() == [[type_id, 32], [BLOCK_FORMATS[type_name][0], 5]]
    np.testing.assert_array_equal(data[:grouped.nbytes], grouped.reshape(-1))
    _, stored = layout_array(QuantizedMatrix(512, (segment,)), interleave_k=False)
    assert stored[:, :2].tolist() == [[BLOCK_FORMATS[type_name][0], 37]]


def test_k_quant_layouts_follow_the_kernel_path_the_process_runs(monkeypatch):
    """Q4_K is interleaved on every path; Q6_K on the AVX-512 VNNI path only (its 256-bit
    interleaved kernel is not faster than the stored rows)."""
    from specdec.kernels.cpu import has_avx512_vnni
    from specdec.model.quant import interleave_k_here

    monkeypatch.setenv("SPECDEC_CPU_ISA", "avx2")
    assert interleave_k_here("Q4_K") and not interleave_k_here("Q6_K")
    monkeypatch.setenv("SPECDEC_CPU_ISA", "avx512")
    assert interleave_k_here("Q4_K")
    assert interleave_k_here("Q6_K") == has_avx512_vnni()


def test_weights_are_prefetched_non_temporally_on_a_zen_5_only():
    from specdec.kernels.cpu import prefetch_hint_for

    def cpuinfo(vendor: str, family: int, flags: str) -> str:
        block = f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nflags\t\t: fpu {flags}\n"
        return block + "\n" + block.replace("processor\t: 0", "processor\t: 1")

    assert prefetch_hint_for(cpuinfo("AuthenticAMD", 25, "avx2 avx512f avx512_vnni")) == "l2"  # Zen 4
    assert prefetch_hint_for(cpuinfo("AuthenticAMD", 25, "avx2")) == "l2"  # Zen 3
    assert prefetch_hint_for(cpuinfo("AuthenticAMD", 23, "avx2")) == "l2"  # Zen 2
    assert prefetch_hint_for(cpuinfo("AuthenticAMD", 26, "avx2 avx512f avx512_vnni")) == "nta"  # Zen 5
    assert prefetch_hint_for(cpuinfo("GenuineIntel", 6, "avx2 avx512f avx512_vnni amx_int8")) == "l2"
    assert prefetch_hint_for("") == "l2"


def test_the_kernel_path_a_benchmark_prints_follows_the_forced_isa_and_the_prefetch_hint(monkeypatch):
    """kernel_path, which the benchmarks print beside the CPU, names what SPECDEC_CPU_ISA and
    SPECDEC_PREFETCH ask for."""
    from specdec.kernels.cpu import kernel_path

    monkeypatch.setenv("SPECDEC_CPU_ISA", "avx2")
    monkeypatch.setenv("SPECDEC_PREFETCH", "nta")
    assert kernel_path() == "AVX2, weights prefetched non-temporally"
    monkeypatch.setenv("SPECDEC_CPU_ISA", "avx512")
    monkeypatch.setenv("SPECDEC_PREFETCH", "l2")
    assert kernel_path() == ("AVX-512 VNNI" if _VNNI else "AVX2") + ", weights prefetched into L2"


def test_the_kernels_are_told_this_cpu_s_prefetch_hint(ops):
    """load_cpu_ops sets SPECDEC_PREFETCH before the library loads, where the kernels read it
    (the tests leave it unset: set by hand, it would be kept)."""
    from specdec.kernels.cpu import PREFETCH_ENV, prefetch_hint_here

    assert os.environ[PREFETCH_ENV] == prefetch_hint_here()


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 48])
def test_interleaved_k_quants_are_the_stored_rows_bit_for_bit(ops, isa, rows, type_name):
    """The interleaved Q4_K and Q6_K kernels do the stored-row kernels' integer sums and float
    steps: the same outputs bit for bit, with RMSNorm, gain, column scale and bias, on every
    ISA (AMX tiles read both layouts at 48 rows); and both match the twin (which reads the interleaved bytes back through
    deinterleave_q4k_rows / deinterleave_q6k_rows)."""
    rng = np.random.default_rng(60 + rows)
    cols = 1536
    matrix = QuantizedMatrix(cols, (random_blocks(rng, type_name, 53, cols),))
    x = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    x[0, :300] = 0  # an all-zero super-block (activation scale 0)
    gain = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    epilogue = np.stack([rng.uniform(0.1, 1, 53), rng.standard_normal(53)]).astype(np.float32)
    outputs = []
    for interleave in (True, False):
        data, layout = layout_array(matrix, interleave_k=interleave)
        assert (layout[0, 0] in (Q4K_INTERLEAVED_TYPE_ID, Q6K_INTERLEAVED_TYPE_ID)) == interleave
        got = ops.specdec_q_matmul(paddle.to_tensor(x), paddle.to_tensor(gain), paddle.to_tensor(data),
                                   paddle.to_tensor(layout), paddle.to_tensor(epilogue), 1e-5, True).numpy()
        _close(got, reference.q_matmul(x, gain, data, layout, epilogue, 1e-5, True))
        outputs.append(got)
    np.testing.assert_array_equal(outputs[0], outputs[1])


@pytest.mark.parametrize("rows", [15, 16, 33])
def test_stored_q6k_prompt_rows_through_the_group_kernel_are_the_stored_kernel_s_floats(ops, isa, rows):
    """Where Q6_K rows stay as stored (a Zen 4's AVX-512), 16 or more activation rows run on
    the interleaved kernel, each 64 weight rows interleaved into a buffer as they go
    (quant_matmul.inc, q6k_rows_through_groups): the outputs equal the interleaved layout's bit
    for bit, in a matrix of two segments (the second's rows start at 70) with rows left over
    after the last group of 16."""
    rng = np.random.default_rng(80 + rows)
    cols = 512
    matrix = QuantizedMatrix(cols, (random_blocks(rng, "Q6_K", 70, cols), random_blocks(rng, "Q6_K", 37, cols)))
    x = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    outputs = []
    for interleave in (True, False):
        data, layout = layout_array(matrix, interleave_k=interleave)
        got = ops.specdec_q_matmul(paddle.to_tensor(x), paddle.empty([0], dtype="float32"), paddle.to_tensor(data),
                                   paddle.to_tensor(layout), paddle.empty([0], dtype="float32"), 0.0, False).numpy()
        _close(got, reference.q_matmul(x, np.zeros(0), data, layout, np.zeros((0,)), 0.0, False))
        outputs.append(got)
    np.testing.assert_array_equal(outputs[0], outputs[1])


@pytest.mark.parametrize("type_name,cols", [("Q5_0", 96), ("Q5_1", 64)])
def test_interleaved_q5_rows_move_bits_only(type_name, cols):
    """Q5 groups: nibbles, d and m moved as Q4's bytes, each row's 32 fifth bits reordered (bit t
    of byte i: element 4t + i); the 5 rows left over stay as stored."""
    rng = np.random.default_rng(5)
    segment = random_blocks(rng, type_name, 37, cols)
    grouped = interleave_rows(type_name, segment.data[:32])
    assert grouped.shape == (32, segment.data.shape[1])
    np.testing.assert_array_equal(deinterleave_rows(type_name, grouped), segment.data[:32])
    high = 2 if type_name == "Q5_0" else 4
    bits = np.unpackbits(segment.data[:16, high:high + 4], axis=1, bitorder="little")  # row r, element j
    moved = np.unpackbits(grouped.reshape(-1)[256:320].reshape(16, 4), axis=1, bitorder="little")
    for t in range(8):
        for i in range(4):
            np.testing.assert_array_equal(moved[:, 8 * i + t], bits[:, 4 * t + i])
    data, layout = layout_array(QuantizedMatrix(cols, (segment,)))
    assert layout[:, :2].tolist() == [[INTERLEAVED_TYPE_IDS[type_name], 32], [BLOCK_FORMATS[type_name][0], 5]]


def test_q_matmul_rejects_mismatched_rows(ops):
    matrix = QuantizedMatrix(256, (random_blocks(np.random.default_rng(0), "Q4_K", 4, 256),))
    _, _, data_t, layout_t = tensors(matrix)
    with pytest.raises(Exception, match="do not hold 288 elements"):
        ops.specdec_q_matmul(paddle.ones([1, 288]), paddle.empty([0]), data_t, layout_t, paddle.empty([0]),
                             1e-5, False)


@pytest.mark.parametrize("method,worst", [("wint8", 0.005), ("wint4", 0.13)])
def test_load_time_quantization_round_trips(method, worst):
    """wint8 keeps one scale per output channel; wint4 one per group of 32 (Q4_0: steps of max/8,
    and the side opposite the largest magnitude clips at 7/8 of it)."""
    rng = np.random.default_rng(7)
    weight = rng.standard_normal((24, 96)).astype(np.float32)
    matrix = quantize(weight, method)
    assert matrix.shape == (24, 96)
    restored = matrix.dequantize()
    error = np.abs(restored - weight).max(axis=1) / np.abs(weight).max(axis=1)
    assert error.max() < worst
    if method == "wint8":  # every element of a row is a multiple of the row's one scale
        steps = restored / (np.abs(restored).max(axis=1, keepdims=True) / 127)
        np.testing.assert_allclose(steps, np.rint(steps), atol=1e-3)


def test_rows_that_are_not_whole_groups_are_a_one_line_error():
    from specdec.errors import SpecdecError
    from specdec.model.quant_weights import as_quantized

    with pytest.raises(SpecdecError, match=r"^quantization: x\.weight: .*48 elements.*use quantization: none$"):
        as_quantized(np.zeros((4, 48), np.float32), "wint8", "x.weight")


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("from_table", [True, False])
def test_q_draft_input_is_its_separate_calls_bit_for_bit(ops, isa, rows, from_table):
    """A draft head's input in one call (embedding rows of a quantized table, or given ones;
    two normalized projections, their sum, the layer's q/k/v) equals the lookup, the two
    q_matmul calls, the add and the q/k/v q_matmul made one by one, and its twin."""
    rng = np.random.default_rng(90 + rows + 10 * from_table)
    hidden, vocab, qkv_rows = 256, 40, 96
    table = QuantizedMatrix(hidden, (random_blocks(rng, "Q4_1", vocab, hidden),))
    we, wh = (QuantizedMatrix(hidden, (random_blocks(rng, name, hidden, hidden),)) for name in ("Q8_0", "Q4_K"))
    wqkv = QuantizedMatrix(hidden, (random_blocks(rng, "Q4_0", qkv_rows, hidden),))
    (t, tl, t_t, tl_t), (e, el, e_t, el_t), (h, hl, h_t, hl_t), (q, ql, q_t, ql_t) = map(tensors, (table, we, wh, wqkv))
    ids = rng.integers(0, vocab, rows)
    states = rng.standard_normal((rows, hidden)).astype(np.float32)
    e_gain, h_gain, attn_gain = (rng.uniform(0.5, 1.5, hidden).astype(np.float32) for _ in range(3))
    epilogue = np.stack([rng.uniform(0.1, 1, qkv_rows), rng.standard_normal(qkv_rows)]).astype(np.float32)
    embeds = ops.specdec_q_embedding(paddle.to_tensor(ids), t_t, tl_t, hidden)
    none = paddle.empty([0])
    if from_table:
        args = (none, t_t, tl_t)
    else:
        args = (embeds, paddle.empty([0], dtype="uint8"), paddle.empty([0, 4], dtype="int64"))
    got_x, got_qkv = ops.specdec_q_draft_input(
        *args, paddle.to_tensor(states), paddle.to_tensor(e_gain), e_t, el_t, paddle.to_tensor(h_gain), h_t, hl_t,
        paddle.to_tensor(attn_gain), q_t, ql_t, paddle.to_tensor(epilogue), ids.tolist(), hidden, 1e-5, True, True)
    x = (ops.specdec_q_matmul(embeds, paddle.to_tensor(e_gain), e_t, el_t, none, 1e-5, True)
         + ops.specdec_q_matmul(paddle.to_tensor(states), paddle.to_tensor(h_gain), h_t, hl_t, none, 1e-5, True))
    qkv = ops.specdec_q_matmul(x, paddle.to_tensor(attn_gain), q_t, ql_t, paddle.to_tensor(epilogue), 1e-5, True)
    np.testing.assert_array_equal(got_x.numpy(), x.numpy())
    np.testing.assert_array_equal(got_qkv.numpy(), qkv.numpy())
    want_x, want_qkv = reference.q_draft_input(embeds.numpy(), t if from_table else [], tl, states, e_gain, e, el,
                                               h_gain, h, hl, attn_gain, q, ql, epilogue, ids, hidden, 1e-5, True, True)
    _close(got_x.numpy(), want_x)
    _close(got_qkv.numpy(), want_qkv)


@pytest.mark.parametrize("rows,picked", [(1, [0]), (5, [4]), (5, [1, 3, 4])])
def test_q_layer_tail_head_is_the_tail_then_the_head_on_picked_rows(ops, isa, rows, picked):
    """A layer's tail and a normalized projection of some of its rows (a draft head's LM head)
    in one call: the tail's output as q_layer_tail gives it, and the head's rows as q_matmul
    gives them for those rows alone, bit for bit; and the twin."""
    rng = np.random.default_rng(110 + rows + len(picked))
    hidden, inner, vocab = 128, 192, 72
    mats = [QuantizedMatrix(hidden, (random_blocks(rng, "Q4_1", hidden, hidden),)),
            QuantizedMatrix(hidden, (random_blocks(rng, "Q4_0", 2 * inner, hidden),)),
            QuantizedMatrix(inner, (random_blocks(rng, "Q8_0", hidden, inner),)),
            QuantizedMatrix(hidden, (random_blocks(rng, "Q8_0", vocab, hidden),))]
    parts = [tensors(m) for m in mats]
    attn = rng.standard_normal((rows, hidden)).astype(np.float32)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    gain, head_gain = (rng.uniform(0.5, 1.5, hidden).astype(np.float32) for _ in range(2))
    tail = (paddle.to_tensor(attn), paddle.to_tensor(x), parts[0][2], parts[0][3], paddle.to_tensor(gain),
            parts[1][2], parts[1][3], parts[2][2], parts[2][3])
    got_out, got_logits = ops.specdec_q_layer_tail_head(*tail, paddle.to_tensor(head_gain), parts[3][2], parts[3][3],
                                                        picked, 1e-5)
    out = ops.specdec_q_layer_tail(*tail, 1e-5).numpy()
    np.testing.assert_array_equal(got_out.numpy(), out)
    logits = ops.specdec_q_matmul(paddle.to_tensor(out[picked]), paddle.to_tensor(head_gain), parts[3][2],
                                  parts[3][3], paddle.empty([0]), 1e-5, True).numpy()
    np.testing.assert_array_equal(got_logits.numpy(), logits)
    want_out, want_logits = reference.q_layer_tail_head(attn, x, parts[0][0], parts[0][1], gain, parts[1][0],
                                                        parts[1][1], parts[2][0], parts[2][1], head_gain, parts[3][0],
                                                        parts[3][1], picked, 1e-5)
    _close(got_out.numpy(), want_out)
    _close(got_logits.numpy(), want_logits)
