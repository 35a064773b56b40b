"""Numpy reference twins of the CPU kernels (same inputs, same outputs, no speed): what the
tests check the kernels against. Production weight packing is in :mod:`.packing` and
:mod:`.layout`."""

from __future__ import annotations

import numpy as np

from .layout import (INTERLEAVED_TYPE_IDS, Q4K_INTERLEAVED_TYPE_ID, Q6K_INTERLEAVED_TYPE_ID, SPLIT_TYPE_IDS, TYPE_NAMES,
                     deinterleave_q4k_rows, deinterleave_q6k_rows,
                     deinterleave_rows, unsplit_rows)


def unpack_panels(panels: np.ndarray) -> np.ndarray:
    """Inverse of :func:`specdec.kernels.cpu.packing.pack_panels` (float32, padded width)."""
    count, k, width = panels.shape
    return panels.astype(np.float32).transpose(1, 0, 2).reshape(k, count * width)


def skinny_matmul(x: np.ndarray, panels: np.ndarray) -> np.ndarray:
    return (x.astype(np.float64) @ unpack_panels(panels).astype(np.float64)).astype(np.float32)


def rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps)).astype(np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin_signed: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return x * cos + np.roll(x, half, axis=-1) * sin_signed


def paged_attention(qkv: np.ndarray, cache: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                    block_tables: np.ndarray, cu_seqlens_q: np.ndarray, context_lens: np.ndarray,
                    heads: int, kv_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Returns ``(out [T, heads*D], updated cache)``; the input cache is not modified.

    ``cache`` is one layer, ``[num_blocks, 2*kv_heads, block_size, D]`` of float32 or float16:
    in each block the key pages hold keys in transposed tiles of 8 positions (a page read as
    ``[block_size/8, D, 8]``), the value pages hold values as ``[block_size, D]``. New keys and
    values are rounded to the cache's dtype before anything reads them, as the kernel does.
    """
    store = cache.dtype
    num_blocks, _, block_size, dim = cache.shape
    tiles = cache[:, :kv_heads].reshape(num_blocks, kv_heads, block_size // 8, dim, 8)
    keys = tiles.transpose(0, 1, 2, 4, 3).reshape(num_blocks, kv_heads, block_size, dim).astype(np.float64)
    values = cache[:, kv_heads:].astype(np.float64)
    group = heads // kv_heads
    out = np.zeros((qkv.shape[0], heads, dim))
    for b in range(len(context_lens)):
        start, end, ctx = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(context_lens[b])
        rows = qkv[start:end].reshape(end - start, heads + 2 * kv_heads, dim).astype(np.float64)
        positions = ctx + np.arange(end - start)
        c, s = cos[positions][:, None, :], sin[positions][:, None, :]
        q = rope(rows[:, :heads], c, s)
        blocks, offsets = block_tables[b][positions // block_size], positions % block_size
        keys[blocks, :, offsets] = rope(rows[:, heads:heads + kv_heads], c, s).astype(np.float32).astype(store)
        values[blocks, :, offsets] = rows[:, heads + kv_heads:].astype(store)
        seen = np.arange(ctx + end - start)
        seen_blocks, seen_offsets = block_tables[b][seen // block_size], seen % block_size
        k_seq, v_seq = keys[seen_blocks, :, seen_offsets], values[seen_blocks, :, seen_offsets]  # [S, KVH, D]
        for h in range(heads):
            scores = q[:, h] @ k_seq[:, h // group].T
            scores[seen[None, :] > positions[:, None]] = -np.inf
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            out[start:end, h] = probs @ v_seq[:, h // group]
    tiles = keys.reshape(num_blocks, kv_heads, block_size // 8, 8, dim).transpose(0, 1, 2, 4, 3)
    updated = np.concatenate([tiles.reshape(num_blocks, kv_heads, block_size, dim), values], axis=1)
    return out.reshape(qkv.shape[0], heads * dim).astype(np.float32), updated.astype(store)


def rms_matmul(x: np.ndarray, panels: np.ndarray, eps: float) -> np.ndarray:
    return skinny_matmul(rms_norm(x, eps), panels)


def matmul_add(x: np.ndarray, panels: np.ndarray, residual: np.ndarray) -> np.ndarray:
    return (residual.astype(np.float64) + skinny_matmul(x, panels)).astype(np.float32)


def rms_matmul_swiglu(x: np.ndarray, gate_up_panels: np.ndarray, eps: float) -> np.ndarray:
    both = rms_matmul(x, gate_up_panels, eps).astype(np.float64)  # [M, I/8 * 16]
    rows = both.reshape(len(x), -1, 2, 8)
    gate, up = rows[:, :, 0].reshape(len(x), -1), rows[:, :, 1].reshape(len(x), -1)
    return (gate / (1.0 + np.exp(-gate)) * up).astype(np.float32)


# --- weight-only quantized kernels (specdec_quant_ops.cc) -------------------------------------


def dequantize_weight(data: np.ndarray, layout: np.ndarray, cols: int) -> np.ndarray:
    """``[N, cols]`` float64 rows of a quantized weight given as the kernels take it (``data``
    uint8, ``layout`` ``[S, 4]`` of type, rows, byte offset, bytes per row), dequantized by the
    ``gguf`` package (llama.cpp's formats, independently of the kernels)."""
    import gguf

    split_names = {type_id: name for name, type_id in SPLIT_TYPE_IDS.items()}
    interleaved_names = {type_id: name for name, type_id in INTERLEAVED_TYPE_IDS.items()}
    parts = []
    for type_id, rows, offset, row_bytes in layout.tolist():
        blocks = data[offset:offset + rows * row_bytes].reshape(rows, row_bytes)
        if type_id in split_names:
            name = split_names[type_id]
            blocks = unsplit_rows(name, blocks)
        elif type_id == Q4K_INTERLEAVED_TYPE_ID:
            name = "Q4_K"
            blocks = deinterleave_q4k_rows(blocks)
        elif type_id == Q6K_INTERLEAVED_TYPE_ID:
            name = "Q6_K"
            blocks = deinterleave_q6k_rows(blocks)
        elif type_id in interleaved_names:
            name = interleaved_names[type_id]
            blocks = deinterleave_rows(name, blocks)
        else:
            name = TYPE_NAMES[type_id]
        qtype = gguf.GGMLQuantizationType[name]
        parts.append(gguf.quants.dequantize(blocks, qtype).reshape(rows, cols))
    return np.concatenate(parts).astype(np.float64)


def quantize_activations(x: np.ndarray, block: int = 32) -> np.ndarray:
    """``x`` as the kernels see it: each block of ``block`` (32; 256 for Q4_K, Q5_K and Q6_K
    weights) rounded to int8 steps of ``max|x| / 127`` (float32 arithmetic, round half to
    even), returned dequantized (float64)."""
    rows, cols = x.shape
    blocks = x.astype(np.float32).reshape(rows, cols // block, block)
    scale = np.abs(blocks).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(scale != 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse[..., None])
    return (q.astype(np.float64) * scale[..., None]).reshape(rows, cols)


def q_matmul(x, gain, data, layout, epilogue, eps, normalize):
    """``h @ W^T`` with ``h = rms_norm(x) * gain`` (``normalize``) or ``x``; ``epilogue``
    ``[2, N]`` (scale, bias per column) or empty."""
    h = x.astype(np.float64)
    if normalize:
        h = rms_norm(x, eps).astype(np.float64) * (gain if np.size(gain) else 1.0)
    weight = dequantize_weight(data, layout, x.shape[1])
    # Per segment: Q4_K, Q5_K and Q6_K rows (ggml types 12, 13, 14; interleaved Q4_K and Q6_K) take
    # activations quantized per 256; every other format per 32.
    parts, first = [], 0
    for type_id, rows, _, _ in layout.tolist():
        per256 = type_id in (12, 13, 14, Q4K_INTERLEAVED_TYPE_ID, Q6K_INTERLEAVED_TYPE_ID)
        xq = quantize_activations(h.astype(np.float32), 256 if per256 else 32)
        parts.append(xq @ weight[first:first + rows].T)
        first += rows
    out = np.concatenate(parts, axis=1)
    if np.size(epilogue):
        out = out * epilogue[0] + epilogue[1]
    return out.astype(np.float32)


def q_layer_tail(attn, x, wo, lo, gain, wgu, lgu, wd, ld, eps):
    """The rest of a decoder layer after attention (see the kernel)."""
    x1 = x.astype(np.float64) + q_matmul(attn, [], wo, lo, [], eps, False)
    both = q_matmul(x1.astype(np.float32), gain, wgu, lgu, [], eps, True).astype(np.float64)
    inner = both.shape[1] // 2
    gate, up = both[:, :inner], both[:, inner:]
    act = (gate / (1.0 + np.exp(-gate)) * up).astype(np.float32)
    return (x1 + q_matmul(act, [], wd, ld, [], eps, False)).astype(np.float32)


def q_embedding(ids, data, layout, cols):
    """Rows ``ids`` of a quantized table, dequantized."""
    return dequantize_weight(data, layout, cols)[np.asarray(ids)].astype(np.float32)


def q_layer_tail_qkv(attn, x, wo, lo, gain, wgu, lgu, wd, ld, next_gain, wqkv, lqkv, epilogue, eps):
    """:func:`q_layer_tail`, then the next layer's attention input over its output."""
    out = q_layer_tail(attn, x, wo, lo, gain, wgu, lgu, wd, ld, eps)
    return out, q_matmul(out, next_gain, wqkv, lqkv, epilogue, eps, True)


def q_draft_input(embeds, table, table_layout, hidden, embed_gain, we, le, hidden_gain, wh, lh, attn_gain, wqkv,
                  lqkv, epilogue, ids, embed_cols, eps, normalize_embed, normalize_hidden):
    """A draft head's input ``x`` (the two projections summed) and its layer's q/k/v (see the
    kernel): the embeddings are rows ``ids`` of ``table`` when it is not empty, else ``embeds``."""
    e = q_embedding(ids, table, table_layout, embed_cols) if np.size(table) else embeds
    x = (q_matmul(e, embed_gain, we, le, [], eps, normalize_embed).astype(np.float64)
         + q_matmul(hidden, hidden_gain, wh, lh, [], eps, normalize_hidden)).astype(np.float32)
    return x, q_matmul(x, attn_gain, wqkv, lqkv, epilogue, eps, True)


def q_layer_tail_head(attn, x, wo, lo, gain, wgu, lgu, wd, ld, head_gain, wh, lh, rows, eps):
    """:func:`q_layer_tail`, then a normalized projection of its output's ``rows``."""
    out = q_layer_tail(attn, x, wo, lo, gain, wgu, lgu, wd, ld, eps)
    return out, q_matmul(out[np.asarray(rows, dtype=np.int64)], head_gain, wh, lh, [], eps, True)
