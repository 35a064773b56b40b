"""Suffix tree speed: speculate and append with a global tree of many cached responses.

    python benchmarks/bench_suffix.py [--responses 1000] [--tokens 1000] [--depth 64] [--source stdlib]
                                      [--trees compiled|python]

Fills the global tree of a ``suffix`` proposer with ``--responses`` responses of ``--tokens``
tokens each, then runs requests through the proposer's lifecycle (a batch of one) and prints a
table: append (``on_step`` with one accepted token: the request's tree plus its match in the
global tree), speculate (``propose``: one request's draft, both trees) and the global tree's
insert / evict cost. ``--trees python`` runs the Python twin of the compiled trees.

Text: ``stdlib`` (default) is the Python standard library's source tokenized with the default
model's tokenizer: real code, with the repetition real code has. ``zipf`` draws phrases of a
Zipfian vocabulary and strings them together with Zipfian phrase frequencies. Two kinds of
requests: ``fresh`` (held-out text, short matches) and ``repeat`` (a cached response generated
again, the repeated-workload case: matches as long as the depth).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import specdec
from specdec.plugins.suffix import SuffixConfig, SuffixProposer

PROMPT_TOKENS = 256


def stdlib_tokens(count: int) -> list[int]:
    """``count`` tokens of standard-library source, tokenized with the default model's tokenizer."""
    from specdec.model.resolve import DEFAULT_MODEL, resolve_model_path
    from specdec.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(resolve_model_path(DEFAULT_MODEL))
    root = Path(statistics.__file__).parent
    tokens: list[int] = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        tokens += tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False)
        if len(tokens) >= count:
            break
    if len(tokens) < count:
        raise SystemExit(f"only {len(tokens)} tokens of standard-library source, {count} wanted")
    return tokens[:count]


def zipf_tokens(count: int, seed: int = 0, vocab: int = 49152, phrases: int = 20000) -> list[int]:
    """``count`` tokens: Zipfian-frequent phrases (2-12 tokens) of Zipfian-frequent tokens."""
    rng = np.random.default_rng(seed)
    token_ranks = rng.permutation(vocab)
    bank = [token_ranks[np.minimum(rng.zipf(1.2, rng.integers(2, 13)) - 1, vocab - 1)].tolist()
            for _ in range(phrases)]
    tokens: list[int] = []
    while len(tokens) < count:
        for index in np.minimum(rng.zipf(1.1, 4096) - 1, phrases - 1):
            tokens += bank[index]
    return tokens[:count]


def rss_mb() -> float:
    """This process's resident memory in MB (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def micros(samples_ns: list[int]) -> tuple[float, float]:
    """(median, 90th percentile) in microseconds."""
    samples = sorted(samples_ns)
    return samples[len(samples) // 2] / 1e3, samples[int(len(samples) * 0.9)] / 1e3


def run_requests(proposer: SuffixProposer, texts: list[list[int]], steps: int, caps: tuple[int, ...]):
    """Generate ``steps`` tokens of each text through the proposer's lifecycle, one request at a
    time; time each ``on_step`` of one accepted token (the request's tree plus its match in the
    global tree) and each ``propose`` (its draft, both trees). Returns ({'append': ns...},
    {cap: ns...}, drafted tokens by cap)."""
    append_ns: list[int] = []
    speculate_ns: dict[int, list[int]] = {cap: [] for cap in caps}
    drafted = {cap: 0 for cap in caps}
    clock = time.perf_counter_ns
    for number, text in enumerate(texts):
        request_id = f"bench-{number}"
        tokens = list(text[:PROMPT_TOKENS])
        proposer.on_request_start(specdec.ProposalRequest(request_id, np.asarray(tokens, dtype=np.int64),
                                                          PROMPT_TOKENS, 0))
        for token in text[PROMPT_TOKENS: PROMPT_TOKENS + steps]:
            context = np.asarray(tokens, dtype=np.int64)
            for cap in caps:
                batch = specdec.ProposalBatch([specdec.ProposalRequest(request_id, context, PROMPT_TOKENS, cap)])
                start = clock()
                drafts = proposer.propose(batch)
                speculate_ns[cap].append(clock() - start)
                drafted[cap] += int(drafts.lengths[0])
            batch = specdec.ProposalBatch([specdec.ProposalRequest(request_id, context, PROMPT_TOKENS, 0)])
            accepted = [np.array([token], dtype=np.int64)]
            start = clock()
            proposer.on_step(batch, accepted)
            append_ns.append(clock() - start)
            tokens.append(token)
        # Finish without caching: keep the global tree as built.
        if proposer.native is not None:
            proposer.native.finish(request_id)
        else:
            proposer.requests.pop(request_id)
    return append_ns, speculate_ns, drafted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=1000, help="tokens per cached response")
    parser.add_argument("--depth", type=int, default=64)
    parser.add_argument("--source", choices=("stdlib", "zipf"), default="stdlib")
    parser.add_argument("--requests", type=int, default=20, help="requests per kind")
    parser.add_argument("--steps", type=int, default=200, help="generated tokens per request")
    parser.add_argument("--caps", default="5,32", help="num_speculative_tokens values to time")
    parser.add_argument("--trees", choices=("compiled", "python"), default="compiled",
                        help="the compiled trees (suffix_trees.cc) or their Python twin (tree.py)")
    args = parser.parse_args()
    caps = tuple(int(c) for c in args.caps.split(","))

    needed = (args.responses + args.requests) * args.tokens
    tokens = stdlib_tokens(needed) if args.source == "stdlib" else zipf_tokens(needed)
    responses = [tokens[i * args.tokens:(i + 1) * args.tokens] for i in range(args.responses)]
    held_out = [tokens[(args.responses + i) * args.tokens:(args.responses + i + 1) * args.tokens]
                for i in range(args.requests)]

    proposer = SuffixProposer(SuffixConfig(suffix_decoding_max_tree_depth=args.depth),
                              native=args.trees == "compiled")
    if args.trees == "compiled" and proposer.native is None:
        raise SystemExit("the compiled suffix trees are not available here (no C++ compiler?)")
    gc.collect()
    rss_before = rss_mb()
    start = time.perf_counter()
    for number, response in enumerate(responses):
        proposer.cache_response(f"cached-{number}", response)
    build_s = time.perf_counter() - start
    rss_after = rss_mb()
    tree = proposer.global_tree
    nodes = tree.num_nodes()

    rng = np.random.default_rng(1)
    repeats = [responses[i] for i in rng.choice(len(responses), args.requests, replace=False)]
    # A repeated request: its prompt is the first PROMPT_TOKENS of a cached response, which it
    # then generates again.
    rows = []
    for kind, texts in (("fresh", held_out), ("repeat", repeats)):
        append_ns, speculate_ns, drafted = run_requests(proposer, texts, args.steps, caps)
        rows.append((kind, "append 1 token", *micros(append_ns), ""))
        for cap in caps:
            mean_len = drafted[cap] / len(speculate_ns[cap])
            rows.append((kind, f"speculate k={cap}", *micros(speculate_ns[cap]), f"{mean_len:.2f}"))

    evict_ns = []
    for number in range(min(50, args.responses)):
        start = time.perf_counter_ns()
        tree.remove(f"cached-{number}")
        evict_ns.append(time.perf_counter_ns() - start)

    print(f"{args.trees} trees; global tree: {args.responses} responses x {args.tokens} tokens ({args.source}), depth {args.depth}: "
          f"{nodes:,} nodes+leaves, ~{rss_after - rss_before:,.0f} MB, "
          f"insert {build_s / (args.responses * args.tokens) * 1e6:.1f} us/token, "
          f"evict {statistics.median(evict_ns) / args.tokens / 1e3:.1f} us/token (median of {len(evict_ns)})")
    print(f"{args.requests} requests per kind, prompt {PROMPT_TOKENS} tokens, {args.steps} generated tokens each; "
          f"python {sys.version.split()[0]}")
    header = f"{'requests':<10}{'operation':<18}{'median us':>11}{'p90 us':>10}{'mean draft':>12}"
    print(header)
    print("-" * len(header))
    for kind, operation, median, p90, mean_len in rows:
        print(f"{kind:<10}{operation:<18}{median:>11.1f}{p90:>10.1f}{mean_len:>12}")


if __name__ == "__main__":
    main()
