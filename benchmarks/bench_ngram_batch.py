"""Time of the ngram proposer per step for a large batch with long contexts.

    python benchmarks/bench_ngram_batch.py [--batch 256] [--context 4096] [--steps 50]

Each request's context is real text: the code-edit prompts' token ids, concatenated and
rotated so that every request starts at a different place, cut to ``--context`` tokens. Every
step each request appends 1 to 3 tokens (as if that many were accepted), then one ``propose``
call drafts for the whole batch; the table shows the time of that call. The first call of a
request indexes its whole context; that one-off cost is timed separately (it happens when a
request is admitted, during its prefill).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import specdec
from specdec.model.resolve import resolve_model_path
from specdec.model.tokenizer import Tokenizer
from specdec.plugins.ngram import NgramConfig, NgramProposer
from specdec.workloads import code_edit_prompts


def contexts(batch: int, length: int) -> list[np.ndarray]:
    tokenizer = Tokenizer.from_gguf(resolve_model_path("smollm2-135m-instruct"))
    text = np.concatenate([tokenizer.encode(p) for p in code_edit_prompts(16)]).astype(np.int64)
    while len(text) < 2 * length:
        text = np.concatenate([text, text[::-1]])
    offsets = np.linspace(0, len(text) - length - 1, batch).astype(int)
    return [text[o: o + length].copy() for o in offsets]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--index", choices=("compiled", "python"), default="compiled",
                        help="the compiled index (default where a C++ compiler exists) or the Python one")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    base = contexts(args.batch, args.context)
    buffers = [np.concatenate([c, np.zeros(4 * args.steps, np.int64)]) for c in base]
    lengths = [args.context] * args.batch
    proposer = NgramProposer(NgramConfig())
    if args.index == "python":
        proposer._compiled = None  # what the proposer falls back to without a compiler
    elif proposer._compiled is None:
        raise SystemExit("the compiled ngram index is not available here (no C++ compiler?)")

    def batch() -> specdec.ProposalBatch:
        return specdec.ProposalBatch([
            specdec.ProposalRequest(f"r{i}", buffers[i][: lengths[i]], args.context, args.k)
            for i in range(args.batch)
        ])

    started = time.perf_counter()
    for request in batch().requests:
        proposer.on_request_start(request)
    admit_ms = (time.perf_counter() - started) * 1e3 / args.batch

    times, drafted = [], 0
    for _ in range(args.steps):
        for i in range(args.batch):  # accept 1-3 tokens: copy a continuation from the context
            count = int(rng.integers(1, 4))
            source = int(rng.integers(0, lengths[i] - count))
            buffers[i][lengths[i]: lengths[i] + count] = buffers[i][source: source + count]
            lengths[i] += count
        step_batch = batch()
        started = time.perf_counter()
        drafts = proposer.propose(step_batch)
        times.append(time.perf_counter() - started)
        drafted += int(drafts.lengths.sum())
    times_ms = np.array(times) * 1e3
    print(f"ngram proposer ({args.index} index), batch {args.batch}, {args.context}-token contexts, k={args.k}, "
          f"{args.steps} steps")
    print(f"{'per step ms (median)':>22} {'p90':>8} {'max':>8} {'per request us':>15} {'drafts/request':>15} "
          f"{'admit ms/request':>17}")
    print(f"{np.median(times_ms):22.2f} {np.percentile(times_ms, 90):8.2f} {times_ms.max():8.2f} "
          f"{np.median(times_ms) * 1e3 / args.batch:15.1f} {drafted / (args.steps * args.batch):15.2f} "
          f"{admit_ms:17.2f}")


if __name__ == "__main__":
    main()
