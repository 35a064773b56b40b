"""Batched throughput: naive vs ngram at several batch sizes on code-edit prompts (greedy).

    python benchmarks/bench_batch.py [--batches 1,8,32,64] [--max-tokens 128] [--k 5] [--repeats 1]

For batch size B the engine gets B different code-edit prompts at once (``max_num_seqs`` B)
and generates ``--max-tokens`` tokens for each (EOS ignored, so that every request is as long
as every other; ``--stop-at-eos`` lets them end as a user's would); the table shows the total
generated tokens per second over the whole run (prefill included) and over the decode steps
alone, plus ngram's speedup over naive at the same batch size. At batch 1 it runs
``--batch1-prompts`` prompts one after another. With ``--repeats N`` the methods take turns N
times and their times add up, so that this machine's slow spells hit them alike. Every
method's token ids are checked against naive's (greedy verification is lossless).
"""

from __future__ import annotations

import argparse
import json
import time

import specdec
from specdec.bench.results import machine_description
from specdec.metrics import SpecMetrics
from specdec.workloads import code_edit_prompts


def run(llm, prompts, sampling, batch: int):
    """``(outputs, wall seconds, decode seconds)`` of ``prompts`` in batches of ``batch``."""
    outputs, wall, decode = [], 0.0, 0.0
    for start in range(0, len(prompts), batch):
        group = prompts[start: start + batch]
        llm.engine.scheduler.max_num_seqs = batch
        llm.reset_prefix_cache()  # every run prefills its prompts itself
        began = time.perf_counter()
        result = llm.generate(group, sampling, use_chat_template=True)
        elapsed = time.perf_counter() - began
        wall += elapsed
        # Decode time: from the moment every request of the group had its first token.
        first = max(o.first_token_s for o in result)
        decode += elapsed - first
        outputs.extend(result)
    return outputs, wall, decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--batch1-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1, help="turns each method takes per batch size")
    parser.add_argument("--stop-at-eos", action="store_true", help="let requests end at EOS")
    parser.add_argument("--extra", default=None, metavar="JSON", help='more methods as {"name": {config}}')
    args = parser.parse_args()

    methods = {
        "naive": {"method": "naive"},
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "verify_strategy": "greedy"},
    }
    if args.extra:
        methods.update(json.loads(args.extra))
    batches = [int(b) for b in args.batches.split(",")]
    llm = specdec.LLM(model=args.model, progress=False)
    all_prompts = code_edit_prompts(max(batches + [args.batch1_prompts]))
    sampling = specdec.SamplingParams(max_tokens=args.max_tokens, ignore_eos=not args.stop_at_eos)
    llm.generate(all_prompts[0], specdec.SamplingParams(max_tokens=8), use_chat_template=True)  # warm-up

    length = "at most" if args.stop_at_eos else "exactly"
    print(f"model {args.model}, greedy, {length} {args.max_tokens} new tokens per request, code-edit prompts, "
          f"k={args.k}, {args.repeats} turn(s) per method")
    print(machine_description())
    header = (f"{'batch':>5} {'method':<8}{'requests':>9}{'tokens':>8}{'time s':>8}{'tok/s':>8}{'vs naive':>9}"
              f"{'decode tok/s':>13}{'vs naive':>9}{'accept len':>11}{'drafts/req/step':>16}{'same ids':>9}")
    print(header)
    print("-" * len(header))
    naive_rates = {}
    for batch in batches:
        prompts = all_prompts[: args.batch1_prompts] if batch == 1 else all_prompts[:batch]
        reference = base = base_decode = None
        runs = {name: ([], 0.0, 0.0) for name in methods}
        for _ in range(args.repeats):
            for name, config in methods.items():
                llm.set_speculative_config(config)
                outputs, wall, decode = run(llm, prompts, sampling, batch)
                done, wall_sum, decode_sum = runs[name]
                runs[name] = (done + outputs, wall_sum + wall, decode_sum + decode)
        for name, (outputs, wall, decode) in runs.items():
            tokens = sum(o.num_generated_tokens for o in outputs)
            metrics = SpecMetrics.total(o.metrics for o in outputs)
            ids = [o.token_ids for o in outputs]
            same = "yes" if reference is None or ids == reference else "NO"
            rate = tokens / wall
            # Decode rate: tokens after each request's first, over the time all were decoding.
            decode_rate = (tokens - len(outputs)) / decode if decode > 0 else 0.0
            if reference is None:
                reference, base, base_decode = ids, rate, decode_rate
            if name == "naive":
                naive_rates[batch] = rate
            drafts = metrics.num_draft_tokens / max(metrics.num_steps, 1)
            print(f"{batch:>5} {name:<8}{len(outputs):>9}{tokens:>8}{wall:>8.1f}{rate:>8.1f}{rate / base:>8.2f}x"
                  f"{decode_rate:>13.1f}{decode_rate / base_decode:>8.2f}x{metrics.mean_acceptance_length:>11.2f}"
                  f"{drafts:>16.2f}{same:>9}")
    if 1 in naive_rates:
        print("naive tok/s over batch 1: " + ", ".join(
            f"batch {b} {rate / naive_rates[1]:.1f}x" for b, rate in naive_rates.items() if b != 1))


if __name__ == "__main__":
    main()
