"""The byte layouts of quantized weights that the CPU kernels read (``specdec_quant_ops.cc``).

GGML block formats and their type ids, and the two regroupings of Q4_0 / Q4_1 / Q8_0 rows the
kernels read fastest (split and interleaved; Q5_0 / Q5_1 and Q4_K interleaved), with their inverses. Here, below the model layer,
so that the numpy twins and the model's packing share one definition of the bytes.
"""

from __future__ import annotations

import numpy as np

#: The block formats the kernels compute on: name -> (ggml type id, elements, bytes) per block.
BLOCK_FORMATS = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24),
                 "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}
TYPE_IDS = {name: type_id for name, (type_id, _, _) in BLOCK_FORMATS.items()}
TYPE_NAMES = {type_id: name for name, type_id in TYPE_IDS.items()}

#: The kernels' ids for Q4_0 / Q4_1 / Q8_0 rows in the split layout (:func:`split_rows`).
SPLIT_TYPE_IDS = {"Q4_0": 102, "Q4_1": 103, "Q8_0": 108}
#: Per split format: (block bytes, quant bytes, byte ranges of the block's halves d and m).
_SPLIT_FIELDS = {"Q4_0": (18, 16, [(0, 2)]), "Q4_1": (20, 16, [(0, 2), (2, 4)]), "Q8_0": (34, 32, [(0, 2)])}
#: Bytes after the last row: split rows read a little past their scales (see the kernel).
SLACK_BYTES = 16


def split_rows(type_name: str, data: np.ndarray) -> np.ndarray:
    """Q4_0 / Q4_1 / Q8_0 rows ``[rows, blocks * size]`` regrouped as the kernels read them
    fastest: each row becomes [the quants of every block][every d][every m (Q4_1)], in block
    order. The same bytes, moved: nothing is dequantized or rounded."""
    size, quant, halves = _SPLIT_FIELDS[type_name]
    rows = data.shape[0]
    blocks = np.asarray(data).reshape(rows, -1, size)
    parts = [blocks[:, :, size - quant:]] + [blocks[:, :, a:b] for a, b in halves]
    return np.concatenate([part.reshape(rows, -1) for part in parts], axis=1)


def unsplit_rows(type_name: str, data: np.ndarray) -> np.ndarray:
    """Inverse of :func:`split_rows`."""
    size, quant, halves = _SPLIT_FIELDS[type_name]
    rows, count = data.shape[0], data.shape[1] // size
    parts, offset = [], quant * count
    for _ in halves:
        parts.append(data[:, offset:offset + 2 * count].reshape(rows, count, 2))
        offset += 2 * count
    parts.append(data[:, :quant * count].reshape(rows, count, quant))
    return np.concatenate(parts, axis=2).reshape(rows, -1)


#: The kernels' ids for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 rows interleaved in groups of 16
#: (:func:`interleave_rows`).
INTERLEAVED_TYPE_IDS = {"Q4_0": 202, "Q4_1": 203, "Q5_0": 206, "Q5_1": 207, "Q8_0": 208}
#: Per interleaved format: (block bytes, quant bytes, byte ranges of the halves d and m, byte
#: range of the fifth bits qh or None).
_INTERLEAVED_FIELDS = {name: fields + (None,) for name, fields in _SPLIT_FIELDS.items()}
_INTERLEAVED_FIELDS["Q5_0"] = (22, 16, [(0, 2)], (2, 6))
_INTERLEAVED_FIELDS["Q5_1"] = (24, 16, [(0, 2), (2, 4)], (4, 8))
#: Rows in one interleaved group.
GROUP_ROWS = 16


def _reorder_fifth_bits(qh: np.ndarray, inverse: bool = False) -> np.ndarray:
    """A Q5 block's 4 bytes of fifth bits ``[..., 4]`` (bit j of the little-endian word: element
    j) reordered for the interleaved kernels: bit t of byte i becomes the fifth bit of element
    4t + i (the elements the kernel's vector t holds; quant_formats.h, Interleaved)."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")  # [..., 32]
    shape = (8, 4) if not inverse else (4, 8)  # ggml's element 4t + i / the kernels' bit 8i + t
    moved = bits.reshape(*bits.shape[:-1], *shape).swapaxes(-1, -2).reshape(bits.shape)
    return np.packbits(moved, axis=-1, bitorder="little")


def interleave_rows(type_name: str, data: np.ndarray) -> np.ndarray:
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 rows ``[16 * groups, blocks * size]`` regrouped as the
    kernels read them for several activation rows at once: per group of 16 rows and per block,
    the 16 rows' quants 4 bytes at a time (bytes 4c..4c+3 of every row, then 4c+4.., so that a
    64-byte vector holds one row per 32-bit lane), then (Q5) the 16 rows' fifth bits, 4 bytes a
    row, their bits reordered (:func:`_reorder_fifth_bits`), then the 16 rows' d, then their m
    (Q4_1, Q5_1). The same bytes, moved (Q5's fifth bits: the same bits, moved); returned as
    ``[16 * groups, blocks * size]`` (each group's 16 rows of bytes hold the group)."""
    size, quant, halves, high = _INTERLEAVED_FIELDS[type_name]
    rows = data.shape[0]
    if rows % GROUP_ROWS:
        raise ValueError(f"interleaved rows come in groups of {GROUP_ROWS}, got {rows}")
    groups, count = rows // GROUP_ROWS, data.shape[1] // size
    blocks = np.asarray(data).reshape(groups, GROUP_ROWS, count, size)
    quants = blocks[..., size - quant:].reshape(groups, GROUP_ROWS, count, quant // 4, 4).transpose(0, 2, 3, 1, 4)
    parts = [quants.reshape(groups, count, -1)]
    if high is not None:
        parts.append(_reorder_fifth_bits(blocks[..., high[0]:high[1]]).transpose(0, 2, 1, 3).reshape(groups, count, -1))
    parts += [blocks[..., a:b].transpose(0, 2, 1, 3).reshape(groups, count, -1) for a, b in halves]
    return np.concatenate(parts, axis=2).reshape(rows, -1)


def deinterleave_rows(type_name: str, data: np.ndarray) -> np.ndarray:
    """Inverse of :func:`interleave_rows`."""
    size, quant, halves, high = _INTERLEAVED_FIELDS[type_name]
    rows = data.shape[0]
    groups, count = rows // GROUP_ROWS, data.shape[1] // size
    grouped = np.asarray(data).reshape(groups, count, GROUP_ROWS * size)
    out = np.empty((groups, GROUP_ROWS, count, size), np.uint8)
    quants = grouped[..., :GROUP_ROWS * quant].reshape(groups, count, quant // 4, GROUP_ROWS, 4)
    out[..., size - quant:] = quants.transpose(0, 3, 1, 2, 4).reshape(groups, GROUP_ROWS, count, quant)
    offset = GROUP_ROWS * quant
    if high is not None:
        field = grouped[..., offset:offset + GROUP_ROWS * 4].reshape(groups, count, GROUP_ROWS, 4)
        out[..., high[0]:high[1]] = _reorder_fifth_bits(field, inverse=True).transpose(0, 2, 1, 3)
        offset += GROUP_ROWS * 4
    for a, b in halves:
        field = grouped[..., offset:offset + GROUP_ROWS * (b - a)].reshape(groups, count, GROUP_ROWS, b - a)
        out[..., a:b] = field.transpose(0, 2, 1, 3)
        offset += GROUP_ROWS * (b - a)
    return out.reshape(rows, -1)


#: The kernels' id for Q4_K rows interleaved in groups of 16 (:func:`interleave_q4k_rows`).
Q4K_INTERLEAVED_TYPE_ID = 212
#: Q4_K block fields in the interleaved order, with the bytes a kernel lane takes at a time: the
#: nibbles, the 12 bytes of 6-bit scales and mins, d, dmin.
_Q4K_FIELDS = (((16, 144), 4), ((4, 16), 4), ((0, 2), 2), ((2, 4), 2))


def interleave_q4k_rows(data: np.ndarray) -> np.ndarray:
    """Q4_K rows ``[16 * groups, supers * 144]`` regrouped as the interleaved Q4_K kernel reads
    them (quant_formats.h, ``InterleavedQ4K``): per group of 16 rows and per super-block, the 16
    rows' nibbles 4 bytes at a time (bytes 4c..4c+3 of every row, then 4c+4..), their 12 bytes
    of scales as three 4-byte words (word w of every row, then w+1), their 16 d, their 16 dmin.
    The same bytes, moved; returned as ``[16 * groups, supers * 144]``."""
    return _interleave_fields(data, 144, _Q4K_FIELDS)


def deinterleave_q4k_rows(data: np.ndarray) -> np.ndarray:
    """Inverse of :func:`interleave_q4k_rows`."""
    return _deinterleave_fields(data, 144, _Q4K_FIELDS)


#: The kernels' id for Q6_K rows interleaved in groups of 16 (:func:`interleave_q6k_rows`).
Q6K_INTERLEAVED_TYPE_ID = 214
#: Q6_K block fields in the interleaved order, with the bytes a kernel lane takes at a time: the
#: low nibbles (ql), the high bits (qh), the 16 int8 scales, d.
_Q6K_FIELDS = (((0, 128), 4), ((128, 192), 4), ((192, 208), 4), ((208, 210), 2))


def interleave_q6k_rows(data: np.ndarray) -> np.ndarray:
    """Q6_K rows ``[16 * groups, supers * 210]`` regrouped as the interleaved Q6_K kernel reads
    them (quant_formats.h, ``InterleavedQ6K``): per group of 16 rows and per super-block, the 16
    rows' ql 4 bytes at a time, their qh the same way, their 16 scales as four 4-byte words,
    their 16 d. The same bytes, moved; returned as ``[16 * groups, supers * 210]``."""
    return _interleave_fields(data, 210, _Q6K_FIELDS)


def deinterleave_q6k_rows(data: np.ndarray) -> np.ndarray:
    """Inverse of :func:`interleave_q6k_rows`."""
    return _deinterleave_fields(data, 210, _Q6K_FIELDS)


#: The unsigned integer type of each word size a field moves by.
_WORD_TYPES = {2: np.uint16, 4: np.uint32}


def _interleave_fields(data: np.ndarray, block: int, fields) -> np.ndarray:
    """Rows of ``block``-byte blocks regrouped per group of 16 rows and per block: each field
    ``((start, end), word)`` of the 16 rows, ``word`` bytes of every row at a time."""
    rows = data.shape[0]
    if rows % GROUP_ROWS:
        raise ValueError(f"interleaved rows come in groups of {GROUP_ROWS}, got {rows}")
    groups, count = rows // GROUP_ROWS, data.shape[1] // block
    blocks = np.ascontiguousarray(data).reshape(groups, GROUP_ROWS, count, block)
    out = np.empty((groups, count, GROUP_ROWS * block), np.uint8)
    offset = 0
    for (a, b), word in fields:
        # Moved as words of `word` bytes (numpy copies those far faster than single bytes).
        words = blocks[..., a:b].view(_WORD_TYPES[word])  # [groups, 16, count, (b - a) / word]
        size = GROUP_ROWS * (b - a)
        out[..., offset:offset + size].view(_WORD_TYPES[word]).reshape(groups, count, -1, GROUP_ROWS)[...] = \
            words.transpose(0, 2, 3, 1)
        offset += size
    return out.reshape(rows, -1)


def _deinterleave_fields(data: np.ndarray, block: int, fields) -> np.ndarray:
    """Inverse of :func:`_interleave_fields`."""
    rows = data.shape[0]
    groups, count = rows // GROUP_ROWS, data.shape[1] // block
    grouped = np.ascontiguousarray(data).reshape(groups, count, GROUP_ROWS * block)
    out = np.empty((groups, GROUP_ROWS, count, block), np.uint8)
    offset = 0
    for (a, b), word in fields:
        size = GROUP_ROWS * (b - a)
        words = grouped[..., offset:offset + size].view(_WORD_TYPES[word]).reshape(groups, count, -1, GROUP_ROWS)
        out[..., a:b].view(_WORD_TYPES[word])[...] = words.transpose(0, 3, 1, 2)
        offset += size
    return out.reshape(rows, -1)
