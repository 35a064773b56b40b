"""Numpy twins of the Triton attention kernels (:mod:`specdec.kernels.triton.attention`).

Same layout, float64 math, no speed. A cache here is a numpy array of the values the device
cache holds, ``[num_blocks, 2, KVH, block_size, D]`` (keys at ``[:, 0]``, values at ``[:, 1]``):
float32 or float16 as is, and a bfloat16 cache as float32 values (numpy has no bfloat16;
:func:`bfloat16_bits_to_float32` reads the raw bits a framework hands back), with
``cache_dtype`` naming what the device stores. Keys and values are rounded to ``cache_dtype``
as the kernel stores them: the float64 RoPE result goes to float32 first, then to the cache
dtype (round to nearest even).

With a float16 / bfloat16 cache the kernel also rounds the query to the cache dtype before
``q @ k^T``, and the softmax probabilities before ``p @ v``; the twin rounds the query too, and
the probabilities when told the plan's key tiling (they are relative to a running maximum that
depends on it): see :func:`paged_attention`.
"""

from __future__ import annotations

import numpy as np

from ..cpu.reference import rope


def float32_to_bfloat16(x) -> np.ndarray:
    """``x`` rounded to bfloat16 (to nearest even), as float32 values."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def bfloat16_bits_to_float32(bits) -> np.ndarray:
    """bfloat16 values given as their ``uint16`` bits -> float32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to_cache(x, cache_dtype: str) -> np.ndarray:
    """``x`` as the cache stores it: float32 first, then ``cache_dtype``; float64 values."""
    x32 = np.asarray(x, dtype=np.float64).astype(np.float32)
    if cache_dtype == "bfloat16":
        return float32_to_bfloat16(x32).astype(np.float64)
    if cache_dtype in ("float16", "float32"):
        return x32.astype(cache_dtype).astype(np.float64)
    raise ValueError(f"unknown cache dtype {cache_dtype!r}")


def _cache_dtype(cache: np.ndarray, cache_dtype: str | None) -> str:
    return cache_dtype if cache_dtype is not None else cache.dtype.name


def rope_and_cache_write(qkv, cache, cos, sin, positions, slot_mapping, num_heads: int, num_kv_heads: int,
                         cache_dtype: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Twin of ``attention.rope_and_cache_write``.

    :returns: ``(query [T, H, D] float32, updated cache)``; ``cache`` itself is not modified,
        the copy has its numpy dtype.
    """
    cache_dtype = _cache_dtype(cache, cache_dtype)
    num_blocks, _, kv_heads, block_size, dim = cache.shape
    assert kv_heads == num_kv_heads
    rows = np.asarray(qkv, dtype=np.float64).reshape(len(qkv), num_heads + 2 * num_kv_heads, dim)
    positions = np.asarray(positions, dtype=np.int64)
    c = np.asarray(cos, dtype=np.float64)[positions][:, None, :]
    s = np.asarray(sin, dtype=np.float64)[positions][:, None, :]
    query = rope(rows[:, :num_heads], c, s).astype(np.float32)
    keys = round_to_cache(rope(rows[:, num_heads:num_heads + num_kv_heads], c, s), cache_dtype)
    values = round_to_cache(rows[:, num_heads + num_kv_heads:], cache_dtype)
    slots = np.asarray(slot_mapping, dtype=np.int64)
    updated = cache.copy()
    updated[slots // block_size, 0, :, slots % block_size] = keys.astype(cache.dtype)
    updated[slots // block_size, 1, :, slots % block_size] = values.astype(cache.dtype)
    return query, updated


def paged_attention(query, cache, block_tables, query_lens, context_lens, num_kv_heads: int,
                    cache_dtype: str | None = None, *, block_n: int | None = None,
                    split_len: int | None = None) -> np.ndarray:
    """Twin of ``attention.paged_attention``.

    :param query: ``[T, H, D]`` rotated, pre-scaled queries (rows of request ``b`` packed
        after those of ``b - 1``).
    :param block_n, split_len: the plan's key tile and split length (``plan.block_n``, and
        ``plan.split_len`` when ``plan.num_splits > 1``). Given ``block_n``, a float16 /
        bfloat16 cache's rounding of the probabilities is modelled as the kernel does it:
        each tile's ``exp(s - running max)`` rounded to the cache dtype before ``p @ v``, the
        sums kept exact, splits merged as the combine kernel does. Without it the
        probabilities are exact.
    :returns: ``[T, H*D]`` float32: causal attention of each row over its request's positions
        ``0 .. context_lens[b] + row``.
    """
    cache_dtype = _cache_dtype(cache, cache_dtype)
    num_rows, heads, dim = query.shape
    block_size = cache.shape[3]
    group = heads // num_kv_heads
    q = np.asarray(query, dtype=np.float64)
    if cache_dtype != "float32":
        q = round_to_cache(q, cache_dtype)
    keys = cache[:, 0].astype(np.float64)  # [NB, KVH, BS, D]
    values = cache[:, 1].astype(np.float64)
    out = np.zeros((num_rows, heads, dim))
    start = 0
    for b, (n, ctx) in enumerate(zip(np.asarray(query_lens), np.asarray(context_lens))):
        n, ctx = int(n), int(ctx)
        seen = np.arange(ctx + n)
        blocks, offsets = np.asarray(block_tables)[b][seen // block_size], seen % block_size
        k_seq, v_seq = keys[blocks, :, offsets], values[blocks, :, offsets]  # [S, KVH, D]
        positions = ctx + np.arange(n)
        for h in range(heads):
            scores = q[start:start + n, h] @ k_seq[:, h // group].T
            scores[seen[None, :] > positions[:, None]] = -np.inf
            if block_n is not None and cache_dtype != "float32":
                out[start:start + n, h] = _tiled_softmax(scores, v_seq[:, h // group], cache_dtype, block_n,
                                                         split_len or len(seen))
            else:
                probs = np.exp(scores - scores.max(-1, keepdims=True))
                out[start:start + n, h] = (probs / probs.sum(-1, keepdims=True)) @ v_seq[:, h // group]
        start += n
    return out.reshape(num_rows, heads * dim).astype(np.float32)


def _tiled_softmax(scores, values, cache_dtype: str, block_n: int, split_len: int) -> np.ndarray:
    """``softmax(scores) @ values`` as the kernel accumulates it: online over key tiles of
    ``block_n`` inside each split of ``split_len`` positions, probabilities rounded to the
    cache dtype for the product, then the splits merged."""
    parts = []
    for lo in range(0, scores.shape[1], split_len):
        hi = min(lo + split_len, scores.shape[1])
        best = np.full(len(scores), -np.inf)
        total = np.zeros(len(scores))
        acc = np.zeros((len(scores), values.shape[1]))
        for first in range(lo, hi, block_n):
            tile = scores[:, first:min(first + block_n, hi)]
            new = np.maximum(best, tile.max(1))
            safe = np.where(new == -np.inf, 0.0, new)
            probs = np.exp(tile - safe[:, None])
            alpha = np.exp(best - safe)
            total = total * alpha + probs.sum(1)
            acc = acc * alpha[:, None] + round_to_cache(probs, cache_dtype) @ values[first:first + tile.shape[1]]
            best = new
        parts.append((best, total, acc))
    top = np.max([best for best, _, _ in parts], axis=0)
    top = np.where(top == -np.inf, 0.0, top)
    weights = [np.exp(best - top) for best, _, _ in parts]
    total = sum(w * t for w, (_, t, _) in zip(weights, parts))
    acc = sum(w[:, None] * a for w, (_, _, a) in zip(weights, parts))
    return acc / np.where(total > 0, total, 1.0)[:, None]
