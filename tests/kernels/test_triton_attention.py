"""The Triton attention kernels against their numpy twins, and the ``triton`` backend against
dense causal attention, all in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``).

Steps are random packed batches mixing prefill chunks (with and without context) and decode
rows (``1 + k`` per request), with GQA ratios 1, 3 and 8, lengths that straddle cache blocks
and block tables handed out in a shuffled order. With float16 / bfloat16 caches the kernel
rounds the softmax probabilities before ``p @ v``: the twin models that when told the plan's
key tiling (and the outputs then agree to float32 rounding but for rare boundary cases);
against exact probabilities, as in the end-to-end tests, the bound is what that rounding can
move an output by, ``eps/2 * max|v|`` (``eps`` the dtype's spacing at 1).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from specdec.attention import AttentionMetadata  # noqa: E402
from specdec.kernels.triton import load_triton_kernels  # noqa: E402
from specdec.kernels.triton import reference  # noqa: E402

paddle = pytest.importorskip("paddle")
attention = load_triton_kernels().attention

#: Spacing of each cache dtype at 1.0 (float32: exact enough that only summation order shows).
EPS = {"float32": 0.0, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def _rope_tables(dim: int, max_positions: int):
    half = dim // 2
    inv_freq = 1.0 / (10000.0 ** (np.arange(half) * 2 / dim))
    angles = np.outer(np.arange(max_positions), inv_freq)
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1).astype(np.float32)
    sin = np.concatenate([-np.sin(angles), np.sin(angles)], axis=-1).astype(np.float32)
    return cos, sin


def _block_tables(rng, totals, block_size: int, spare: int = 3):
    """Shuffled blocks for requests of ``totals`` positions: (tables, num_blocks)."""
    counts = [-(-int(t) // block_size) for t in totals]
    num_blocks = sum(counts) + spare
    order = rng.permutation(num_blocks)
    tables = np.zeros((len(totals), max(counts)), dtype=np.int32)
    used = 0
    for b, count in enumerate(counts):
        tables[b, :count] = order[used:used + count]
        used += count
    return tables, num_blocks


def _random_step(rng, block_size: int):
    """One packed step: a prefill chunk from 0, a chunk after some context, decode rows."""
    context = [0, int(rng.integers(1, 3 * block_size))]
    lens = [int(rng.integers(block_size // 2, 2 * block_size + 5)), int(rng.integers(2, block_size + 3))]
    for _ in range(int(rng.integers(2, 4))):  # decode / verify rows: 1 + k
        context.append(int(rng.integers(1, 3 * block_size)))
        lens.append(1 + int(rng.integers(0, 5)))
    order = rng.permutation(len(lens))
    return np.array(lens, np.int32)[order], np.array(context, np.int32)[order]


def _cache_values(rng, shape, cache_dtype: str) -> np.ndarray:
    """Random cache contents as float32 values the dtype represents exactly."""
    return reference.round_to_cache(rng.normal(size=shape), cache_dtype).astype(np.float32)


def _device_cache(values: np.ndarray, cache_dtype: str):
    return paddle.to_tensor(values).astype(cache_dtype)


def _cache_as_float32(cache) -> np.ndarray:
    return cache.astype("float32").numpy()


DTYPES = ("float32", "float16", "bfloat16")
CASES = [(dtype, ratio, block_size) for dtype in DTYPES for ratio in (1, 3, 8) for block_size in (16, 32)]
CASES.append(("float16", 3, 8))
#: The write is simpler: every dtype and ratio once, block sizes alternating.
ROPE_CASES = [(dtype, ratio, (16, 32)[(i + j) % 2]) for i, dtype in enumerate(DTYPES)
              for j, ratio in enumerate((1, 3, 8))] + [("float16", 3, 8)]


@pytest.mark.parametrize("cache_dtype, ratio, block_size", ROPE_CASES)
def test_rope_and_cache_write_matches_its_twin(cache_dtype, ratio, block_size):
    rng = np.random.default_rng(CASES.index((cache_dtype, ratio, block_size)))
    kv_heads, dim = (2, 16) if ratio < 8 else (1, 32)
    heads = kv_heads * ratio
    lens, context = _random_step(rng, block_size)
    tables, num_blocks = _block_tables(rng, lens + context, block_size)
    meta = AttentionMetadata.build(lens, context, tables, block_size)
    cos, sin = _rope_tables(dim, int((lens + context).max()) + 1)
    qkv = rng.normal(size=(meta.num_rows, (heads + 2 * kv_heads) * dim)).astype(np.float32)
    values = _cache_values(rng, (num_blocks, 2, kv_heads, block_size, dim), cache_dtype)
    cache = _device_cache(values, cache_dtype)

    query = attention.rope_and_cache_write(
        paddle.to_tensor(qkv), cache, paddle.to_tensor(cos), paddle.to_tensor(sin), paddle.to_tensor(meta.positions),
        paddle.to_tensor(meta.slot_mapping), heads, kv_heads)
    want_query, want_cache = reference.rope_and_cache_write(qkv, values, cos, sin, meta.positions, meta.slot_mapping,
                                                            heads, kv_heads, cache_dtype)
    assert str(cache.dtype).endswith(cache_dtype)
    assert query.shape == [meta.num_rows, heads, dim]
    np.testing.assert_allclose(query.numpy(), want_query, rtol=0, atol=1e-6)
    # The kernel rounds its float32 RoPE result, the twin its float64 one (cast to float32
    # first): a key may sit one step of the cache dtype away; values are stored exactly.
    got = _cache_as_float32(cache)
    np.testing.assert_allclose(got, want_cache, rtol=max(EPS[cache_dtype], 2.0 ** -22), atol=1e-6)
    assert np.array_equal(got[:, 1], want_cache[:, 1])
    if cache_dtype != "float32":  # a half-precision step away only where float32 rounding tips it: rare
        assert (got[:, 0] != want_cache[:, 0]).mean() < 0.01
    untouched = np.ones(num_blocks * block_size, bool)
    untouched[meta.slot_mapping] = False
    by_slot = lambda cache: cache.transpose(0, 3, 1, 2, 4).reshape(num_blocks * block_size, -1)  # noqa: E731
    assert np.array_equal(by_slot(got)[untouched], by_slot(values)[untouched])


def _attention_inputs(rng, cache_dtype, ratio, block_size, lens=None, context=None):
    kv_heads, dim = (2, 16) if ratio < 8 else (1, 32)
    heads = kv_heads * ratio
    if lens is None:
        lens, context = _random_step(rng, block_size)
    tables, num_blocks = _block_tables(rng, lens + context, block_size)
    values = _cache_values(rng, (num_blocks, 2, kv_heads, block_size, dim), cache_dtype)
    query = (rng.normal(size=(int(lens.sum()), heads, dim)) * 2 / np.sqrt(dim)).astype(np.float32)
    return lens, context, tables, values, query, heads, kv_heads, dim


def _bound(cache_dtype: str, values: np.ndarray) -> float:
    """What the rounding of the probabilities to the cache dtype can move an output by."""
    return EPS[cache_dtype] / 2 * float(np.abs(values[:, 1]).max()) + 2e-6


def _assert_matches_model(got, model, cache_dtype, values):
    """``got`` against the twin that models the kernel's rounding: float32 apart from summation
    order, except where a probability lands on the other side of a rounding boundary in the
    kernel's float32 ``exp`` than in the twin's float64 one (rare: under 1% of the outputs,
    each off by at most one rounding)."""
    err = np.abs(got - model)
    assert err.max() <= _bound(cache_dtype, values)
    assert (err > 1e-5).mean() < 0.01, f"{(err > 1e-5).mean():.2%} of the outputs are off by more than 1e-5"


def _twin(query, values, tables, lens, context, kv_heads, cache_dtype, plan):
    return reference.paged_attention(query, values, tables, lens, context, kv_heads, cache_dtype, block_n=plan.block_n,
                                     split_len=plan.split_len if plan.num_splits > 1 else None)


@pytest.mark.parametrize("cache_dtype, ratio, block_size", CASES)
def test_paged_attention_matches_its_twin(cache_dtype, ratio, block_size):
    rng = np.random.default_rng(100 + CASES.index((cache_dtype, ratio, block_size)))
    lens, context, tables, values, query, heads, kv_heads, dim = _attention_inputs(rng, cache_dtype, ratio, block_size)
    plan = attention.plan_attention(lens, context, block_size=block_size, num_heads=heads, num_kv_heads=kv_heads,
                                    head_dim=dim, cache_dtype=cache_dtype)
    assert plan.num_splits == 1
    got = attention.paged_attention(paddle.to_tensor(query), _device_cache(values, cache_dtype),
                                    paddle.to_tensor(tables), plan).numpy()
    assert got.shape == (int(lens.sum()), heads * dim)
    _assert_matches_model(got, _twin(query, values, tables, lens, context, kv_heads, cache_dtype, plan), cache_dtype,
                          values)
    # The twin's exact softmax (probabilities not rounded) is as far as that rounding goes.
    exact = reference.paged_attention(query, values, tables, lens, context, kv_heads, cache_dtype)
    np.testing.assert_allclose(got, exact, rtol=0, atol=_bound(cache_dtype, values))


@pytest.mark.parametrize("cache_dtype, ratio, block_size", [("float32", 1, 16), ("float16", 8, 32),
                                                            ("bfloat16", 3, 8)])
def test_split_keys_give_the_unsplit_result(cache_dtype, ratio, block_size):
    """Flash-decoding: the splits' partial softmaxes, combined, equal one pass over the keys
    (up to float32 rounding: a split rounds its probabilities against its own maximum)."""
    rng = np.random.default_rng(11)
    lens = np.array([1, 4, 3, 9], np.int32)
    context = np.array([5 * block_size + 3, 2, 3 * block_size, 70], np.int32)
    lens, context, tables, values, query, heads, kv_heads, dim = _attention_inputs(
        rng, cache_dtype, ratio, block_size, lens, context)
    args = (paddle.to_tensor(query), _device_cache(values, cache_dtype), paddle.to_tensor(tables))
    shape = dict(block_size=block_size, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, cache_dtype=cache_dtype)
    split_plan = attention.plan_attention(lens, context, num_splits=4, **shape)
    assert split_plan.num_splits > 1 and split_plan.split_len % block_size == 0
    split = attention.paged_attention(*args, split_plan).numpy()
    whole_plan = attention.plan_attention(lens, context, num_splits=1, **shape)
    whole = attention.paged_attention(*args, whole_plan).numpy()
    _assert_matches_model(split, _twin(query, values, tables, lens, context, kv_heads, cache_dtype, split_plan),
                          cache_dtype, values)
    _assert_matches_model(whole, _twin(query, values, tables, lens, context, kv_heads, cache_dtype, whole_plan),
                          cache_dtype, values)
    np.testing.assert_allclose(split, whole, rtol=0, atol=_bound(cache_dtype, values))
    if cache_dtype == "float32":
        np.testing.assert_allclose(split, whole, rtol=0, atol=5e-6)


def test_the_plan_covers_every_row_once():
    lens, context = np.array([100, 1, 5, 37], np.int32), np.array([0, 50, 9, 300], np.int32)
    for heads, kv_heads in [(8, 8), (12, 4), (32, 4), (64, 1)]:
        plan = attention.plan_attention(lens, context, block_size=16, num_heads=heads, num_kv_heads=kv_heads,
                                        head_dim=128)
        group = heads // kv_heads
        assert plan.block_m >= 16 and plan.block_m & (plan.block_m - 1) == 0
        assert plan.rows_per_tile * group <= plan.block_m and plan.block_n >= 16
        request, first_row, rows, first_pos = plan.tiles.T
        assert (rows >= 1).all() and (rows <= plan.rows_per_tile).all()
        covered = np.concatenate([np.arange(f, f + n) for f, n in zip(first_row, rows)])
        assert np.array_equal(np.sort(covered), np.arange(lens.sum()))
        cu = np.concatenate([[0], np.cumsum(lens)])
        assert np.array_equal(first_pos, context[request] + first_row - cu[request])
        assert ((first_row + rows) <= cu[request + 1]).all()


def test_decode_rows_of_a_request_share_one_tile():
    plan = attention.plan_attention([5, 5, 3], [40, 7, 90], block_size=16, num_heads=32, num_kv_heads=4, head_dim=128,
                                    cache_dtype="bfloat16")
    assert len(plan.tiles) == 3 and plan.block_m == 64 and plan.rows_per_tile == 8
    assert plan.block_n == 64 and plan.num_warps == 8


def test_float32_tiles_are_smaller():
    """3xTF32 products hold twice the operands: block_m * block_n * head_dim <= 16 * 64 * 128."""
    shape = dict(block_size=16, num_heads=32, num_kv_heads=8, head_dim=128, cache_dtype="float32")
    assert [attention.plan_attention([rows], [100], **shape).block_n for rows in (1, 8, 100)] == [64, 32, 16]


def test_the_split_heuristic():
    shape = dict(block_size=16, num_heads=32, num_kv_heads=8, head_dim=128)
    # Small batch, long context: split until about 264 programs, whole blocks per split.
    plan = attention.plan_attention([1, 1], [8000, 3000], **shape)
    assert plan.num_splits == 17 and plan.split_len % 16 == 0
    assert (plan.num_splits - 1) * plan.split_len < 8001 <= plan.num_splits * plan.split_len
    # Short contexts, or enough tiles already: one pass.
    assert attention.plan_attention([1, 1], [300, 100], **shape).num_splits == 1
    assert attention.plan_attention([1] * 40, [8000] * 40, **shape).num_splits == 1
    # At least MIN_SPLIT_POSITIONS per split.
    plan = attention.plan_attention([1], [600], **shape)
    assert plan.num_splits == 2 and plan.split_len >= attention.MIN_SPLIT_POSITIONS
    # A forced count is rounded to whole blocks per split, and never exceeds the blocks.
    assert attention.plan_attention([3], [40], num_splits=8, **shape).num_splits == 3


# -- the backend, end to end ----------------------------------------------------------------------


def _dense_attention(rows, cos, sin, heads, kv_heads, dim, cache_dtype):
    """Causal attention of a whole sequence ``rows [S, (H + 2*KVH) * D]`` (pre-RoPE) in float64,
    rounding as the cache (keys, values) and the kernel (queries, for half caches) do."""
    seq = rows.reshape(len(rows), heads + 2 * kv_heads, dim).astype(np.float64)
    c, s = cos[: len(rows)][:, None, :], sin[: len(rows)][:, None, :]
    roped = seq * c + np.roll(seq, dim // 2, axis=-1) * s
    q = roped[:, :heads].astype(np.float32).astype(np.float64)
    if cache_dtype != "float32":
        q = reference.round_to_cache(q, cache_dtype)
    k = reference.round_to_cache(roped[:, heads:heads + kv_heads], cache_dtype)
    v = reference.round_to_cache(seq[:, heads + kv_heads:], cache_dtype)
    out = np.zeros((len(rows), heads, dim))
    causal = np.tril(np.ones((len(rows), len(rows)), dtype=bool))
    for h in range(heads):
        scores = np.where(causal, q[:, h] @ k[:, h // (heads // kv_heads)].T, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, h] = (probs / probs.sum(-1, keepdims=True)) @ v[:, h // (heads // kv_heads)]
    return out.reshape(len(rows), heads * dim), float(np.abs(v).max())


def _backend(heads, kv_heads, dim, cache_dtype, block_size, num_blocks, cos, sin):
    from specdec.plugins.attention.triton_backend import TritonAttention

    backend = TritonAttention()
    backend.setup(num_layers=2, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, dtype=cache_dtype,
                  rope_cos=cos, rope_sin=sin)
    backend.init_cache(num_blocks, block_size)
    return backend


def _run_two_steps(rng, heads, kv_heads, dim, cache_dtype, block_size, first_lens, second_lens):
    """Two steps through layer 1 of the backend (layer 0 gets other rows, to show the layers'
    caches are apart) against dense attention; returns the backend's last plan."""
    total = first_lens + second_lens
    tables, num_blocks = _block_tables(rng, total, block_size)
    cos, sin = _rope_tables(dim, int(total.max()) + 1)
    backend = _backend(heads, kv_heads, dim, cache_dtype, block_size, num_blocks, cos, sin)
    width = (heads + 2 * kv_heads) * dim
    sequences = [rng.normal(size=(int(t), width)).astype(np.float32) for t in total]
    batch = len(total)
    for step, (context, lens) in enumerate([(np.zeros(batch, np.int32), first_lens), (first_lens, second_lens)]):
        meta = AttentionMetadata.build(lens, context, tables, block_size)
        packed = np.concatenate([seq[c:c + n] for seq, c, n in zip(sequences, context, lens)])
        backend.prepare(meta)
        backend.forward(0, paddle.to_tensor(rng.normal(size=packed.shape).astype(np.float32)), meta)
        got = backend.forward(1, paddle.to_tensor(packed), meta).numpy()
        for b, (seq, c, n) in enumerate(zip(sequences, context, lens)):
            want, v_max = _dense_attention(seq[:c + n], cos, sin, heads, kv_heads, dim, cache_dtype)
            rows = slice(int(meta.cu_seqlens_q[b]), int(meta.cu_seqlens_q[b + 1]))
            bound = max(1e-4, 2e-6 + EPS[cache_dtype] / 2 * v_max)
            assert np.abs(got[rows] - want[c:]).max() < bound, f"step {step}, request {b}"
    return backend._plan


@pytest.mark.parametrize("cache_dtype, heads, kv_heads, dim", [("float32", 4, 2, 16), ("float16", 6, 2, 16),
                                                               ("bfloat16", 8, 1, 32), ("float32", 3, 3, 32)])
@pytest.mark.parametrize("seed", [0, 1])
def test_backend_equals_dense_attention_on_random_varlen_batches(cache_dtype, heads, kv_heads, dim, seed):
    rng = np.random.default_rng(seed * 10 + heads)
    block_size = int(rng.choice([8, 16, 32]))
    batch = int(rng.integers(1, 6))
    first_lens = rng.integers(1, 50, size=batch).astype(np.int32)  # prefills
    second_lens = rng.integers(1, 9, size=batch).astype(np.int32)  # decode + drafts, or a chunk
    _run_two_steps(rng, heads, kv_heads, dim, cache_dtype, block_size, first_lens, second_lens)


def test_backend_splits_a_long_context_at_batch_one(monkeypatch):
    """A prompt then 3 rows, alone: both steps' plans split the keys (the threshold is lowered
    so that the interpreter's sequence stays short)."""
    monkeypatch.setattr(attention, "MIN_SPLIT_POSITIONS", 32)
    rng = np.random.default_rng(5)
    plan = _run_two_steps(rng, 4, 2, 16, "float16", 16, np.array([100], np.int32), np.array([3], np.int32))
    assert plan.num_splits == 3 and plan.split_len == 48


def test_backend_errors_name_the_setting(monkeypatch):
    from specdec.plugins.attention import triton_backend
    from specdec.sdk import KernelUnavailable, SpecdecError

    cos, sin = _rope_tables(16, 8)
    shape = dict(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, rope_cos=cos, rope_sin=sin)
    with pytest.raises(SpecdecError, match="kv_cache_dtype"):
        triton_backend.TritonAttention().setup(dtype="int8", **shape)
    backend = triton_backend.TritonAttention()
    backend.setup(dtype="float32", **shape)
    with pytest.raises(SpecdecError, match="block_size"):
        backend.init_cache(4, 12)

    def unavailable():
        raise KernelUnavailable("the Triton kernels need a CUDA device")

    monkeypatch.setattr(triton_backend, "load_triton_kernels", unavailable)
    with pytest.raises(SpecdecError, match="^attention_backend 'triton': the Triton kernels need a CUDA device$"):
        triton_backend.TritonAttention().setup(dtype="float32", **shape)


def test_the_backend_registers_as_triton():
    from specdec.plugins.attention import triton_backend

    registered = []
    triton_backend.specdec_register_attention_backends(registered.append)
    assert [cls.NAME for cls in registered] == ["triton"]
    backend = triton_backend.TritonAttention()
    backend.setup(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, dtype="bfloat16",
                  rope_cos=np.ones((4, 16), np.float32), rope_sin=np.zeros((4, 16), np.float32))
    assert backend.bytes_per_block(16) == 3 * 2 * 2 * 16 * 16 * 2
