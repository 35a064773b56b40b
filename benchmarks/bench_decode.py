"""Batch-1 decode speed: naive vs speculative methods on code-edit prompts (greedy).

    python benchmarks/bench_decode.py [--prompts 5] [--max-tokens 128] [--k 5]

Loads the model once, runs every method over the same prompts in the same process, prints a
table of tokens/s, mean acceptance length, acceptance rate and speedup over naive, and checks
that every method produced the naive tokens (greedy verification is lossless).
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
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--methods", default="naive,ngram")
    parser.add_argument("--extra", default=None, metavar="JSON",
                        help='more methods as {"name": {speculative config}}')
    args = parser.parse_args()

    configs = method_configs(args.k)
    if args.extra:
        configs.update(json.loads(args.extra))
    methods = args.methods.split(",") + (list(json.loads(args.extra)) if args.extra else [])
    llm = specdec.LLM(model=args.model, progress=False)
    prompts = code_edit_prompts(args.prompts)
    sampling = specdec.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    rows, reference = [], None
    for name in methods:
        llm.set_speculative_config(configs[name])
        llm.generate(prompts[0], specdec.SamplingParams(max_tokens=16), use_chat_template=True)  # warm-up
        outputs, elapsed = [], 0.0
        for prompt in prompts:
            llm.reset_prefix_cache()  # every run prefills its prompt itself
            start = time.perf_counter()
            outputs.extend(llm.generate(prompt, sampling, use_chat_template=True))
            elapsed += time.perf_counter() - start
        tokens = sum(o.num_generated_tokens for o in outputs)
        decode_time = sum(o.elapsed_s - o.first_token_s for o in outputs)
        decode_rate = sum(o.num_generated_tokens - 1 for o in outputs) / decode_time
        metrics = SpecMetrics.total(o.metrics for o in outputs)
        ids = [o.token_ids for o in outputs]
        same = "yes" if reference is None or ids == reference else "NO"
        reference = reference or ids
        rows.append((name, tokens, elapsed, tokens / elapsed, decode_rate, metrics.mean_acceptance_length,
                     metrics.acceptance_rate, same))

    base, base_decode = rows[0][3], rows[0][4]
    prompt_tokens = [len(llm.encode_prompt(p, True)) for p in prompts]
    print(f"model {args.model}, batch 1, greedy, {args.max_tokens} new tokens, {len(prompts)} code-edit "
          f"prompts ({min(prompt_tokens)}-{max(prompt_tokens)} prompt tokens), k={args.k}")
    header = (f"{'method':<10}{'tokens':>8}{'time s':>9}{'tok/s':>8}{'speedup':>9}{'decode tok/s':>14}"
              f"{'speedup':>9}{'accept len':>12}{'accept rate':>13}{'same ids':>10}")
    print(header)
    print("-" * len(header))
    for name, tokens, elapsed, rate, decode, length, acc, same in rows:
        print(f"{name:<10}{tokens:>8}{elapsed:>9.2f}{rate:>8.1f}{rate / base:>8.2f}x{decode:>14.1f}"
              f"{decode / base_decode:>8.2f}x{length:>12.2f}{acc:>13.2f}{same:>10}")
    print("tok/s: end to end per request (prefill included); decode tok/s: after the first token")


if __name__ == "__main__":
    main()
