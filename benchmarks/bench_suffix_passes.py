"""A repeated workload: the code-edit prompts three times through one engine, per method.

    python benchmarks/bench_suffix_passes.py [--prompts 5] [--max-tokens 128] [--passes 3] [--batch 1]

For each method (naive, ngram, suffix; ``--extra`` adds speculative configs as JSON) the model
runs the same prompts ``--passes`` times with one proposer, so ``suffix`` can draft from the
answers of the earlier passes. Prints tokens/s (end to end and decode), mean acceptance length
and acceptance rate per pass, and whether every pass produced naive's tokens.
"""

from __future__ import annotations

import argparse
import json
import time

import specdec
from specdec.metrics import SpecMetrics
from specdec.workloads import code_edit_prompts


def method_configs(k: int) -> dict[str, dict]:
    return {
        "naive": {"method": "naive"},
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "verify_strategy": "greedy"},
        "suffix": {"method": "suffix", "num_speculative_tokens": k, "verify_strategy": "greedy"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1, help="max_num_seqs")
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--methods", default="naive,ngram,suffix")
    parser.add_argument("--extra", default=None, metavar="JSON",
                        help='more methods as {"name": {speculative config}}')
    args = parser.parse_args()

    configs = method_configs(args.k)
    extra = json.loads(args.extra) if args.extra else {}
    configs.update(extra)
    methods = args.methods.split(",") + list(extra)
    llm = specdec.LLM(model=args.model, max_num_seqs=args.batch, progress=False)
    prompts = code_edit_prompts(args.prompts)
    sampling = specdec.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[0], specdec.SamplingParams(max_tokens=16), use_chat_template=True)  # warm-up

    rows, reference = [], None
    for name in methods:
        llm.set_speculative_config(configs[name])  # a fresh proposer: nothing cached yet
        for number in range(1, args.passes + 1):
            llm.reset_prefix_cache()  # each pass prefills its prompts: only the proposer remembers
            start = time.perf_counter()
            outputs = llm.generate(prompts, sampling, use_chat_template=True)
            elapsed = time.perf_counter() - start
            tokens = sum(o.num_generated_tokens for o in outputs)
            decode_time = sum(o.elapsed_s - o.first_token_s for o in outputs)
            decode_rate = sum(o.num_generated_tokens - 1 for o in outputs) / decode_time
            metrics = SpecMetrics.total(o.metrics for o in outputs)
            ids = [o.token_ids for o in outputs]
            same = "yes" if reference is None or ids == reference else "NO"
            reference = reference or ids
            rows.append((name, number, tokens, elapsed, tokens / elapsed, decode_rate,
                         metrics.mean_acceptance_length, metrics.acceptance_rate, same))

    base = {row[1]: row for row in rows if row[0] == methods[0]}
    prompt_tokens = [len(llm.encode_prompt(p, True)) for p in prompts]
    print(f"model {args.model}, batch {args.batch}, greedy, {args.max_tokens} new tokens, {len(prompts)} code-edit "
          f"prompts ({min(prompt_tokens)}-{max(prompt_tokens)} prompt tokens) x {args.passes} passes, k={args.k}")
    header = (f"{'method':<14}{'pass':>5}{'tokens':>8}{'time s':>9}{'tok/s':>8}{'speedup':>9}"
              f"{'decode tok/s':>14}{'speedup':>9}{'accept len':>12}{'accept rate':>13}{'same ids':>10}")
    print(header)
    print("-" * len(header))
    for name, number, tokens, elapsed, rate, decode, length, acc, same in rows:
        b = base[number]
        print(f"{name:<14}{number:>5}{tokens:>8}{elapsed:>9.2f}{rate:>8.1f}{rate / b[4]:>8.2f}x{decode:>14.1f}"
              f"{decode / b[5]:>8.2f}x{length:>12.2f}{acc:>13.2f}{same:>10}")
    print(f"speedup: against {methods[0]} in the same pass; tok/s: end to end (prefill included); "
          "decode tok/s: after each request's first token")


if __name__ == "__main__":
    main()
