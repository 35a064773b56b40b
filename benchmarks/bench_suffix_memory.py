"""Suffix proposer memory: the global tree's size as responses stream through it, bounded by
``suffix_decoding_max_cached_requests`` or not.

    python benchmarks/bench_suffix_memory.py [--responses 15000] [--tokens 64] [--caps 1000,10000,-1]

Each cap runs in a fresh process (resident memory never shrinks back within one): it finishes
``--responses`` requests of ``--tokens`` generated tokens (Zipfian phrases, the text model of
bench_suffix.py's ``zipf``) through the proposer's own lifecycle, and prints after every tenth
of them the responses the tree holds, its nodes and the process's resident memory above its
start. A bounded cache levels off once it is full; ``-1`` (the old default) grows with every
request the server ever answered.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import specdec
from specdec.plugins.suffix import SuffixConfig, SuffixProposer

sys.path.insert(0, str(Path(__file__).parent))
from bench_suffix import rss_mb, zipf_tokens  # noqa: E402


def finish_request(proposer: SuffixProposer, request_id: str, response: list[int]) -> None:
    """One request's life as the engine drives it: start (a 4-token prompt), one step that
    accepts the whole response, finish."""
    prompt = np.asarray([1, 2, 3, 4], dtype=np.int64)
    proposer.on_request_start(specdec.ProposalRequest(request_id, prompt, len(prompt), 0))
    batch = specdec.ProposalBatch([specdec.ProposalRequest(request_id, prompt, len(prompt), 0)])
    proposer.on_step(batch, [np.asarray(response, dtype=np.int64)])
    proposer.on_request_finish(request_id)


def run_one(cap: int, responses: int, tokens: int) -> None:
    text = zipf_tokens(responses * tokens)
    proposer = SuffixProposer(SuffixConfig(suffix_decoding_max_cached_requests=cap))
    gc.collect()
    base = rss_mb()
    start = time.perf_counter()
    for number in range(responses):
        finish_request(proposer, f"r{number}", text[number * tokens:(number + 1) * tokens])
        if (number + 1) % (responses // 10) == 0:
            tree = proposer.global_tree
            print(f"{cap:>7}{number + 1:>11}{len(tree):>9}{tree.num_nodes():>12,}{rss_mb() - base:>10.1f}"
                  f"{time.perf_counter() - start:>9.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--responses", type=int, default=15000)
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--caps", default="1000,10000,-1", help="suffix_decoding_max_cached_requests values")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: run this cap
    args = parser.parse_args()
    if args.one is not None:
        run_one(args.one, args.responses, args.tokens)
        return
    print(f"{args.responses} requests x {args.tokens} generated tokens (zipf), depth 64; python {sys.version.split()[0]}")
    print(f"{'cap':>7}{'finished':>11}{'cached':>9}{'nodes':>12}{'RSS MB':>10}{'secs':>9}")
    for cap in (int(c) for c in args.caps.split(",")):
        subprocess.run([sys.executable, __file__, "--one", str(cap), "--responses", str(args.responses),
                        "--tokens", str(args.tokens)], check=True)


if __name__ == "__main__":
    main()
