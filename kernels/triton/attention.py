"""Paged attention for a packed step: RoPE + cache write, then variable-length causal attention.

Per layer the ``triton`` attention backend launches :func:`rope_and_cache_write` (rotate the
step's new query and key rows, store keys and values in the paged cache) and
:func:`paged_attention` (every row attends causally to its request's cached positions; GQA
heads share loaded tiles; split-KV with a combine pass for long contexts at small batch), as
planned on the host by :func:`plan_attention`. Tiling, cache layout and numerics:
docs/gpu.md#how-the-attention-kernels-work. Numpy twins: :mod:`specdec.kernels.triton.reference`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import triton
import triton.language as tl

from .runtime import empty, from_numpy, interpreting, kernel_arg

#: Programs a launch should have for the GPU to be busy: two per SM of an H100/H200 (132 SMs).
#: :func:`plan_attention` splits the keys when the tiles times the KV heads fall short of it.
DEFAULT_TARGET_PROGRAMS = 264
#: A split covers at least this many key positions (rounded up to whole cache blocks): below
#: that, the extra launch and the scratch traffic cost more than the parallelism gains.
MIN_SPLIT_POSITIONS = 256
#: At most this many splits (bounds the scratch and the combine loop).
MAX_SPLITS = 64

CACHE_DTYPES = ("float32", "float16", "bfloat16")


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _dtype_name(tensor) -> str:
    """A paddle or torch tensor's dtype as a plain name (``float16`` for ``paddle.float16``,
    ``torch.float16`` or ``VarType.FP16``)."""
    name = str(tensor.dtype).rsplit(".", 1)[-1].lower()
    return {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(name, name)


# -- device helpers --------------------------------------------------------------------------------


@triton.jit
def _round_bf16(x):
    """float32 -> bfloat16, rounding to nearest even on the bits (NaN is not expected here)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _to_cache(x, IS_BF16: tl.constexpr, dtype: tl.constexpr):
    """Round float32 ``x`` to the cache's dtype."""
    if IS_BF16:
        return _round_bf16(x)
    else:
        return x.to(dtype)


# -- RoPE + cache write ----------------------------------------------------------------------------


@triton.jit
def _rope_cache_write_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, query_ptr, cache_ptr,
                             H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                             HQ_P: tl.constexpr, HK_P: tl.constexpr, D_P: tl.constexpr,
                             IS_BF16: tl.constexpr):
    """One program per packed row: all its query, key and value heads."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, D_P)
    d_ok = d < D
    rolled = (d + D // 2) % D  # roll(x, D/2)[d] = x[(d + D/2) % D] (D even)
    cos = tl.load(cos_ptr + pos * D + d, mask=d_ok, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * D + d, mask=d_ok, other=0.0)[None, :]
    row = qkv_ptr + t * ((H + 2 * KVH) * D)

    hq = tl.arange(0, HQ_P)[:, None]
    q_mask = (hq < H) & d_ok[None, :]
    x = tl.load(row + hq * D + d[None, :], mask=q_mask, other=0.0)
    x_rolled = tl.load(row + hq * D + rolled[None, :], mask=q_mask, other=0.0)
    tl.store(query_ptr + t * (H * D) + hq * D + d[None, :], x * cos + x_rolled * sin, mask=q_mask)

    hk = tl.arange(0, HK_P)[:, None]
    k_mask = (hk < KVH) & d_ok[None, :]
    k = tl.load(row + (H + hk) * D + d[None, :], mask=k_mask, other=0.0)
    k_rolled = tl.load(row + (H + hk) * D + rolled[None, :], mask=k_mask, other=0.0)
    v = tl.load(row + (H + KVH + hk) * D + d[None, :], mask=k_mask, other=0.0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    key_at = cache_ptr + block * (2 * KVH * BLOCK_SIZE * D) + hk * (BLOCK_SIZE * D) + offset * D + d[None, :]
    dtype = cache_ptr.dtype.element_ty
    tl.store(key_at, _to_cache(k * cos + k_rolled * sin, IS_BF16, dtype), mask=k_mask)
    tl.store(key_at + KVH * BLOCK_SIZE * D, _to_cache(v, IS_BF16, dtype), mask=k_mask)


def rope_and_cache_write(qkv, cache, cos_table, sin_table, positions, slot_mapping, num_heads: int,
                         num_kv_heads: int, *, query_out=None):
    """RoPE of a step's rows, and their keys and values written into one layer's cache.

    :param qkv: ``[T, (H + 2*KVH) * D]`` float32, contiguous: query heads, key heads, value
        heads of each packed row, before RoPE.
    :param cache: ``[num_blocks, 2, KVH, block_size, D]`` float32 / float16 / bfloat16, updated
        in place: position ``slot = block * block_size + offset`` of KV head ``h`` keeps its
        rotated key at ``cache[block, 0, h, offset]`` and its value at ``cache[block, 1, h, offset]``.
    :param cos_table, sin_table: ``[max_positions, D]`` float32 rotate-half tables
        (``rope(x) = x * cos + roll(x, D/2) * sin``, the sign folded into ``sin``).
    :param positions: ``[T]`` int64 (or int32), each row's position in its sequence.
    :param slot_mapping: ``[T]`` int64, each row's cache slot.
    :param query_out: optional ``[T, H, D]`` float32 buffer for the result.
    :returns: ``[T, H, D]`` float32, the rotated queries.
    """
    num_rows = int(qkv.shape[0])
    block_size, dim = int(cache.shape[3]), int(cache.shape[4])
    _check_cache(cache, num_kv_heads)
    if int(qkv.shape[1]) != (num_heads + 2 * num_kv_heads) * dim:
        raise ValueError(f"qkv has {qkv.shape[1]} columns, expected (H + 2*KVH) * D = "
                         f"{(num_heads + 2 * num_kv_heads) * dim}")
    if dim % 2:
        raise ValueError(f"rotate-half RoPE needs an even head_dim, got {dim}")
    query = query_out if query_out is not None else empty(qkv, [num_rows, num_heads, dim], "float32")
    if num_rows:
        _rope_cache_write_kernel[(num_rows,)](
            kernel_arg(qkv), kernel_arg(cos_table), kernel_arg(sin_table), kernel_arg(positions),
            kernel_arg(slot_mapping), kernel_arg(query), kernel_arg(cache),
            H=num_heads, KVH=num_kv_heads, D=dim, BLOCK_SIZE=block_size,
            HQ_P=_next_pow2(num_heads), HK_P=_next_pow2(num_kv_heads), D_P=_next_pow2(dim),
            IS_BF16=_dtype_name(cache) == "bfloat16", num_warps=4)
    return query


def _check_cache(cache, num_kv_heads: int) -> None:
    shape = tuple(int(s) for s in cache.shape)
    if len(shape) != 5 or shape[1] != 2 or shape[2] != num_kv_heads:
        raise ValueError(f"cache must be [num_blocks, 2, KVH={num_kv_heads}, block_size, D], got {list(shape)}")
    if shape[3] % 8:
        raise ValueError(f"block_size must be a multiple of 8, got {shape[3]}")
    if _dtype_name(cache) not in CACHE_DTYPES:
        raise ValueError(f"cache dtype {cache.dtype} is not one of {', '.join(CACHE_DTYPES)}")


# -- the plan ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class AttentionPlan:
    """How :func:`paged_attention` cuts one step's work; built by :func:`plan_attention`.

    The grid is ``(len(tiles), KVH, num_splits)``.

    :ivar tiles: ``[n_tiles, 4]`` int32 rows ``(request, first packed row, rows, position of
        the first row)``: ``rows <= rows_per_tile`` consecutive rows of one request.
    :ivar rows_per_tile: rows a tile holds at most; ``rows_per_tile * G <= block_m``.
    :ivar block_m: matrix rows of a program's query tile (rows x G, padded to a power of two >= 16).
    :ivar block_n: key positions per inner iteration (a power of two >= 16).
    :ivar num_warps: warps per program.
    :ivar num_splits: key ranges per (tile, KV head); 1 means no split and no combine pass.
    :ivar split_len: positions per split (whole cache blocks); with one split, a bound above
        every sequence.
    :ivar device_tiles, scratch: ``tiles`` on the device and the split-KV scratch
        ``(max [S, T, H], sum [S, T, H], acc [S, T, H, D])`` float32, set by :meth:`place`
        (or on first use, on the query's device).
    """

    tiles: np.ndarray
    num_rows: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    rows_per_tile: int
    block_m: int
    block_n: int
    num_warps: int
    num_splits: int
    split_len: int
    device_tiles: object = None
    scratch: tuple | None = None

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def place(self, like) -> "AttentionPlan":
        """Put the tiles on ``like``'s device (and framework) and allocate the split scratch."""
        self.device_tiles = from_numpy(self.tiles, like)
        if self.num_splits > 1:
            s, t, h = self.num_splits, self.num_rows, self.num_heads
            self.scratch = (empty(like, [s, t, h], "float32"), empty(like, [s, t, h], "float32"),
                            empty(like, [s, t, h, self.head_dim], "float32"))
        return self


def plan_attention(query_lens, context_lens, *, block_size: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, cache_dtype: str = "float32", num_splits: int | None = None,
                   target_programs: int = DEFAULT_TARGET_PROGRAMS) -> AttentionPlan:
    """Tiles and splits of one step (numpy, once per step; every layer reuses the plan).

    Tiles: ``G = H / KVH`` query heads share a KV head, and a program takes ``rows_per_tile``
    rows of one request times those ``G`` heads. ``block_m`` is the smallest power of two
    >= 16 that holds ``G x`` the longest request's rows, capped at 64 (or ``G`` rounded up,
    when one row's heads alone exceed 64); ``rows_per_tile = block_m // G``. So a decode step
    (``1 + k`` rows per request) gets one tile per request with its rows and heads together,
    and a prefill chunk is cut into tiles of ``64 // G`` rows.

    ``block_n`` (key positions per inner step) bounds registers: with a float16 / bfloat16
    cache 64, or 32 when the padded head_dim exceeds 128; with a float32 cache, whose 3xTF32
    products hold twice the operands, ``block_m * block_n * head_dim`` stays within
    ``16 * 64 * 128`` (64 / 32 / 16 for ``block_m`` 16 / 32 / 64 at head_dim 128). Tiles of 64
    rows get 8 warps, smaller ones 4 (register use per configuration: docs/gpu.md).

    Splits (flash-decoding), when ``num_splits`` is None: with ``n_tiles * KVH`` programs short
    of ``target_programs`` (two per SM) and the longest sequence at least
    ``2 * MIN_SPLIT_POSITIONS`` positions, the keys are split in
    ``min(ceil(target / (n_tiles * KVH)), longest // MIN_SPLIT_POSITIONS, MAX_SPLITS)``
    ranges; otherwise one. Each split covers whole cache blocks (``ceil(blocks / splits)`` of
    them), so the count is then recomputed from the blocks and may come out smaller. A given
    ``num_splits`` is used as is (subject to that same rounding): tests force it.
    """
    query_lens = np.asarray(query_lens, dtype=np.int64)
    context_lens = np.asarray(context_lens, dtype=np.int64)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size % 8 or block_size <= 0:
        raise ValueError(f"block_size must be a positive multiple of 8, got {block_size}")
    group = num_heads // num_kv_heads
    longest_rows = int(query_lens.max()) if len(query_lens) else 1
    cap = max(64, _next_pow2(group))
    block_m = min(cap, max(16, _next_pow2(max(1, longest_rows) * group)))
    rows_per_tile = max(1, block_m // group)
    dim_p = max(16, _next_pow2(head_dim))
    if cache_dtype == "float32":
        block_n = max(16, min(64, (16 * 64 * 128) // (block_m * dim_p)))
    else:
        block_n = 64 if dim_p <= 128 else 32
    num_warps = 8 if block_m >= 64 else 4

    counts = -(-query_lens // rows_per_tile)  # tiles per request
    request = np.repeat(np.arange(len(query_lens), dtype=np.int64), counts)
    first_tile = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(counts, out=first_tile[1:])
    start = (np.arange(int(first_tile[-1]), dtype=np.int64) - first_tile[request]) * rows_per_tile  # in request
    cu_q = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu_q[1:])
    rows = np.minimum(rows_per_tile, query_lens[request] - start)
    tiles = np.stack([request, cu_q[request] + start, rows, context_lens[request] + start], axis=1).astype(np.int32)

    longest = int((context_lens + query_lens).max()) if len(query_lens) else 0
    blocks = max(1, -(-longest // block_size))
    if num_splits is None:
        base = max(1, len(tiles) * num_kv_heads)
        num_splits = 1
        if base < target_programs and longest >= 2 * MIN_SPLIT_POSITIONS:
            num_splits = min(-(-target_programs // base), longest // MIN_SPLIT_POSITIONS, MAX_SPLITS)
    num_splits = max(1, min(int(num_splits), blocks))
    blocks_per_split = -(-blocks // num_splits)
    num_splits = -(-blocks // blocks_per_split)
    split_len = blocks_per_split * block_size if num_splits > 1 else max(1, blocks * block_size)
    return AttentionPlan(tiles=tiles, num_rows=int(cu_q[-1]), num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, block_size=block_size, rows_per_tile=rows_per_tile, block_m=block_m,
                         block_n=block_n, num_warps=num_warps, num_splits=num_splits, split_len=split_len)


# -- paged attention ---------------------------------------------------------------------------------


@triton.jit
def _attend_keys(q, q_pos, m_i, l_i, acc, start, hi, cache_ptr, table, head_at, d, d_ok, KVH: tl.constexpr,
                 D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr,
                 IS_BF16: tl.constexpr, WIDEN: tl.constexpr):
    """Online softmax over key positions ``start .. start + BLOCK_N - 1`` (those below ``hi``)."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < hi
    block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    key_at = block * (2 * KVH * BLOCK_SIZE * D) + head_at + (n % BLOCK_SIZE) * D  # [BLOCK_N]
    k_t = tl.load(cache_ptr + key_at[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None],
                  other=0.0)  # [D_P, BLOCK_N]
    v = tl.load(cache_ptr + key_at[:, None] + KVH * BLOCK_SIZE * D + d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D_P]
    if not HALF:
        s = tl.dot(q, k_t, input_precision="tf32x3")
    elif WIDEN:
        s = tl.dot(q, k_t.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k_t)  # half inputs, float32 accumulation
    visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if HALF:
        p_h = _to_cache(p, IS_BF16, cache_ptr.dtype.element_ty)
        if WIDEN:
            pv = tl.dot(p_h.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p_h, v)
    else:
        pv = tl.dot(p, v, input_precision="tf32x3")
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _paged_attention_kernel(query_ptr, cache_ptr, tables_ptr, tiles_ptr, out_ptr, max_ptr, sum_ptr, acc_ptr,
                            num_rows, table_stride, split_len,
                            H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                            D_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HALF: tl.constexpr,
                            IS_BF16: tl.constexpr, WIDEN: tl.constexpr, INTERPRET: tl.constexpr):
    """One program: a tile of rows x the G query heads of one KV head, over one key split."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    request = tl.load(tiles_ptr + tile * 4).to(tl.int64)
    first_row = tl.load(tiles_ptr + tile * 4 + 1).to(tl.int64)
    rows = tl.load(tiles_ptr + tile * 4 + 2)
    first_pos = tl.load(tiles_ptr + tile * 4 + 3)

    m = tl.arange(0, BLOCK_M)
    r = m // G  # row of the tile
    head = kv_head * G + m % G  # query head
    m_ok = m < rows * G
    d = tl.arange(0, D_P)
    d_ok = d < D
    q_at = ((first_row + r) * H + head) * D
    q = tl.load(query_ptr + q_at[:, None] + d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    dtype = cache_ptr.dtype.element_ty
    if HALF:
        q = _to_cache(q, IS_BF16, dtype)
        if WIDEN:
            q = q.to(tl.float32)
    q_pos = first_pos + r  # each matrix row's position: it sees keys 0 .. q_pos

    lo = split * split_len
    hi = tl.minimum(lo + split_len, first_pos + rows)  # the tile's last row sees up to first_pos + rows - 1
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], dtype=tl.float32)
    table = tables_ptr + request * table_stride
    head_at = kv_head * (BLOCK_SIZE * D)
    if INTERPRET:
        # The interpreter (with numpy >= 2) cannot take tensors as range() bounds; a while
        # loop computes the same. On a GPU the for loop lets the compiler pipeline the loads.
        start = lo
        while start < hi:
            m_i, l_i, acc = _attend_keys(q, q_pos, m_i, l_i, acc, start, hi, cache_ptr, table, head_at, d, d_ok,
                                         KVH, D, BLOCK_SIZE, BLOCK_N, HALF, IS_BF16, WIDEN)
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attend_keys(q, q_pos, m_i, l_i, acc, start, hi, cache_ptr, table, head_at, d, d_ok,
                                         KVH, D, BLOCK_SIZE, BLOCK_N, HALF, IS_BF16, WIDEN)

    if SPLIT:
        part = (split * num_rows + first_row + r) * H + head  # [S, T, H]
        tl.store(max_ptr + part, m_i, mask=m_ok)
        tl.store(sum_ptr + part, l_i, mask=m_ok)
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=m_ok[:, None] & d_ok[None, :])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_at[:, None] + d[None, :], out, mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _max_of_split(best, max_ptr, s, num_rows, t, h, h_ok, H: tl.constexpr):
    return tl.maximum(best, tl.load(max_ptr + (s * num_rows + t) * H + h, mask=h_ok, other=float("-inf")))


@triton.jit
def _add_split(total, acc, best, max_ptr, sum_ptr, acc_ptr, s, num_rows, t, h, h_ok, d, mask, H: tl.constexpr,
               D: tl.constexpr):
    part = (s * num_rows + t) * H + h
    weight = tl.exp(tl.load(max_ptr + part, mask=h_ok, other=float("-inf")) - best)
    total += weight * tl.load(sum_ptr + part, mask=h_ok, other=0.0)
    acc += weight[:, None] * tl.load(acc_ptr + part[:, None] * D + d[None, :], mask=mask, other=0.0)
    return total, acc


@triton.jit
def _combine_splits_kernel(max_ptr, sum_ptr, acc_ptr, out_ptr, num_rows, num_splits,
                           H: tl.constexpr, D: tl.constexpr, H_P: tl.constexpr, D_P: tl.constexpr,
                           INTERPRET: tl.constexpr):
    """One program per row: merge the splits' partial softmax of all its heads."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_P)
    h_ok = h < H
    d = tl.arange(0, D_P)
    mask = h_ok[:, None] & (d < D)[None, :]
    best = tl.full([H_P], float("-inf"), tl.float32)
    total = tl.zeros([H_P], dtype=tl.float32)
    acc = tl.zeros([H_P, D_P], dtype=tl.float32)
    if INTERPRET:  # while, not range(): see _paged_attention_kernel
        s = 0
        while s < num_splits:
            best = _max_of_split(best, max_ptr, s, num_rows, t, h, h_ok, H)
            s += 1
        best = tl.where(best == float("-inf"), 0.0, best)
        s = 0
        while s < num_splits:
            total, acc = _add_split(total, acc, best, max_ptr, sum_ptr, acc_ptr, s, num_rows, t, h, h_ok, d, mask, H, D)
            s += 1
    else:
        for s in range(num_splits):
            best = _max_of_split(best, max_ptr, s, num_rows, t, h, h_ok, H)
        best = tl.where(best == float("-inf"), 0.0, best)
        for s in range(num_splits):
            total, acc = _add_split(total, acc, best, max_ptr, sum_ptr, acc_ptr, s, num_rows, t, h, h_ok, d, mask, H, D)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + t * (H * D) + h[:, None] * D + d[None, :], out, mask=mask)


def paged_attention(query, cache, block_tables, plan: AttentionPlan, *, out=None):
    """Causal attention of a step's rows over the paged cache (after :func:`rope_and_cache_write`).

    :param query: ``[T, H, D]`` float32, contiguous: rotated queries, pre-scaled by ``1/sqrt(D)``.
    :param cache: ``[num_blocks, 2, KVH, block_size, D]`` float32 / float16 / bfloat16 (see
        :func:`rope_and_cache_write`), holding every position the rows see.
    :param block_tables: ``[B, max_blocks]`` int32, contiguous: each request's cache blocks.
    :param plan: :func:`plan_attention` of this step (placed on the device on first use).
    :param out: optional ``[T, H*D]`` float32 buffer for the result.
    :returns: ``[T, H*D]`` float32: row ``t`` of request ``b`` attends to positions
        ``0 .. context_lens[b] + (t - first row of b)`` of request ``b``.
    """
    num_rows, heads, dim = (int(s) for s in query.shape)
    kv_heads = plan.num_kv_heads
    _check_cache(cache, kv_heads)
    if ((num_rows, heads, dim) != (plan.num_rows, plan.num_heads, plan.head_dim)
            or int(cache.shape[3]) != plan.block_size):
        raise ValueError(f"query {[num_rows, heads, dim]} / block_size {int(cache.shape[3])} do not match the plan "
                         f"({[plan.num_rows, plan.num_heads, plan.head_dim]}, block_size {plan.block_size})")
    if plan.device_tiles is None or (plan.num_splits > 1 and plan.scratch is None):
        plan.place(query)
    if out is None:
        out = empty(query, [num_rows, heads * dim], "float32")
    if num_rows == 0:
        return out
    cache_dtype = _dtype_name(cache)
    half = cache_dtype != "float32"
    split = plan.num_splits > 1
    scratch = plan.scratch if split else (out, out, out)
    grid = (len(plan.tiles), kv_heads, plan.num_splits)
    _paged_attention_kernel[grid](
        kernel_arg(query), kernel_arg(cache), kernel_arg(block_tables), kernel_arg(plan.device_tiles), kernel_arg(out),
        *(kernel_arg(s) for s in scratch), num_rows, int(block_tables.shape[1]), plan.split_len,
        H=heads, KVH=kv_heads, G=heads // kv_heads, D=dim, D_P=max(16, _next_pow2(dim)),
        BLOCK_SIZE=plan.block_size, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, SPLIT=split, HALF=half,
        IS_BF16=cache_dtype == "bfloat16", WIDEN=half and interpreting(), INTERPRET=interpreting(),
        num_warps=plan.num_warps)
    if split:
        _combine_splits_kernel[(num_rows,)](
            *(kernel_arg(s) for s in plan.scratch), kernel_arg(out), num_rows, plan.num_splits,
            H=heads, D=dim, H_P=_next_pow2(heads), D_P=_next_pow2(dim), INTERPRET=interpreting(), num_warps=4)
    return out


__all__ = ["AttentionPlan", "plan_attention", "rope_and_cache_write", "paged_attention",
           "DEFAULT_TARGET_PROGRAMS", "MIN_SPLIT_POSITIONS", "MAX_SPLITS", "CACHE_DTYPES"]
