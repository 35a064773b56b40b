"""Where a decode step's time goes: the engine's phases timed, per method and batch size.

    python benchmarks/bench_step_phases.py [--methods naive,ngram,mtp] [--batches 1,64] [--max-tokens 64]

Loads the model once and runs code-edit prompts (EOS ignored, so every request is as long as
every other) with each method at each batch size, timing every phase of every step
(docs/architecture.md, "The step") by wrapping the engine's own functions: schedule, propose
(the proposer and the controller), the model's forward pass, the packing around it, row
processing, verification, the accept policy, the update (appending, detokenizing, stop
checks) and the proposer's ``on_step``. Prints milliseconds per step for each phase and
*host*: everything in a step but the native forward pass (the Python around it, the proposer
included). Steps that prefill are left out: the table is about decode steps.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import specdec
from specdec.bench.results import machine_description
from specdec.metrics import SpecMetrics
from specdec.workloads import code_edit_prompts

#: (label, object attribute path on the engine, method name).
PHASES = (
    ("schedule", "scheduler", "schedule"),
    ("propose", None, "_propose"),
    ("pack + forward", None, "_forward"),
    ("forward (native)", "model", "forward"),
    ("rows (processors)", None, "_process_rows"),
    ("verify", "verifier", "verify"),
    ("accept policy", "accept_policy", "apply"),
    ("update", None, "_update"),
)


class PhaseTimer:
    """Wraps the engine's phase functions on one engine; ``seconds[phase]`` sums their time
    over decode-only steps (the current step's are kept apart until it is known to be one)."""

    def __init__(self, engine):
        self.engine = engine
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._current: dict[str, float] = defaultdict(float)
        self._wrapped: list[tuple[object, str, object]] = []
        self._wrap(engine, "step", "step")
        for label, owner, name in PHASES:
            self._wrap(engine if owner is None else getattr(engine, owner), name, label)
        self._wrap(engine.proposer, "on_step", "on_step")
        # The controller's step cost is fed by decode-only steps alone: it marks them.
        self._wrap(engine.controller, "step_time", "decode-only")

    def close(self) -> None:
        """Put the engine's own functions back."""
        for target, name, own in reversed(self._wrapped):
            if own is None:
                delattr(target, name)
            else:
                setattr(target, name, own)

    def _wrap(self, target, name: str, label: str) -> None:
        real = getattr(target, name)
        self._wrapped.append((target, name, vars(target).get(name)))

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self._current[label] += time.perf_counter() - started
                if label == "step":
                    self._end_step()

        setattr(target, name, timed)

    def _end_step(self) -> None:
        if "decode-only" in self._current:
            for label, seconds in self._current.items():
                self.seconds[label] += seconds
            self.steps += 1
        self._current = defaultdict(float)

    def rows(self) -> list[tuple[str, float]]:
        per_step = {label: 1000 * seconds / max(self.steps, 1) for label, seconds in self.seconds.items()}
        per_step["pack (around forward)"] = per_step.get("pack + forward", 0.0) - per_step.get("forward (native)", 0.0)
        per_step["host (step - native forward)"] = per_step.get("step", 0.0) - per_step.get("forward (native)", 0.0)
        order = ["step", "schedule", "propose", "pack (around forward)", "forward (native)", "rows (processors)",
                 "verify", "accept policy", "update", "on_step", "host (step - native forward)"]
        return [(label, per_step.get(label, 0.0)) for label in order]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--methods", default="naive,ngram,mtp")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    methods = args.methods.split(",")
    llm = specdec.LLM(args.model, None, max_num_seqs=max(batches), progress=False)
    prompts = code_edit_prompts(max(max(batches), 4))
    sampling = specdec.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[0], specdec.SamplingParams(max_tokens=8), use_chat_template=True)  # warm-up
    print(f"model {args.model}, code-edit prompts, {args.max_tokens} tokens each (EOS ignored), greedy; "
          f"{machine_description()}; ms per decode step")
    results = {}
    for batch in batches:
        for method in methods:
            llm.set_speculative_config({"method": method})
            llm.engine.scheduler.max_num_seqs = batch
            group = prompts[:batch] if batch > 1 else prompts[:4]
            llm.generate(group[:1], specdec.SamplingParams(max_tokens=16), use_chat_template=True)  # the method warm
            llm.reset_prefix_cache()
            timer = PhaseTimer(llm.engine)
            outputs = llm.generate(group, sampling, use_chat_template=True)
            tokens = SpecMetrics.total(o.metrics for o in outputs).mean_acceptance_length
            timer.close()
            results[(batch, method)] = (timer.rows(), timer.steps, tokens)
    labels = [label for label, _ in next(iter(results.values()))[0]]
    columns = [f"b{batch} {method}" for batch, method in results]
    width = max(len(c) for c in columns) + 2
    print(f"{'phase':<30}" + "".join(f"{c:>{width}}" for c in columns))
    for i, label in enumerate(labels):
        print(f"{label:<30}" + "".join(f"{rows[i][1]:>{width}.2f}" for rows, _, _ in results.values()))
    print(f"{'decode steps timed':<30}" + "".join(f"{steps:>{width}}" for _, steps, _ in results.values()))
    print(f"{'tokens per step (per request)':<30}" + "".join(f"{tokens:>{width}.2f}" for _, _, tokens in results.values()))


if __name__ == "__main__":
    main()
