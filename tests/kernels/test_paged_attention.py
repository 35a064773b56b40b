"""The attention backends over the paged cache against dense causal attention.

Each case runs two steps of a random variable-length batch through a backend: the first fills
the cache (a mix of prefills and of requests that already hold context), the second adds new
rows to every request, as decoding and verification do. Blocks are handed out in a shuffled
order, so a request's pages are not contiguous. The expected output is plain causal attention
over each request's whole sequence in float64 numpy, written without any paging.
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec.attention import AttentionMetadata
from specdec.kernels.cpu import reference
from specdec.kernels.cpu.packing import pack_attention_metadata

HEADS, KV_HEADS, DIM = 4, 2, 16


def _rope_tables(max_positions: int):
    half = DIM // 2
    inv_freq = 1.0 / (10000.0 ** (np.arange(half) * 2 / DIM))
    angles = np.outer(np.arange(max_positions), inv_freq)
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1).astype(np.float32)
    sin = np.concatenate([-np.sin(angles), np.sin(angles)], axis=-1).astype(np.float32)
    return cos, sin


def _dense_attention(rows: np.ndarray, cos, sin, cache_dtype: str = "float32") -> np.ndarray:
    """Causal attention of a whole sequence ``rows [S, (H + 2*KVH) * D]`` (pre-RoPE), with keys
    and values rounded to ``cache_dtype`` as a cache of that dtype holds them."""
    seq = rows.reshape(len(rows), HEADS + 2 * KV_HEADS, DIM).astype(np.float64)
    c, s = cos[: len(rows)][:, None, :], sin[: len(rows)][:, None, :]
    roped = seq * c + np.roll(seq, DIM // 2, axis=-1) * s
    q, k, v = roped[:, :HEADS], roped[:, HEADS:HEADS + KV_HEADS], seq[:, HEADS + KV_HEADS:]
    k = k.astype(np.float32).astype(cache_dtype).astype(np.float64)
    v = v.astype(cache_dtype).astype(np.float64)
    out = np.zeros((len(rows), HEADS, DIM))
    causal = np.tril(np.ones((len(rows), len(rows)), dtype=bool))
    for h in range(HEADS):
        scores = np.where(causal, q[:, h] @ k[:, h // (HEADS // KV_HEADS)].T, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, h] = (probs / probs.sum(-1, keepdims=True)) @ v[:, h // (HEADS // KV_HEADS)]
    return out.reshape(len(rows), HEADS * DIM)


def _backend(name: str, block_size: int, num_blocks: int, cos, sin, cache_dtype: str = "float32"):
    if name == "paddle":
        from specdec.plugins.attention.paddle_backend import PaddleAttention as cls
    else:
        from specdec.plugins.attention.cpu_backend import CpuAttention as cls
    backend = cls()
    backend.setup(num_layers=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=cache_dtype,
                  rope_cos=cos, rope_sin=sin)
    backend.init_cache(num_blocks, block_size)
    return backend


@pytest.mark.parametrize("backend_name, cache_dtype", [("paddle", "float32"), ("cpu", "float32"), ("cpu", "float16")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_backend_equals_dense_attention_on_random_varlen_batches(backend_name, cache_dtype, seed):
    import paddle

    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([8, 16, 32]))
    batch = int(rng.integers(1, 7))
    first_lens = rng.integers(1, 50, size=batch)  # rows of step 1 (its context is 0)
    second_lens = rng.integers(1, 9, size=batch)  # rows of step 2 (decode + drafts, or a chunk)
    total = first_lens + second_lens
    max_blocks = int(-(-total.max() // block_size))
    num_blocks = int(sum(-(-t // block_size) for t in total)) + 3
    order = rng.permutation(num_blocks)
    tables, used = np.zeros((batch, max_blocks), dtype=np.int32), 0
    for b in range(batch):
        count = -(-int(total[b]) // block_size)
        tables[b, :count] = order[used:used + count]
        used += count
    cos, sin = _rope_tables(int(total.max()) + 1)
    backend = _backend(backend_name, block_size, num_blocks, cos, sin, cache_dtype)
    sequences = [rng.normal(size=(int(t), (HEADS + 2 * KV_HEADS) * DIM)).astype(np.float32) for t in total]

    for step, (context, lens) in enumerate([(np.zeros(batch, np.int64), first_lens), (first_lens, second_lens)]):
        meta = AttentionMetadata.build(lens, context, tables, block_size)
        packed = np.concatenate([seq[c:c + n] for seq, c, n in zip(sequences, context, lens)])
        backend.prepare(meta)
        got = backend.forward(0, paddle.to_tensor(packed), meta).numpy()
        want = np.concatenate([_dense_attention(seq[:c + n], cos, sin, cache_dtype)[c:]
                               for seq, c, n in zip(sequences, context, lens)])
        assert got.shape == want.shape
        assert np.abs(got - want).max() < 1e-4, f"step {step}"


def test_float16_cache_differs_from_float32_by_its_rounding_only():
    """Guard against a vacuous float16 case: the rounding of keys and values shows in the
    output, well above the 1e-4 bound of the float16 cases above, which pass only because
    their dense reference rounds the same way."""
    rng = np.random.default_rng(3)
    cos, sin = _rope_tables(40)
    rows = rng.normal(size=(40, (HEADS + 2 * KV_HEADS) * DIM)).astype(np.float32) * 4
    exact, rounded = _dense_attention(rows, cos, sin), _dense_attention(rows, cos, sin, "float16")
    assert np.abs(exact - rounded).max() > 1e-3


@pytest.mark.parametrize("cache_dtype", ["float32", "float16"])
def test_paged_kernel_matches_its_numpy_twin(cache_dtype):
    """The CPU kernel and ``reference.paged_attention`` agree on outputs and on the cache."""
    import paddle

    from specdec.kernels.cpu import load_cpu_ops

    ops = load_cpu_ops()
    rng = np.random.default_rng(7)
    block_size, num_blocks = 16, 12
    cos, sin = _rope_tables(64)
    context, lens = np.array([0, 20, 5], np.int32), np.array([9, 3, 17], np.int32)
    tables = np.array([[3, 0, 0], [7, 1, 0], [11, 4, 0]], np.int32)
    cu = np.array([0, 9, 12, 29], np.int32)
    cache = rng.normal(size=(num_blocks, 2 * KV_HEADS, block_size, DIM)).astype(cache_dtype)
    qkv = rng.normal(size=(29, (HEADS + 2 * KV_HEADS) * DIM)).astype(np.float32)
    want_out, want_cache = reference.paged_attention(qkv, cache, cos, sin, tables, cu, context, HEADS, KV_HEADS)
    cache_tensor = paddle.to_tensor(cache)
    got = ops.specdec_paged_attention(paddle.to_tensor(qkv), cache_tensor, paddle.to_tensor(cos), paddle.to_tensor(sin),
                                      paddle.to_tensor(pack_attention_metadata(tables, cu, context)), HEADS, KV_HEADS)
    np.testing.assert_allclose(got.numpy(), want_out, atol=1e-5)
    assert cache_tensor.numpy().dtype == want_cache.dtype == np.dtype(cache_dtype)
    # float16: the kernel rounds its float32 RoPE result, the twin its float64 one (cast to
    # float32 first), so an element may sit one half-precision step away.
    np.testing.assert_allclose(cache_tensor.numpy().astype(np.float32), want_cache.astype(np.float32),
                               atol=1e-6, rtol=1e-3 if cache_dtype == "float16" else 0)


def _run_kernel(ops, qkv, cache, cos, sin, tables, cu, context):
    import paddle

    cache_tensor = paddle.to_tensor(cache)
    out = ops.specdec_paged_attention(paddle.to_tensor(qkv), cache_tensor, paddle.to_tensor(cos),
                                      paddle.to_tensor(sin), paddle.to_tensor(pack_attention_metadata(tables, cu, context)),
                                      HEADS, KV_HEADS)
    return out.numpy(), cache_tensor.numpy()


def _shuffled_batch(rng, context: list[int], lens: list[int], block_size: int):
    """``(context, cu, tables, num_blocks)`` of a batch of requests holding ``context``
    positions each and adding ``lens`` rows, their cache blocks handed out in a shuffled order."""
    context, lens = np.array(context, np.int32), np.array(lens, np.int32)
    per_request = -(-(context + lens) // block_size)
    ids = rng.permutation(int(per_request.sum())).astype(np.int32)
    tables = np.zeros((len(lens), per_request.max()), np.int32)
    for b, start in enumerate(np.concatenate([[0], np.cumsum(per_request)[:-1]])):
        tables[b, :per_request[b]] = ids[start:start + per_request[b]]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return context, cu, tables, len(ids)


@pytest.mark.parametrize("cache_dtype", ["float32", "float16"])
def test_long_contexts_match_the_numpy_twin(cache_dtype):
    """Contexts of several 128-position chunks (the kernel's unit of a query's softmax), alone
    (chunks of one query block on different threads) and in a batch of many requests (a block's
    chunks one after another), with rows of a verify step crossing a chunk's end."""
    from specdec.kernels.cpu import load_cpu_ops

    ops = load_cpu_ops()
    rng = np.random.default_rng(11)
    block_size = 16
    cos, sin = _rope_tables(700)
    for context, lens in (([600], [1]), ([250], [9]), ([600, 130, 255, 0, 383, 127], [1, 6, 2, 20, 1, 3])):
        context, cu, tables, num_blocks = _shuffled_batch(rng, context, lens, block_size)
        cache = rng.normal(size=(num_blocks, 2 * KV_HEADS, block_size, DIM)).astype(cache_dtype)
        qkv = rng.normal(size=(int(cu[-1]), (HEADS + 2 * KV_HEADS) * DIM)).astype(np.float32) * 2
        want, _ = reference.paged_attention(qkv, cache, cos, sin, tables, cu, context, HEADS, KV_HEADS)
        got, _ = _run_kernel(ops, qkv, cache, cos, sin, tables, cu, context)
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_a_query_s_output_is_the_same_alone_in_a_verify_step_or_in_a_batch():
    """The promise that speculation changes only the speed rests on this: a row's attention
    gives the same floats whether it is decoded alone, verified with drafts after it, or
    batched with other requests (the kernel splits work differently in each case)."""
    from specdec.kernels.cpu import load_cpu_ops

    ops = load_cpu_ops()
    rng = np.random.default_rng(5)
    block_size, context = 16, 450
    cos, sin = _rope_tables(context + 64)
    blocks = -(-(context + 8) // block_size)
    cache = rng.normal(size=(8 * blocks, 2 * KV_HEADS, block_size, DIM)).astype(np.float16)
    tables = rng.permutation(8 * blocks).astype(np.int32).reshape(8, blocks)
    rows = rng.normal(size=(8 * 8, (HEADS + 2 * KV_HEADS) * DIM)).astype(np.float32)
    one = np.array([context], np.int32)
    alone, _ = _run_kernel(ops, rows[:1], cache, cos, sin, tables[:1], np.array([0, 1], np.int32), one)
    verify, _ = _run_kernel(ops, rows[:6], cache, cos, sin, tables[:1], np.array([0, 6], np.int32), one)
    contexts = np.array([context, 40, 300, 0, 129, 200, 10, 330], np.int32)
    batch, _ = _run_kernel(ops, rows[:8 * 3], cache, cos, sin, tables, np.arange(0, 25, 3, dtype=np.int32), contexts)
    np.testing.assert_array_equal(verify[:1], alone)
    np.testing.assert_array_equal(batch[:1], alone)


@pytest.mark.parametrize("cache_dtype", ["float32", "float16"])
def test_the_avx512_passes_give_the_avx2_passes_floats(cache_dtype, monkeypatch):
    """Where the CPU has AVX-512 the score and value passes run 16 floats wide; they must give
    the AVX2 passes' floats bit for bit (each score and each value column sums in the same
    order), so that outputs do not depend on the machine's vector width. The default model's
    shape (9 heads over 3 KV heads of 64), contexts of several chunks, decode, verify and batch
    rows. On a CPU without AVX-512 both runs take the AVX2 passes."""
    import paddle

    from specdec.kernels.cpu import load_cpu_ops

    ops = load_cpu_ops()
    rng = np.random.default_rng(13)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    cos = rng.uniform(-1, 1, size=(1100, dim)).astype(np.float32)
    sin = rng.uniform(-1, 1, size=(1100, dim)).astype(np.float32)
    for context, lens in (([300], [1]), ([300], [6]), ([1000], [3]), ([37, 600, 0, 129], [40, 1, 17, 6])):
        context, cu, tables, num_blocks = _shuffled_batch(rng, context, lens, block_size)
        cache = rng.normal(size=(num_blocks, 2 * kv_heads, block_size, dim)).astype(cache_dtype)
        qkv = rng.normal(size=(int(cu[-1]), (heads + 2 * kv_heads) * dim)).astype(np.float32)
        outs = []
        for isa in ("avx2", None):
            if isa is None:
                monkeypatch.delenv("SPECDEC_CPU_ISA", raising=False)
            else:
                monkeypatch.setenv("SPECDEC_CPU_ISA", isa)
            out = ops.specdec_paged_attention(paddle.to_tensor(qkv), paddle.to_tensor(cache), paddle.to_tensor(cos),
                                              paddle.to_tensor(sin),
                                              paddle.to_tensor(pack_attention_metadata(tables, cu, context)),
                                              heads, kv_heads)
            outs.append(out.numpy())
        np.testing.assert_array_equal(outs[1], outs[0])


def test_metadata_rows_come_from_the_block_tables():
    meta = AttentionMetadata.build([2, 1], [15, 3], [[4, 9, 5], [2, 0, 0]], 8)
    assert meta.cu_seqlens_q.tolist() == [0, 2, 3]
    assert meta.cu_seqlens_k.tolist() == [0, 17, 21]
    assert meta.positions.tolist() == [15, 16, 3]
    assert meta.batch_ids.tolist() == [0, 0, 1]
    assert meta.slot_mapping.tolist() == [9 * 8 + 7, 5 * 8 + 0, 2 * 8 + 3]
