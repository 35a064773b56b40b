"""The ``mtp`` head's cost per step at batch 1 on the default model: the proposer's ``propose``
(catch-up, drafts, logits) timed around each call, beside a naive step.

    python benchmarks/bench_mtp_head.py [--tokens 128] [--prompts 6] [--rounds 2] [--quantizations none,wint4]
                                        [--heads shipped,PATH] [--phases]

One process, one engine: request by request it alternates naive and ``{"method": "mtp"}`` with
each head (``shipped``: the one that ships for the default model; a path: a head of
``specdec train-mtp``) and each head ``quantization`` (``none``: float32 eager paddle ops;
``wint8``, ``wint4`` (the default): the quantized kernels, each also ``in propose``: its
catch-up inside ``propose`` rather than started at the end of the step before,
``CATCHES_UP_AFTER_STEP``), so that load from other processes on a shared machine falls on all
of them alike. Prints per configuration the median engine step, the median and mean time of
the proposer on the engine's thread per step (``propose``, and the ``catch_up`` of the step
before), the acceptance rate, and checks every output equals naive's (greedy, lossless).
``--phases`` adds, per quantized head, the median time of each part: the input call (embedding
rows, both projections, the layer's q/k/v), the cache layer's ``prepare`` and attention, the
layer's output with the LM head (or, on the fast path, the one native call that does all
three; or its start on the kernels' worker, and the wait for what is left of it), and the rest
(the proposer's Python, metadata, the argmax).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import specdec
from specdec import SamplingParams
from specdec.bench.results import machine_description
from specdec.workloads import chat_prompts, code_edit_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=6, help="chat prompts and code edits, two thirds chat")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quantizations", default="none,wint4")
    parser.add_argument("--heads", default="shipped", help="comma-separated: shipped, or paths of heads")
    parser.add_argument("--phases", action="store_true", help="time the parts of each propose call")
    args = parser.parse_args()

    configs = {"naive": None}
    heads = args.heads.split(",")
    for head in heads:
        for quantization in args.quantizations.split(","):
            label = f"mtp {quantization}" if len(heads) == 1 else f"mtp {quantization} {head}"
            configs[label] = {"method": "mtp", "adaptive_draft_length": False, "quantization": quantization,
                              **({} if head == "shipped" else {"model": head})}
            if quantization != "none":  # the catch-up inside propose, as before CATCHES_UP_AFTER_STEP
                configs[f"{label} in propose"] = {**configs[label], IN_PROPOSE: True}
    llm = specdec.LLM(progress=False)
    engine = llm.engine
    engine.scheduler.max_num_seqs = 1
    sampling = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    chat = args.prompts - args.prompts // 3
    prompts = chat_prompts(chat) + code_edit_prompts(args.prompts - chat)
    steps = {name: [] for name in configs}
    proposes = {name: [] for name in configs}
    phases = {name: {} for name in configs}  # name -> phase -> [seconds per propose call]
    in_call: dict[str, float] = {}
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
                llm.set_speculative_config(None if spec is None else {k: v for k, v in spec.items() if k != IN_PROPOSE})
                if spec is not None:
                    proposer = engine.proposer
                    if spec.get(IN_PROPOSE):
                        proposer.CATCHES_UP_AFTER_STEP = False
                    propose, catch_up = proposer.propose, proposer.catch_up
                    if args.phases:
                        time_phases(proposer.head, in_call)
                    in_call.clear()

                    def timed_catch_up(batch, catch_up=catch_up):
                        start, started = time.perf_counter(), in_call.get(START, 0.0)
                        try:
                            return catch_up(batch)
                        finally:  # (its start is a phase of its own)
                            in_call[CATCH_UP] = (in_call.get(CATCH_UP, 0.0) + time.perf_counter() - start
                                                 - (in_call.get(START, 0.0) - started))

                    def timed_propose(batch, propose=propose, name=name):
                        start = time.perf_counter()
                        result = propose(batch)
                        # the step's whole proposer time: this call and the catch-up at the end of
                        # the step before (CATCHES_UP_AFTER_STEP)
                        proposes[name].append(time.perf_counter() - start + in_call.get(CATCH_UP, 0.0)
                                              + in_call.get(START, 0.0))
                        if args.phases:
                            for label in PHASE_LABELS:
                                phases[name].setdefault(label, []).append(in_call.get(label, 0.0))
                        in_call.clear()
                        return result

                    proposer.propose, proposer.catch_up = timed_propose, timed_catch_up
                current[0] = name
                outputs[name] += llm.generate([prompt], sampling)
    print(machine_description())
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
    if args.phases:
        print_phases(configs, proposes, phases)


#: The head's parts timed by --phases: (label, object path from the head, method). The fast
#: path (``head.fused``, a QuantizedDraftHead) runs the first, third and fourth in one native
#: call, timed as the fifth. With the catch-up at the end of the step (``CATCHES_UP_AFTER_STEP``)
#: it starts that work on the kernels' worker instead (``start``, its ``prepare`` included) and
#: waits for what is left of it in the next ``propose`` (``result``).
PHASES = (("input: embedding, projections, q/k/v", "input", "__call__"),
          ("cache layer prepare", "cache", "prepare"),
          ("attention", "cache", "forward"),
          ("layer output + LM head", "layer", "output"),
          ("one native call: all but prepare", "fused._ops", "specdec_q_draft_head"))
START, WAIT = "start on the worker (prepare included)", "waiting for it in propose"
#: The key of a step's ``catch_up`` time, and the config key of the variant without it.
CATCH_UP = "the rest of catch_up at the end of the step before"
IN_PROPOSE = "_in_propose"
PHASE_LABELS = [label for label, _, _ in PHASES] + [START, WAIT, CATCH_UP]


def time_phases(head, in_call: dict) -> None:
    """Wrap the head's native calls so that each adds its time to ``in_call`` (once per head)."""
    if head.layer is None or getattr(head, "_phases_timed", False):
        return  # the float path has no such calls
    head._phases_timed = True
    for label, owner, method in PHASES:
        parent, _, name = owner.rpartition(".")
        holder = getattr(head, parent) if parent else head
        if holder is None:  # no fused call
            continue
        target = getattr(holder, name)
        original = getattr(target, method)

        def timed(*a, original=original, label=label, **k):
            if in_call.get("_in_start"):  # a part of start, counted there
                return original(*a, **k)
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                in_call[label] = in_call.get(label, 0.0) + time.perf_counter() - start

        if method == "__call__":  # a call of the instance itself: wrap it through the head
            head.input = _Called(target, timed)
        elif name == "_ops":  # a kernels module: wrap the one operator
            setattr(holder, name, _Called(target, None, {method: timed}))
        else:
            setattr(target, method, timed)
    if getattr(head, "fused", None) is not None:
        started = head.start

        def start(*a, **k):
            in_call["_in_start"] = True
            begun = time.perf_counter()
            try:
                pending = started(*a, **k)
            finally:
                in_call[START] = in_call.get(START, 0.0) + time.perf_counter() - begun
                in_call["_in_start"] = False
            result = pending.result

            def waited():
                begun = time.perf_counter()
                try:
                    return result()
                finally:
                    in_call[WAIT] = in_call.get(WAIT, 0.0) + time.perf_counter() - begun

            pending.result = waited
            return pending

        head.start = start


class _Called:
    """An object whose call goes through ``timed``, and whose attributes named in ``replaced``
    are those (the others the wrapped one's)."""

    def __init__(self, wrapped, timed, replaced=None):
        self._wrapped, self._timed, self._replaced = wrapped, timed, replaced or {}

    def __call__(self, *a, **k):
        return self._timed(*a, **k)

    def __getattr__(self, name):
        return self._replaced[name] if name in self._replaced else getattr(self._wrapped, name)


def print_phases(configs, proposes, phases) -> None:
    """Median ms of each phase per step, and of the rest (the proposer's time minus the phases)."""
    names = [name for name in configs if phases[name]]
    width = max(14, *(len(n) + 2 for n in names))
    print("\nphase (median ms per step)".ljust(52) + "".join(f"{n:>{width}s}" for n in names))
    for label in PHASE_LABELS:
        print(f"{label:52s}" + "".join(f"{np.median(phases[n][label]) * 1e3:{width}.3f}" for n in names))
    rest = {n: np.array(proposes[n]) - sum(np.array(phases[n][label]) for label in PHASE_LABELS) for n in names}
    print(f"{'the rest of propose (Python, metadata, argmax)':52s}"
          + "".join(f"{np.median(rest[n]) * 1e3:{width}.3f}" for n in names))
    print(f"{'the proposer on the caller thread, per step':52s}"
          + "".join(f"{np.median(proposes[n]) * 1e3:{width}.3f}" for n in names))


if __name__ == "__main__":
    main()
