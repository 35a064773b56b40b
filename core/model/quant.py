"""Weight-only quantized matrices: GGML blocks as a GGUF file stores them, or float weights
quantized at load (``wint8``, ``wint4``).

A :class:`QuantizedMatrix` is ``[rows, cols]`` in one or more *segments* of rows, each in one
GGML block format: q, k and v (or gate and up) stay one matrix, and so one kernel call, even
when the file stores them in different formats (Q4_K_M files keep some in Q6_K). The CPU
kernels (``specdec_q_*`` in specdec.kernels.cpu) read the blocks as they are.
"""

from __future__ import annotations

import os

import attrs
import numpy as np

# The kernels' byte layouts live below the model layer; re-exported here under their old names.
from specdec.kernels.cpu.layout import (BLOCK_FORMATS, GROUP_ROWS, INTERLEAVED_TYPE_IDS,  # noqa: F401
                                        Q4K_INTERLEAVED_TYPE_ID, Q6K_INTERLEAVED_TYPE_ID, SLACK_BYTES,
                                        SPLIT_TYPE_IDS, TYPE_IDS, TYPE_NAMES, deinterleave_q4k_rows,
                                        deinterleave_q6k_rows, deinterleave_rows, interleave_q4k_rows,
                                        interleave_q6k_rows, interleave_rows, split_rows, unsplit_rows)

#: ``quantization`` values that quantize float weights at load, and the format each uses.
LOAD_TIME_FORMATS = {"wint8": "Q8_0", "wint4": "Q4_0"}


def row_bytes(type_name: str, cols: int) -> int:
    """Bytes of one row of ``cols`` elements in ``type_name``."""
    _, elems, size = BLOCK_FORMATS[type_name]
    return cols // elems * size


@attrs.frozen
class Segment:
    """``rows`` consecutive rows of a matrix in one format: ``data`` is ``[rows, row_bytes]`` uint8."""

    type_name: str
    data: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])


@attrs.frozen
class QuantizedMatrix:
    """A weight ``[rows, cols]`` (Hugging Face ``[out, in]`` orientation) in GGML blocks."""

    cols: int
    segments: tuple[Segment, ...]

    @property
    def rows(self) -> int:
        return sum(segment.rows for segment in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(segment.data.nbytes for segment in self.segments)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @classmethod
    def stacked(cls, matrices: list["QuantizedMatrix"]) -> "QuantizedMatrix":
        """The matrices' rows one after the other (neighbouring segments of one format merge)."""
        if len({m.cols for m in matrices}) != 1:
            raise ValueError("stacked matrices must have the same number of columns")
        merged: list[Segment] = []
        for segment in (s for m in matrices for s in m.segments):
            if merged and merged[-1].type_name == segment.type_name:
                merged[-1] = Segment(segment.type_name, np.concatenate([merged[-1].data, segment.data]))
            else:
                merged.append(segment)
        return cls(matrices[0].cols, tuple(merged))

    def take_rows(self, order: np.ndarray) -> "QuantizedMatrix":
        """The rows in ``order`` (a permutation; rows are independent runs of blocks)."""
        if len(self.segments) != 1:
            raise ValueError("take_rows needs a matrix of one format")
        segment = self.segments[0]
        return QuantizedMatrix(self.cols, (Segment(segment.type_name, np.ascontiguousarray(segment.data[order])),))

    def dequantize(self) -> np.ndarray:
        """``[rows, cols]`` float32 (through the ``gguf`` package: an independent reference)."""
        import gguf

        parts = [gguf.quants.dequantize(np.asarray(s.data), gguf.GGMLQuantizationType[s.type_name])
                 for s in self.segments]
        return np.concatenate(parts).reshape(self.rows, self.cols).astype(np.float32)


def quantize(weight: np.ndarray, method: str) -> QuantizedMatrix:
    """Quantize a float ``[rows, cols]`` weight for ``quantization: wint8`` or ``wint4``.

    - ``wint8``: int8 per output channel, scale ``max|row| / 127``; stored as Q8_0 blocks whose
      scales all hold the channel's scale (rounded to half precision once, then used for every
      element), so the Q8_0 kernel runs it.
    - ``wint4``: int4 in groups of 32 along the input, one half-precision scale per group:
      llama.cpp's Q4_0 (its reference rounding, through the ``gguf`` package).
    """
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    rows, cols = weight.shape
    if cols % 32:
        raise ValueError(f"quantization {method}: rows of {cols} elements are not whole groups of 32")
    if method == "wint8":
        scale = (np.abs(weight).max(axis=1) / np.float32(127)).astype(np.float16)
        inverse = np.where(scale == 0, np.float32(0), np.float32(1) / scale.astype(np.float32))
        q = np.clip(np.rint(weight * inverse[:, None]), -127, 127).astype(np.int8)
        blocks = np.empty((rows, cols // 32, 34), np.uint8)
        blocks[:, :, :2] = np.repeat(scale.view(np.uint8).reshape(rows, 1, 2), cols // 32, axis=1)
        blocks[:, :, 2:] = q.view(np.uint8).reshape(rows, cols // 32, 32)
        return QuantizedMatrix(cols, (Segment("Q8_0", blocks.reshape(rows, -1)),))
    if method == "wint4":
        import gguf

        data = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_0)
        return QuantizedMatrix(cols, (Segment("Q4_0", data.reshape(rows, -1)),))
    raise ValueError(f"unknown quantization method {method!r}")


#: The K-quant formats with an interleaved layout: (kernel type id, interleaving function).
_K_INTERLEAVERS = {"Q4_K": (Q4K_INTERLEAVED_TYPE_ID, interleave_q4k_rows),
                   "Q6_K": (Q6K_INTERLEAVED_TYPE_ID, interleave_q6k_rows)}


def interleave_k_here(type_name: str = "Q4_K") -> bool:
    """Whether rows of ``type_name`` (Q4_K or Q6_K) are interleaved in groups of 16 for the
    kernel path this process runs (the CPU's best, or the one ``SPECDEC_CPU_ISA`` forces): the
    interleaved kernels compute several activation rows without the stored-row kernels'
    horizontal sums. (AMX tiles read both layouts: until 2026-12-07 they kept the stored rows,
    and on an Intel Xeon Qwen2.5-Coder-1.5B's 6-row pass took 86 ms where interleaved rows take
    65.) Q4_K on AVX2 and AVX-512 VNNI; Q6_K on AVX-512 VNNI only: on AVX2 its interleaved kernel,
    256-bit, was not faster than the stored rows; nor was one adding two chunks' pair sums in
    16 bits, in tiles of 6 rows (a Zen 3, 2026-12-07: Qwen2.5-Coder-1.5B's 1-row pass 1.12-1.2x
    slower, 6 rows alike, prefill 1.07x faster; docs/benchmarks/llamacpp.md). (On a Zen 4 Q6_K
    stayed stored from 2026-12-06 until the kernels prefetched into L2 there: with non-temporal
    prefetches its interleaved kernel read memory at half the stored rows' rate,
    docs/benchmarks/llamacpp.md.)
    Both layouts give the same outputs bit for bit on every path."""
    from specdec.kernels.cpu import has_avx512_vnni

    vnni = has_avx512_vnni() and os.environ.get("SPECDEC_CPU_ISA") != "avx2"
    return type_name == "Q4_K" or vnni


def kernel_parts(segment: Segment, cols: int, interleave_k: bool | None = None) -> list[tuple[int, np.ndarray]]:
    """``segment`` as the kernels store it: ``(kernel type id, rows of data)`` parts in row
    order. Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0: whole groups of 16 rows interleaved
    (:func:`interleave_rows`), the rows left over split (:func:`split_rows`; Q8_0, and Q4 rows
    whose length is a multiple of 64) or as stored; Q4_K and Q6_K: whole groups of 16 rows
    interleaved (:func:`interleave_q4k_rows`, :func:`interleave_q6k_rows`) where
    ``interleave_k`` (default: :func:`interleave_k_here`), the rest as stored; any other
    format as stored."""
    data, name = np.asarray(segment.data), segment.type_name
    if name in _K_INTERLEAVERS and (interleave_k_here(name) if interleave_k is None else interleave_k):
        type_id, interleave = _K_INTERLEAVERS[name]
        grouped = segment.rows // GROUP_ROWS * GROUP_ROWS
        parts = [(type_id, interleave(data[:grouped]))] if grouped else []
        return parts + ([(TYPE_IDS[name], data[grouped:])] if grouped < segment.rows else [])
    if name not in INTERLEAVED_TYPE_IDS:
        return [(TYPE_IDS[name], data)]
    grouped = segment.rows // GROUP_ROWS * GROUP_ROWS
    parts = [(INTERLEAVED_TYPE_IDS[name], interleave_rows(name, data[:grouped]))] if grouped else []
    rest = data[grouped:]
    if len(rest):
        if name == "Q8_0" or (name in SPLIT_TYPE_IDS and cols % 64 == 0):
            parts.append((SPLIT_TYPE_IDS[name], split_rows(name, rest)))
        else:
            parts.append((TYPE_IDS[name], rest))
    return parts


def packed_size(matrix: QuantizedMatrix) -> int:
    """Bytes of :func:`layout_array`'s data for ``matrix``."""
    return matrix.nbytes + SLACK_BYTES


def layout_array(matrix: QuantizedMatrix, out: np.ndarray | None = None,
                 interleave_k: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(data, layout)`` for the kernels: every segment's rows back to back, as
    :func:`kernel_parts` stores them (uint8, then ``SLACK_BYTES`` zeros), and ``[parts, 4]``
    int64 rows of (kernel type id, rows, byte offset, bytes per row). ``out``
    (``packed_size`` uint8s) receives the data if given."""
    data_out = np.empty(packed_size(matrix), np.uint8) if out is None else out
    layout, offset = [], 0
    for segment in matrix.segments:
        for type_id, data in kernel_parts(segment, matrix.cols, interleave_k):
            layout.append((type_id, data.shape[0], offset, data.shape[1]))
            data_out[offset:offset + data.nbytes] = data.reshape(-1)
            offset += data.nbytes
    data_out[offset:] = 0
    return data_out, np.array(layout, dtype=np.int64)


def load_quantized_ops(method: str):
    """The CPU kernels for ``quantization: method``, or a one-line :class:`specdec.SpecdecError`
    for a method other than ``wint8``/``wint4`` or kernels that are not built."""
    from specdec.errors import SpecdecError
    from specdec.kernels.cpu import KernelUnavailable, load_cpu_ops

    if method not in LOAD_TIME_FORMATS:
        raise SpecdecError(f"quantization: must be one of {', '.join(LOAD_TIME_FORMATS)}, got {method!r}")
    try:
        return load_cpu_ops()
    except KernelUnavailable as exc:
        raise SpecdecError(f"quantization: {method} needs the CPU kernels: {exc}") from None


def to_paddle(paddle, matrix: QuantizedMatrix):
    """``matrix`` as the kernels' ``(data, layout)`` paddle tensors (:func:`layout_array`)."""
    data, layout = layout_array(matrix)
    return paddle.to_tensor(data), paddle.to_tensor(layout)


class QuantizedLinear:
    """``x @ W^T`` with ``W`` quantized at construction, through the CPU kernels: for plugins
    that quantize their own matrices (an MTP or draft model's ``quantization``), exported as
    ``specdec.sdk.QuantizedLinear``.

    With ``norm_gain`` the call is ``(rms_norm(x) * norm_gain) @ W^T``, still one native call
    (the kernel normalizes each row on the way in): an RMSNorm followed by a projection (an MTP
    head's ``enorm`` and ``embed_proj``, a final norm and an LM head) without the five eager
    paddle ops the norm costs written out. Blocks stay as quantized, so the gain is applied to
    the activations rather than folded into ``W``.

    :param weight: ``[out, in]`` float weight (Hugging Face orientation); ``in`` a multiple of 32.
    :param method: ``wint8`` or ``wint4`` (see :func:`quantize`).
    :param norm_gain: ``[in]`` RMSNorm gain (numpy array or paddle tensor), or None for a plain matmul.
    :param eps: the RMSNorm's epsilon (with ``norm_gain``).
    """

    def __init__(self, weight: np.ndarray, method: str, *, norm_gain=None, eps: float = 1e-6):
        from specdec.errors import require_paddle

        self._ops = load_quantized_ops(method)
        paddle = require_paddle()
        self.out_features, self.in_features = weight.shape
        self._data, self._layout = to_paddle(paddle, quantize(weight, method))
        self._none = paddle.empty([0], dtype="float32")
        self._normalize = norm_gain is not None
        self._gain = self._none if norm_gain is None else paddle.to_tensor(
            np.ascontiguousarray(np.asarray(norm_gain), dtype=np.float32))
        self.eps = float(eps) if self._normalize else 0.0

    @property
    def normalizes(self) -> bool:
        """Whether the call normalizes its input (built with a ``norm_gain``)."""
        return self._normalize

    @property
    def operands(self) -> tuple:
        """``(gain, data, layout)``: the kernel operands, for the fused calls of
        :class:`specdec.model.quant_layer.QuantizedDecoderLayer` that end with this projection."""
        return self._gain, self._data, self._layout

    def __call__(self, x):
        """``[M, in]`` float32 paddle tensor -> ``[M, out]``."""
        return self._ops.specdec_q_matmul(x, self._gain, self._data, self._layout, self._none, self.eps,
                                          self._normalize)
