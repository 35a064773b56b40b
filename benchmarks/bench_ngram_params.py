"""Choose ngram defaults by measurement: replay the proposer over greedy outputs.

    python benchmarks/bench_ngram_params.py [--prompts 8] [--max-tokens 128]

Greedy verification emits exactly the plain greedy tokens, so the steps a configuration needs
can be computed offline: decode each prompt once with ``naive``, then walk the output, draft
with ``find_ngram_draft`` from the context so far, accept the longest prefix that matches the
true continuation, emit one more token, repeat. Prints mean acceptance length (tokens per
target forward) and acceptance rate for each (max_ngram_size, min_ngram_size, k).
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

import specdec
from specdec.plugins.ngram import find_ngram_draft
from specdec.workloads import code_edit_prompts


def replay(prompt_ids: np.ndarray, output_ids: np.ndarray, k: int, max_n: int, min_n: int) -> tuple[int, int, int]:
    """``(steps, draft tokens, accepted tokens)`` for one request under greedy verification."""
    tokens = np.concatenate([prompt_ids, output_ids])
    position, end = len(prompt_ids), len(tokens)
    steps = drafted = accepted = 0
    while position < end:
        budget = min(k, end - position - 1)
        draft = find_ngram_draft(tokens[:position], budget, max_n, min_n) if budget > 0 else tokens[:0]
        truth = tokens[position: position + len(draft)]
        matched = int(np.argmin(np.append(draft == truth, False)))
        steps += 1
        drafted += len(draft)
        accepted += matched
        position += matched + 1
    return steps, drafted, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    llm = specdec.LLM(progress=False)
    prompts = code_edit_prompts(args.prompts)
    sampling = specdec.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    outputs = llm.generate(prompts, sampling, use_chat_template=True)
    pairs = [(np.asarray(llm.encode_prompt(p, True)), np.asarray(o.token_ids)) for p, o in zip(prompts, outputs)]
    total = sum(len(o) for _, o in pairs)

    print(f"{len(prompts)} code-edit prompts, {total} greedy tokens")
    print(f"{'max_n':>6}{'min_n':>6}{'k':>4}{'accept len':>12}{'accept rate':>13}")
    for max_n, min_n, k in itertools.product((2, 3, 4, 5, 6, 8), (1, 2, 3), (3, 5, 8)):
        if min_n > max_n:
            continue
        steps = drafted = accepted = 0
        for prompt_ids, output_ids in pairs:
            s, d, a = replay(prompt_ids, output_ids, k, max_n, min_n)
            steps, drafted, accepted = steps + s, drafted + d, accepted + a
        print(f"{max_n:>6}{min_n:>6}{k:>4}{total / steps:>12.3f}{accepted / max(drafted, 1):>13.3f}")


if __name__ == "__main__":
    main()
