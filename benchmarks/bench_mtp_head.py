"""The ``mtp`` head's cost per step at batch 1 on the default model: the proposer's ``propose``
(catch-up, drafts, logits) timed around each call, beside a naive step.

    python benchmarks/bench_mtp_head.py [--tokens 128] [--prompts 6] [--rounds 2] [--quantizations none,wint8]
                                        [--heads shipped,PATH]

One process, one engine: request by request it alternates naive and ``{"method": "mtp"}`` with
each head (``shipped``: the one that ships for the default model; a path: a head of
``specdec train-mtp``) and each head ``quantization`` (``none``: float32 eager paddle ops;
``wint8``, the default: the quantized kernels), so that load from other processes on a shared
machine falls on all of them alike. Prints per configuration the median engine step, the median and mean ``propose`` time,
the acceptance rate, and checks every output equals naive's (greedy, lossless).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import specdec
from specdec import SamplingParams
from specdec.workloads import chat_prompts, code_edit_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=6, help="chat prompts and code edits, two thirds chat")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quantizations", default="none,wint8")
    parser.add_argument("--heads", default="shipped", help="comma-separated: shipped, or paths of heads")
    args = parser.parse_args()

    configs = {"naive": None}
    heads = args.heads.split(",")
    for head in heads:
        for quantization in args.quantizations.split(","):
            label = f"mtp {quantization}" if len(heads) == 1 else f"mtp {quantization} {head}"
            configs[label] = {"method": "mtp", "adaptive_draft_length": False, "quantization": quantization,
                              **({} if head == "shipped" else {"model": head})}
    llm = specdec.LLM(progress=False)
    engine = llm.engine
    engine.scheduler.max_num_seqs = 1
    sampling = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    chat = args.prompts - args.prompts // 3
    prompts = chat_prompts(chat) + code_edit_prompts(args.prompts - chat)
    steps = {name: [] for name in configs}
    proposes = {name: [] for name in configs}
    outputs = {name: [] for name in configs}
    current = [""]
    step = engine.step

    def timed_step():
        start = time.perf_counter()
        result = step()
        steps[current[0]].append(time.perf_counter() - start)
        return result

    engine.step = timed_step
    for _ in range(args.rounds):
        for prompt in prompts:
            for name, spec in configs.items():
                llm.set_speculative_config(spec)
                if spec is not None:
                    propose = engine.proposer.propose

                    def timed_propose(batch, propose=propose, name=name):
                        start = time.perf_counter()
                        result = propose(batch)
                        proposes[name].append(time.perf_counter() - start)
                        return result

                    engine.proposer.propose = timed_propose
                current[0] = name
                outputs[name] += llm.generate([prompt], sampling)
    for name in configs:
        same = [o.token_ids for o in outputs[name]] == [o.token_ids for o in outputs["naive"]]
        line = f"{name:24s} step median {np.median(steps[name]) * 1e3:6.2f} ms"
        if proposes[name]:
            runs = outputs[name]
            accepted = sum(o.metrics.num_accepted_tokens for o in runs) / sum(o.metrics.num_draft_tokens for o in runs)
            line += (f"  propose median {np.median(proposes[name]) * 1e3:.3f} ms, mean "
                     f"{np.mean(proposes[name]) * 1e3:.3f} ms ({len(proposes[name])} steps)  acceptance {accepted:.3f}"
                     f"  equals naive: {'yes' if same else 'NO'}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
