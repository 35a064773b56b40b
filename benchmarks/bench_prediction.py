"""Predicted Outputs and agent loops: end-to-end speed at batch 1 against naive decoding.

    python benchmarks/bench_prediction.py [--model PATH] [--tasks 6] [--max-tokens 400]
                                          [--min-lines 8] [--max-lines 30] [--turns 4] [--agent-max-tokens 500] [--skip-agent]
                                          [--skip-edits] [--agent-cache warm|cold|both]

Two workloads, greedy, one request at a time (batch 1), one run, each request timed end to
end (submitted to finished: prefill included) in this process (``specdec.LLM``), from a
cold prefix cache unless said otherwise:

1. Code edits (``specdec.workloads.code_edit_tasks``: held-out standard-library functions, a
   small edit each: rename, a comment, a docstring; the system prompt asks for the whole edited
   code), where the client passes the original code as OpenAI's ``prediction``: ``naive``,
   ``naive+prediction`` and ``ngram+prediction``. The goal: >= 3x naive.
2. An agent loop: one conversation of ``--turns`` turns over a file of three functions; each
   turn asks for one more small edit and the whole file back, so the assistant re-emits what it
   wrote the turn before (it is in the history): ``naive`` and ``suffix``. The goal: suffix
   >= 2x naive. Run with the prefix cache kept across turns (warm: what a server does for an
   agent, which re-sends its whole history every turn) and emptied before every request (cold).

The ``1st tok s`` column is the time to the first token summed over the requests (prefill,
mostly): no draft shortens it, so it bounds what speculation can gain end to end.

The engines take turns request by request (one model, the method switched between requests),
so a change in the machine's speed hits them alike. At temperature 0 every engine must give
naive's text (the ``same`` column). The machine's CPU is printed with the results:
numbers from a busy machine are worthless.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import specdec
from specdec import SamplingParams
from specdec.bench.results import cpu_name
from specdec.workloads import EDIT_SYSTEM_PROMPT, code_edit_tasks, stdlib_functions

CODE_EDIT_ENGINES = {
    "naive": (None, False),
    "naive+prediction": (None, True),
    "ngram+prediction": ({"method": "ngram"}, True),
}
AGENT_ENGINES = {"naive": None, "suffix": {"method": "suffix"}}
#: The agent loop's edits, one per turn (``{name}``: a function of the file).
AGENT_EDITS = (
    "Add a one-line comment above `{name}`.",
    "Rename `{name}` to `{name}_new` (and its uses).",
    "Add a docstring to `{name}`.",
    "Add a type hint for the return value of `{name}`.",
    "Rename the first parameter of `{name}` to `value`.",
    "Add a one-line comment at the top of the file.",
)


class Tally:
    """Tokens, seconds and prediction counts of one engine over its requests."""

    def __init__(self):
        self.tokens = self.accepted = self.rejected = self.steps = 0
        self.seconds = self.first_token_seconds = 0.0
        self.texts: list[str] = []

    def add(self, output, seconds: float) -> None:
        self.tokens += output.num_generated_tokens
        self.steps += output.metrics.num_steps
        self.seconds += seconds
        self.first_token_seconds += output.first_token_s
        self.accepted += output.metrics.num_prediction_accepted
        self.rejected += output.metrics.num_prediction_rejected
        self.texts.append(output.text)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def timed_chat(llm: specdec.LLM, spec, messages: list[dict], sampling: SamplingParams, cold: bool = True):
    """``llm.chat`` with ``spec`` as the method (from a cold prefix cache unless ``cold`` is
    false); (output, seconds)."""
    llm.set_speculative_config(spec)
    if cold:
        llm.reset_prefix_cache()
    start = time.perf_counter()
    output = llm.chat(messages, sampling)
    return output, time.perf_counter() - start


def code_edits(llm: specdec.LLM, tasks: int, max_tokens: int, min_lines: int, max_lines: int) -> dict[str, Tally]:
    tallies = {name: Tally() for name in CODE_EDIT_ENGINES}
    for messages, prediction in code_edit_tasks(tasks, min_lines=min_lines, max_lines=max_lines):
        prediction_ids = llm.tokenizer.encode(prediction, add_special_tokens=False)
        for name, (spec, predicted) in CODE_EDIT_ENGINES.items():
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                      prediction=prediction_ids if predicted else ())
            tallies[name].add(*timed_chat(llm, spec, messages, sampling))
    return tallies


def agent_loop(llm: specdec.LLM, turns: int, max_tokens: int, cold: bool) -> dict[str, Tally]:
    """One conversation per engine, turn by turn (engines alternating at each turn); each
    engine's own answers go into its history (at temperature 0 they are naive's).

    Warm (``cold`` false), the prefix cache is kept, as a server keeps it for an agent: a turn
    prefills only what the history does not share with what was cached. The histories are the
    same text, so the engine that goes second in a turn finds the first one's prompt cached:
    the order flips every turn."""
    functions = stdlib_functions(6, 14, ("fnmatch", "colorsys", "bisect", "heapq"))[:3]
    names = [re.match(r"def (\w+)", code).group(1) for code in functions]
    file_text = "\n\n\n".join(functions)
    histories = {name: [{"role": "system", "content": EDIT_SYSTEM_PROMPT}] for name in AGENT_ENGINES}
    tallies = {name: Tally() for name in AGENT_ENGINES}
    for turn in range(turns):
        edit = AGENT_EDITS[turn % len(AGENT_EDITS)].format(name=names[turn % len(names)])
        request = f"{edit} Reply with the whole file."
        if turn == 0:
            request = f"Here is utils.py:\n\n```python\n{file_text}\n```\n\n{request}"
        order = list(AGENT_ENGINES.items())
        for name, spec in order if turn % 2 == 0 else order[::-1]:
            history = histories[name]
            history.append({"role": "user", "content": request})
            output, seconds = timed_chat(llm, spec, history, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                         cold=cold)
            tallies[name].add(output, seconds)
            history.append({"role": "assistant", "content": output.text})
    return tallies


def print_table(title: str, tallies: dict[str, Tally]) -> None:
    base = tallies["naive"]
    print(title)
    header = (f"{'engine':<18}{'tokens':>8}{'seconds':>9}{'1st tok s':>10}{'tok/s':>8}{'speedup':>9}{'tok/step':>9}"
              f"{'pred accepted':>15}{'pred rejected':>15}{'same':>6}")
    print(header)
    print("-" * len(header))
    for name, tally in tallies.items():
        same = "yes" if tally.texts == base.texts else "NO"
        speedup = tally.rate / base.rate if base.rate else 0.0
        per_step = tally.tokens / tally.steps if tally.steps else 0.0
        print(f"{name:<18}{tally.tokens:>8}{tally.seconds:>9.2f}{tally.first_token_seconds:>10.2f}{tally.rate:>8.1f}"
              f"{speedup:>8.2f}x{per_step:>9.2f}"
              f"{tally.accepted:>15}{tally.rejected:>15}{same:>6}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file or model name (default: the default model)")
    parser.add_argument("--tasks", type=int, default=6, help="code-edit tasks")
    parser.add_argument("--max-tokens", type=int, default=400, help="most tokens of a code-edit answer")
    parser.add_argument("--min-lines", type=int, default=8, help="shortest function of a task, in lines")
    parser.add_argument("--max-lines", type=int, default=30, help="longest function of a task, in lines")
    parser.add_argument("--turns", type=int, default=4, help="turns of the agent loop")
    parser.add_argument("--agent-max-tokens", type=int, default=500, help="most tokens of an agent-loop answer")
    parser.add_argument("--skip-agent", action="store_true", help="run the code edits only")
    parser.add_argument("--skip-edits", action="store_true", help="run the agent loop only")
    parser.add_argument("--agent-cache", choices=("warm", "cold", "both"), default="both",
                        help="the agent loop with the prefix cache kept across turns (as a server keeps it), "
                             "emptied before every request, or both")
    args = parser.parse_args()

    llm = specdec.LLM(**({"model": args.model} if args.model else {}), progress=False)
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs; model: {llm.engine.config.model}; "
          f"python {sys.version.split()[0]}; batch 1, greedy, one run, end to end")
    print()
    if not args.skip_edits:
        tallies = code_edits(llm, args.tasks, args.max_tokens, args.min_lines, args.max_lines)
        print_table(f"code edits with the original code as prediction: {args.tasks} tasks, functions of "
                    f"{args.min_lines}-{args.max_lines} lines, max_tokens {args.max_tokens} (goal: >= 3x naive)", tallies)
    for cache in ("warm", "cold") if args.agent_cache == "both" else (args.agent_cache,):
        if args.skip_agent:
            break
        tallies = agent_loop(llm, args.turns, args.agent_max_tokens, cold=cache == "cold")
        print_table(f"agent loop: {args.turns} turns re-emitting a file with small edits, "
                    f"max_tokens {args.agent_max_tokens}, {cache} prefix cache (goal: suffix >= 2x naive)", tallies)


if __name__ == "__main__":
    main()
