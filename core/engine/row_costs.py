"""What a verify row costs on this machine, measured once when a speculative engine starts.

The drafting controller prices a draft by the row it adds to the target's forward pass. At
batch 1 a step has one row, or one more per verified draft, and its time moves with the VM's
hour by more than a row costs, so the step-cost fit (``adaptive.py``) cannot tell a row's cost
from its own steps, and used to price it at a fixed prior. That prior cannot be right on every
CPU: over 300 positions a second row took 3% of a 1-row pass of the default model on AVX-512
and 21% on the AVX2 path, a third 9% and 43% (docs/benchmarks/decode.md, 2026-12-07). So the
engine times the model's own forward pass at a few row counts, the counts taking turns pass by
pass so that a slow spell of the machine hits them all, and hands the ratios to the controller.
"""

from __future__ import annotations

import time

import numpy as np

from ..attention import AttentionMetadata

#: The row counts timed: a request's fed row and up to three drafts (beyond that the steps of
#: one request vary enough for the fit to see the slope, and batches have many rows).
ROW_COUNTS = (1, 2, 3, 4)
#: Positions the timed rows attend over (a short chat's; a 1.5B model reads 64 in about half a second).
CONTEXT = 64
#: Rounds of passes at every row count: at least the first, at most the second, and no more
#: once the passes have taken :data:`TIME_BUDGET` seconds (a 1.5B model's pass takes 50 ms).
MIN_ROUNDS, MAX_ROUNDS = 3, 9
TIME_BUDGET = 0.4
#: A model whose 1-row pass takes longer than this is not timed (its steps leave the fit
#: time to learn, and sixteen passes would hold up its start): the Triton kernels run under
#: Triton's interpreter on a CPU take seconds a pass.
SLOWEST_PASS = 0.25


def measure_row_curve(model, pool, block_size: int, vocab_size: int, max_model_len: int) -> dict[int, float] | None:
    """``{rows: the fastest pass at rows / the fastest 1-row pass}`` for :data:`ROW_COUNTS`,
    each no less than the count before it (a ratio below is timing noise). The fastest, not
    the median: a pass is only ever slowed by what else runs (another process, the VM's
    neighbours); with a test run beside it, the median of nine rounds moved by more than a
    row costs. On a quiet machine the two agree within a few points.

    ``model`` is the engine's target (its ``forward``), ``pool`` its KV block pool: the passes
    write blocks taken from it and given back, before any request holds one. None where the
    pool has too few free blocks, the context is shorter than the passes need, or a 1-row pass
    takes more than :data:`SLOWEST_PASS`."""
    positions = CONTEXT + max(ROW_COUNTS)
    needed = -(-positions // block_size)
    if pool.num_free < needed or max_model_len < positions:
        return None
    blocks = [pool.allocate() for _ in range(needed)]
    try:
        tokens = (np.arange(positions, dtype=np.int64) * 7919 + 11) % vocab_size

        def rows_at(context: int, rows: int):
            return (tokens[context: context + rows], AttentionMetadata.build([rows], [context], [blocks], block_size),
                    np.arange(rows, dtype=np.int64))

        begun = time.perf_counter()
        model.forward(*rows_at(0, 1))  # first, before the prompt's pass: is the model fast enough to time?
        if time.perf_counter() - begun > SLOWEST_PASS:
            return None
        model.forward(tokens[:CONTEXT], AttentionMetadata.build([CONTEXT], [0], [blocks], block_size),
                      np.zeros(0, dtype=np.int64))
        cases = {rows: rows_at(CONTEXT, rows) for rows in ROW_COUNTS}
        for case in cases.values():  # the first pass at a shape pays for buffers the others reuse
            model.forward(*case)
        samples: dict[int, list[float]] = {rows: [] for rows in ROW_COUNTS}
        started = time.perf_counter()
        for round_ in range(MAX_ROUNDS):
            if round_ >= MIN_ROUNDS and time.perf_counter() - started > TIME_BUDGET:
                break
            for rows, case in cases.items():
                begun = time.perf_counter()
                model.forward(*case)
                samples[rows].append(time.perf_counter() - begun)
    finally:
        for block in blocks:
            pool.release(block)
    one_row = min(samples[ROW_COUNTS[0]])
    curve, previous = {}, 1.0
    for rows in ROW_COUNTS:
        previous = curve[rows] = max(min(samples[rows]) / one_row, previous)
    return curve
