"""What the CPU kernels of ``specdec_cpu_ops.cc`` read, packed: float weights as the panels the
float kernels stream, and a step's attention metadata as the one array the paged attention
kernel takes.

The model packs its production weights with these at load time; the numpy twins in
:mod:`specdec.kernels.cpu.reference` read the same panels back.
"""

from __future__ import annotations

import numpy as np

#: Columns in one panel.
PANEL = 16


def pack_panels(weight_in_out: np.ndarray, dtype=np.float16) -> np.ndarray:
    """``[K, N]`` weight -> ``[N/16, K, 16]`` panels (N is padded up to a multiple of 16)."""
    k, n = weight_in_out.shape
    padded = -(-n // PANEL) * PANEL
    if padded != n:
        weight_in_out = np.concatenate([weight_in_out, np.zeros((k, padded - n), weight_in_out.dtype)], axis=1)
    return np.ascontiguousarray(weight_in_out.reshape(k, padded // PANEL, PANEL).transpose(1, 0, 2), dtype=dtype)


def pack_gate_up_panels(gate_in_out: np.ndarray, up_in_out: np.ndarray, dtype=np.float16) -> np.ndarray:
    """Gate and up ``[K, I]`` weights -> ``[I/8, K, 16]`` panels: panel p holds gate columns
    ``8p..8p+7`` then up columns ``8p..8p+7`` (what ``rms_matmul_swiglu`` expects)."""
    k, inner = gate_in_out.shape
    if inner % 8:
        raise ValueError("gate/up widths must be multiples of 8")
    gate = gate_in_out.reshape(k, inner // 8, 8)
    up = up_in_out.reshape(k, inner // 8, 8)
    return np.ascontiguousarray(np.concatenate([gate, up], axis=2).transpose(1, 0, 2), dtype=dtype)


def pack_attention_metadata(block_tables: np.ndarray, cu_seqlens_q: np.ndarray, context_lens: np.ndarray) -> np.ndarray:
    """``[B, 2 + max_blocks]`` int32 for ``specdec_paged_attention``: per request its first
    packed row (``cu_seqlens_q[b]``), its context length, then its block table (the row count
    ``cu_seqlens_q[B]`` is the kernel's ``qkv`` row count). One array, so that a step copies its
    metadata to the kernel once rather than three times (each copy costs a paddle dispatch)."""
    tables = np.asarray(block_tables, dtype=np.int32)
    cu = np.asarray(cu_seqlens_q, dtype=np.int32)
    out = np.empty((tables.shape[0], 2 + tables.shape[1]), dtype=np.int32)
    out[:, 0] = cu[:-1]
    out[:, 1] = context_lens
    out[:, 2:] = tables
    return out
