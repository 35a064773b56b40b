"""One quantized matmul at a time: the kernels' layout of each matrix against what came before it.

Q4_0 / Q4_1 / Q8_0 rows interleaved against split, other formats as stored against int8 per
channel, on the default model's shapes, for decode, verify and prefill row counts.

    python benchmarks/bench_quant_matmul.py [--rows 1,6,16,190] [--repeats 20]
    python benchmarks/bench_quant_matmul.py --shapes gate_up=Q5_0:9728:896,down=Q5_0:896:4864 --rows 1,6

Each matrix is random blocks of the format (the kernels' speed does not depend on the values)
in the shape the default model's layers use (SmolLM2-135M: hidden 576, inner 1536, vocab 49152;
``--shapes`` for others), built once in each layout: ``interleaved`` (groups of 16 rows, what
``layout_array`` stores) and ``split`` (every row split, what it stored before the groups).
Q4_K, where this CPU interleaves it (AVX2), is timed interleaved against stored rows. A format
without a split layout (Q5_0, Q5_1, Q5_K, Q6_K; Q4_K elsewhere) is timed as stored
(``layout_array``) against the same matrix dequantized and requantized to int8 per channel
(``quantize(..., "wint8")``: what the loader made of Q5 blocks before the kernels read them).
The table gives the best of ``--repeats`` calls of ``specdec_q_matmul`` (the weights stay in
the caches between calls: this times the arithmetic, not the memory) and the multiply-adds per
second of the kernels' layout.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from specdec.bench.results import machine_description
from specdec.model.quant import (BLOCK_FORMATS, SLACK_BYTES, SPLIT_TYPE_IDS, QuantizedMatrix, Segment,
                                 interleave_k_here, layout_array, quantize, split_rows)

#: name: (format, rows N, columns K) of the default model's matrices.
DEFAULT_SHAPES = {"qkv": ("Q4_1", 960, 576), "o": ("Q4_1", 576, 576), "gate_up": ("Q4_1", 3072, 576),
                  "down": ("Q4_1", 576, 1536), "lm_head": ("Q8_0", 49152, 576)}


#: Byte offsets of each format's half-precision scales (d; and m or dmin) in its block.
HALF_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}


def random_matrix(rng, type_name: str, rows: int, cols: int) -> QuantizedMatrix:
    """Random blocks with finite, small half-precision scales (d, and Q4_1's m)."""
    _, elems, size = BLOCK_FORMATS[type_name]
    blocks = rng.integers(0, 256, size=(rows, cols // elems, size), dtype=np.uint8)
    for offset in HALF_FIELDS[type_name]:
        scales = rng.uniform(0.002, 0.05, size=(rows, cols // elems)).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, cols // elems, 2)
    return QuantizedMatrix(cols, (Segment(type_name, blocks.reshape(rows, -1)),))


def split_layout(matrix: QuantizedMatrix) -> tuple[np.ndarray, np.ndarray]:
    """Every row split (no groups): the layout the kernels read before the interleaved groups."""
    [segment] = matrix.segments
    data = split_rows(segment.type_name, np.asarray(segment.data))
    packed = np.zeros(data.nbytes + SLACK_BYTES, np.uint8)
    packed[:data.nbytes] = data.reshape(-1)
    layout = np.array([[SPLIT_TYPE_IDS[segment.type_name], segment.rows, 0, data.shape[1]]], np.int64)
    return packed, layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,6,16,190", help="activation rows per matmul")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shapes", default=None, metavar="NAME=FORMAT:N:K,...",
                        help="matrices to time instead of the default model's")
    args = parser.parse_args()

    import paddle

    from specdec.kernels.cpu import load_cpu_ops

    ops = load_cpu_ops()
    shapes = DEFAULT_SHAPES
    if args.shapes:
        shapes = {}
        for item in args.shapes.split(","):
            name, spec = item.split("=")
            type_name, rows, cols = spec.split(":")
            shapes[name] = (type_name, int(rows), int(cols))
    rng = np.random.default_rng(0)
    none = paddle.empty([0], dtype="float32")
    print(machine_description())
    print(f"{'matrix':<10}{'format':>7}{'N x K':>13}{'rows':>6}{'baseline':>9}{'ms':>8}{'kernels ms':>12}"
          f"{'speedup':>9}{'GMAC/s':>8}")
    for name, (type_name, n, k) in shapes.items():
        matrix = random_matrix(rng, type_name, n, k)
        if type_name in SPLIT_TYPE_IDS:
            baseline, before = "split", split_layout(matrix)
        elif type_name == "Q4_K" and interleave_k_here():
            baseline, before = "stored", layout_array(matrix, interleave_k=False)
        else:
            baseline, before = "int8/ch", layout_array(quantize(matrix.dequantize(), "wint8"))
        layouts = {"before": before, "now": layout_array(matrix)}
        tensors = {key: (paddle.to_tensor(data), paddle.to_tensor(layout)) for key, (data, layout) in layouts.items()}
        for m in (int(r) for r in args.rows.split(",")):
            x = paddle.to_tensor(rng.standard_normal((m, k)).astype(np.float32))
            best = {}
            outputs = {}
            for key, (data, layout) in tensors.items():
                outputs[key] = ops.specdec_q_matmul(x, none, data, layout, none, 1e-5, False).numpy()
                best[key] = float("inf")
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    ops.specdec_q_matmul(x, none, data, layout, none, 1e-5, False)
                    best[key] = min(best[key], time.perf_counter() - start)
            if baseline == "stored":  # the same integer sums and float steps
                np.testing.assert_array_equal(outputs["now"], outputs["before"])
            if baseline == "split":  # both layouts compute the same products (in another float order)
                np.testing.assert_allclose(outputs["now"], outputs["before"], rtol=1e-3,
                                           atol=1e-3 * np.abs(outputs["before"]).max())
            print(f"{name:<10}{type_name:>7}{f'{n} x {k}':>13}{m:>6}{baseline:>9}{best['before'] * 1e3:>8.3f}"
                  f"{best['now'] * 1e3:>12.3f}{best['before'] / best['now']:>8.2f}x"
                  f"{n * k * m / best['now'] / 1e9:>8.1f}")


if __name__ == "__main__":
    main()
