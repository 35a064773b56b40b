"""Batch-1 decode speed: naive vs speculative methods on code-edit or chat prompts (greedy).

    python benchmarks/bench_decode.py [--prompts 10] [--max-tokens 128] [--k 5] [--repeats 1] [--ignore-eos]
    python benchmarks/bench_decode.py --workload chat --methods naive,ngram,mtp,mtp3,hybrid,medusa

Loads the model once, runs every method over the same prompts in the same process (methods
take turns prompt by prompt), prints a
table of tokens/s, mean acceptance length, acceptance rate and speedup over naive, and checks
that every method produced the naive tokens (greedy verification is lossless).

Requests stop at EOS or after ``--max-tokens``, as a user's request does. ``--ignore-eos``
makes every request generate exactly ``--max-tokens``: this small model then starts a new,
made-up conversation after its answer, which nothing in the prompt grounds, so lookup methods
accept much less there (see docs/benchmarks/decode.md).
"""

from __future__ import annotations

import argparse
import json
import time

import specdec
from specdec.bench.results import machine_description
from specdec.metrics import SpecMetrics
from specdec.workloads import chat_prompts, code_edit_prompts


def method_configs(k: int) -> dict[str, dict]:
    return {
        "naive": {"method": "naive"},
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "verify_strategy": "greedy"},
        "suffix": {"method": "suffix", "num_speculative_tokens": k, "verify_strategy": "greedy"},
        # The shipped MTP head of the default model; mtpN drafts N tokens a step.
        "mtp": {"method": "mtp", "num_model_steps": 1, "verify_strategy": "greedy"},
        "mtp2": {"method": "mtp", "num_model_steps": 2, "num_speculative_tokens": 2, "verify_strategy": "greedy"},
        "mtp3": {"method": "mtp", "num_model_steps": 3, "num_speculative_tokens": 3, "verify_strategy": "greedy"},
        # hybrid as FastDeploy writes it: MTP drafts num_model_steps, ngram continues to k.
        "hybrid": {"method": "mtp", "mtp_strategy": "with_ngram", "num_model_steps": 1, "num_speculative_tokens": k,
                   "verify_strategy": "greedy"},
        "hybrid2": {"method": "mtp", "mtp_strategy": "with_ngram", "num_model_steps": 2, "num_speculative_tokens": k,
                    "verify_strategy": "greedy"},
        # The Medusa example package (examples/specdec-plugin-medusa), when installed.
        "medusa": {"method": "medusa", "verify_strategy": "greedy"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--methods", default="naive,ngram")
    parser.add_argument("--workload", choices=("code-edit", "chat"), default="code-edit")
    parser.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    parser.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens even past EOS")
    parser.add_argument("--extra", default=None, metavar="JSON",
                        help='more methods as {"name": {speculative config}}')
    args = parser.parse_args()

    configs = method_configs(args.k)
    if args.extra:
        configs.update(json.loads(args.extra))
    # --extra's methods run too; one named in --methods as well runs once.
    methods = list(dict.fromkeys(args.methods.split(",") + (list(json.loads(args.extra)) if args.extra else [])))
    llm = specdec.LLM(model=args.model, progress=False)
    prompts = code_edit_prompts(args.prompts) if args.workload == "code-edit" else chat_prompts(args.prompts)
    sampling = specdec.SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                       ignore_eos=args.ignore_eos)

    for name in methods:  # warm-up: first calls of each method's code paths
        llm.set_speculative_config(configs[name])
        llm.generate(prompts[0], specdec.SamplingParams(max_tokens=16), use_chat_template=True)

    # Methods take turns prompt by prompt, so that this machine's slow spells hit them alike.
    outputs = {name: [] for name in methods}
    elapsed = dict.fromkeys(methods, 0.0)
    for _ in range(args.repeats):
        for prompt in prompts:
            for name in methods:
                llm.set_speculative_config(configs[name])
                llm.reset_prefix_cache()  # every run prefills its prompt itself
                start = time.perf_counter()
                outputs[name].extend(llm.generate(prompt, sampling, use_chat_template=True))
                elapsed[name] += time.perf_counter() - start

    rows, reference = [], None
    for name in methods:
        done = outputs[name]
        tokens = sum(o.num_generated_tokens for o in done)
        decode_time = sum(o.elapsed_s - o.first_token_s for o in done)
        decode_rate = sum(o.num_generated_tokens - 1 for o in done) / decode_time
        metrics = SpecMetrics.total(o.metrics for o in done)
        ids = [o.token_ids for o in done]
        same = "yes" if reference is None or ids == reference else "NO"
        reference = reference or ids
        first = metrics.accepted_per_position[0] / metrics.num_drafts if metrics.num_drafts else 0.0
        rows.append((name, tokens, elapsed[name], tokens / elapsed[name], decode_rate,
                     metrics.mean_acceptance_length, metrics.acceptance_rate, first, same))

    base, base_decode = rows[0][3], rows[0][4]
    prompt_tokens = [len(llm.encode_prompt(p, True)) for p in prompts]
    stop = "EOS ignored" if args.ignore_eos else "stop at EOS"
    print(f"model {args.model}, batch 1, greedy, at most {args.max_tokens} new tokens ({stop}), {len(prompts)} "
          f"{args.workload} prompts ({min(prompt_tokens)}-{max(prompt_tokens)} prompt tokens), k={args.k}")
    print(machine_description())
    header = (f"{'method':<10}{'tokens':>8}{'time s':>9}{'tok/s':>8}{'speedup':>9}{'decode tok/s':>14}"
              f"{'speedup':>9}{'accept len':>12}{'accept rate':>13}{'1st accepted':>14}{'same ids':>10}")
    print(header)
    print("-" * len(header))
    for name, tokens, elapsed, rate, decode, length, acc, first, same in rows:
        print(f"{name:<10}{tokens:>8}{elapsed:>9.2f}{rate:>8.1f}{rate / base:>8.2f}x{decode:>14.1f}"
              f"{decode / base_decode:>8.2f}x{length:>12.2f}{acc:>13.2f}{first:>14.2f}{same:>10}")
    print("tok/s: end to end per request (prefill included); decode tok/s: after the first token; "
          "1st accepted: share of drafting steps whose first draft was accepted")


if __name__ == "__main__":
    main()
