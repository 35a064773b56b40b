"""What a verify row costs: the model's forward pass at 1, 2, 4, 6 and 8 rows over a context,
beside the floors the machine sets.

    python benchmarks/bench_rows.py [--model smollm2-135m-instruct] [--rows 1,2,4,6,8] [--context 300] [--repeats 30]
        [--layer-by-layer]

A request's verify step feeds its last token and its drafts: ``rows`` rows at positions
``context .. context + rows - 1`` over a cache of ``context`` positions (written once, then the
same slots rewritten each call). The table gives the median of ``--repeats`` forward passes
(the model's own ``forward``, logits included; the row counts take turns pass by pass), its
ratio to the 1-row pass, and two floors:

- memory: the bytes of weights a pass reads once (``weight_bytes``) over the memory bandwidth,
  measured here by every core reading its part of a 1 GiB array (an integer OR of its words);
- compute: the pass's multiply-adds (every weight once per row, plus attention over the
  context) over the best multiply-add rate the quantized kernels reach on the model's layer
  matrices with their weights in cache (three tiles of 6 or 8 rows more than one, the call's
  fixed cost left out; the best of the four matrices; the rate this ISA path gives, not the
  chip's paper peak).

The floor of a row count is the larger of the two. Prints the CPU it ran on.

``--layer-by-layer`` adds two columns: the same pass with the layers called one paddle
dispatch at a time (as with another attention backend, or a proposer that names
``hidden_state_layers``) instead of the one native call of every layer, the two taking turns,
and their ratio.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import specdec
from specdec.attention import AttentionMetadata
from specdec.bench.results import machine_description


def memory_bandwidth(gib: float = 1.0) -> float:
    """Bytes per second of every core reading a large array at once (one part each; best of 3).

    Each core ORs its part's 64-bit words together: no float dependency chains, so the reads
    are the limit. (A float sum, used until 2026-12-05, read 35 GB/s on a 2-core AMD Zen 5
    where this reads 47 and Qwen2.5-Coder-1.5B's 1-row forward read its 980 MB at 45-57.)"""
    from concurrent.futures import ThreadPoolExecutor

    cores = os.cpu_count() or 1
    data = np.ones(int(gib * 2**30) // 8, dtype=np.uint64)
    parts = np.array_split(data, cores)
    best = float("inf")
    with ThreadPoolExecutor(cores) as pool:
        for _ in range(3):
            started = time.perf_counter()
            list(pool.map(np.bitwise_or.reduce, parts))  # numpy releases the GIL while it reduces
            best = min(best, time.perf_counter() - started)
    return data.nbytes / best


#: A layer's matrices and the size of their input rows (a config attribute).
LAYER_MATRICES = (("qkv", "hidden_size"), ("o", "q_size"), ("gate_up", "hidden_size"), ("down", "intermediate_size"))


def kernel_mac_rate(model, tiles=(6, 8), repeats: int = 30) -> float:
    """The kernels' measured peak: the best multiply-adds per second of the first layer's
    matrices (q/k/v, o, gate/up, down), each in cache, at a whole tile of rows (6 on AVX2, 8 on
    AVX-512; the best of both). Each matrix runs at ``tile`` and at ``4 * tile`` rows and the rate
    is that of the three tiles more: the extra multiply-adds over the extra time (the median of
    ``repeats`` pairs of calls, the two sizes taking turns). A call's fixed cost (the Python and
    paddle dispatch, waking the pool) then drops out. A rate from one call's time counted it and
    put the floor too high: gate/up at 8 rows took 72 us a call, 57 a tile more (2026-12-07,
    Zen 4)."""
    paddle = model.paddle
    weights = model.weights
    none = paddle.empty([0], dtype="float32")
    rng = np.random.default_rng(0)
    best_rate = 0.0
    for name, width in LAYER_MATRICES:
        data, layout = weights.layers[0][name]
        cols = getattr(model.config, width)
        out_rows = int(layout.numpy()[:, 1].sum())
        for tile in tiles:
            inputs = [paddle.to_tensor(rng.standard_normal((rows, cols)).astype(np.float32))
                      for rows in (tile, 4 * tile)]
            extras = []
            for _ in range(repeats):  # the two sizes in turn: a slow spell of the VM hits both
                times = []
                for x in inputs:
                    started = time.perf_counter()
                    weights.ops.specdec_q_matmul(x, none, data, layout, none, 0.0, False)
                    times.append(time.perf_counter() - started)
                extras.append(times[1] - times[0])
            extra = float(np.median(extras))
            if extra > 0:
                best_rate = max(best_rate, 3 * tile * out_rows * cols / extra)
    return best_rate


def macs_per_row(config, context: int) -> float:
    c = config
    per_layer = (c.q_size + 2 * c.kv_size) * c.hidden_size + c.hidden_size * c.q_size \
        + 3 * c.intermediate_size * c.hidden_size + 2 * context * c.num_heads * c.head_dim
    return c.num_layers * per_layer + c.vocab_size * c.hidden_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", default="1,2,4,6,8")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--layer-by-layer", action="store_true",
                        help="also time each pass with the layers called one at a time (2 calls a layer, "
                             "as other attention backends run), interleaved with the one-call passes")
    args = parser.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    llm = specdec.LLM(args.model, None, progress=False)
    engine, model = llm.engine, llm.engine.model
    if not hasattr(model.weights, "weight_bytes"):
        raise SystemExit("bench_rows: the model runs unquantized; the floors need its quantized weights")
    block = engine.block_size
    positions = args.context + max(row_counts)
    pool = engine.kv.pool
    blocks = [pool.allocate() for _ in range(-(-positions // block))]
    tokens = np.random.default_rng(0).integers(100, 1000, positions).astype(np.int64)
    try:
        prefill = AttentionMetadata.build([args.context], [0], [blocks], block)
        model.forward(tokens[: args.context], prefill, np.zeros(0, dtype=np.int64))
        # The layer-by-layer path: what a proposer reading the last layer's state by name gets
        # (LlamaModel.forward runs every layer in one native call otherwise).
        paths = {"one call": {}}
        if args.layer_by_layer:
            paths["by layer"] = {"return_hidden": True, "hidden_layers": (model.config.num_layers,)}
        times, by_layer = {}, {}
        cases = {}
        for rows in row_counts:
            meta = AttentionMetadata.build([rows], [args.context], [blocks], block)
            cases[rows] = (tokens[args.context: args.context + rows], meta, np.arange(rows, dtype=np.int64))
            for options in paths.values():
                model.forward(*cases[rows], **options)  # warm
        samples = {(rows, name): [] for rows in row_counts for name in paths}
        for _ in range(args.repeats):
            # Row counts and paths take turns pass by pass: a slow spell of the VM (they last
            # seconds) hits them all, not the one that happened to run then.
            for rows in row_counts:
                for name, options in paths.items():
                    started = time.perf_counter()
                    model.forward(*cases[rows], **options)
                    samples[rows, name].append(time.perf_counter() - started)
        for rows in row_counts:
            times[rows] = float(np.median(samples[rows, "one call"]))
            if args.layer_by_layer:
                by_layer[rows] = float(np.median(samples[rows, "by layer"]))
    finally:
        for block_id in blocks:
            pool.release(block_id)
    bandwidth = memory_bandwidth()
    rate = kernel_mac_rate(model)
    weight_bytes = model.weights.weight_bytes()
    macs = macs_per_row(model.config, args.context)
    print(f"model {args.model}, context {args.context}, median of {args.repeats} forward passes; {machine_description()}")
    print(f"weights read per pass {weight_bytes / 1e6:.1f} MB, memory {bandwidth / 1e9:.1f} GB/s -> "
          f"{1e3 * weight_bytes / bandwidth:.2f} ms; {macs / 1e6:.0f} M multiply-adds a row, kernel "
          f"{rate / 1e9:.1f} GMAC/s in cache")
    header = f"{'rows':>5}{'ms':>9}{'x 1 row':>9}{'floor ms':>10}{'bound':>9}{'x floor':>9}"
    if by_layer:
        header += f"{'by layer ms':>13}{'ratio':>7}"
    print(header)
    print("-" * len(header))
    for rows in row_counts:
        memory_floor, compute_floor = weight_bytes / bandwidth, rows * macs / rate
        floor = max(memory_floor, compute_floor)
        bound = "memory" if memory_floor >= compute_floor else "compute"
        line = (f"{rows:>5}{1e3 * times[rows]:>9.2f}{times[rows] / times[row_counts[0]]:>9.2f}"
                f"{1e3 * floor:>10.2f}{bound:>9}{times[rows] / floor:>9.2f}")
        if by_layer:
            line += f"{1e3 * by_layer[rows]:>13.2f}{by_layer[rows] / times[rows]:>7.2f}"
        print(line)


if __name__ == "__main__":
    main()
