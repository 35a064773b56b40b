"""``specdec demo``, the main job of ``make run``: every method that shows itself, against plain decoding.

Generates from one code-edit prompt on the default model with plain decoding (``naive``) and
with each method that declares how it is shown (``Proposer.DEMO_CONFIG``; or the one
``--speculative-config`` names), checks they gave the
same tokens (greedy decoding is lossless), and prints the text and a table of tokens/s,
decode speedup and mean acceptance length, and a line for each method the drafting
controller kept off for most of the prompt (its drafts did not pay there).
"""

from __future__ import annotations

import sys

from .config import EngineConfig
from .errors import SpecdecError
from .workloads import code_edit_prompts


def _run(llm, prompt, sampling):
    llm.generate(prompt, sampling, use_chat_template=True)  # warm-up: first-call allocations
    llm.reset_prefix_cache()  # the timed run prefills its prompt itself, as a fresh request would
    return llm.generate(prompt, sampling, use_chat_template=True)[0]


def _rate(output) -> float:
    return output.num_generated_tokens / output.elapsed_s if output.elapsed_s else 0.0


def demo_methods(plugins) -> dict:
    """The speculative configs of the methods that declare a ``DEMO_CONFIG``, by method name."""
    methods = {}
    for name in plugins.proposers.names():
        try:
            demo = plugins.proposers.get(name).DEMO_CONFIG
        except SpecdecError:  # a name two plugins registered: not shown
            continue
        if demo is not None:
            methods[name] = {"method": name, **demo}
    return methods


def controller_line(name: str, metrics) -> str:
    """One line when the drafting controller kept ``name``'s proposer off for most of a run
    (its drafts did not pay on this prompt), else ''."""
    off, steps = metrics.num_proposer_off_steps, metrics.num_steps
    if not steps or off < steps / 2:
        return ""
    return (f"{name}: switched off by the controller on this prompt ({off} of {steps} steps decoded plainly: "
            f"its drafts did not pay for their time)")


def run_demo(config: EngineConfig, plugins, max_tokens: int = 128, progress: bool = True) -> int:
    """Run the demo on the engine ``config`` describes: its speculative method against naive,
    or, when it is ``naive``, every method that declares a ``DEMO_CONFIG``; print the output
    and a table; return the exit status."""
    from .api import LLM
    from .sampling import SamplingParams

    llm = LLM(config=config, plugins=plugins, progress=progress)
    prompt = code_edit_prompts(1)[0]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    methods = {"naive": {"method": "naive"}}
    if config.speculative.method == "naive":
        methods.update(demo_methods(plugins))
    else:
        methods[config.speculative.method] = config.speculative
    results, unavailable = {}, {}
    for name, spec in methods.items():
        try:
            llm.set_speculative_config(spec)
        except SpecdecError as exc:  # e.g. mtp for a target no head ships for
            unavailable[name] = str(exc)
            continue
        results[name] = _run(llm, prompt, sampling)

    shown = next((name for name in results if name != "naive"), "naive")
    print(f"prompt:\n{prompt}\n")
    print(f"output ({shown}):\n{results[shown].text}\n")
    plain = results["naive"]
    header = f"{'method':<10}{'tokens':>8}{'tokens/s':>10}{'decode tok/s':>14}{'speedup':>9}{'accept len':>12}{'same':>6}"
    print(header)
    print("-" * len(header))
    for name, output in results.items():
        decode = plain.decode_tokens_per_s
        speedup = output.decode_tokens_per_s / decode if decode else 0.0
        same = "yes" if output.token_ids == plain.token_ids else "NO"
        print(f"{name:<10}{output.num_generated_tokens:>8}{_rate(output):>10.1f}{output.decode_tokens_per_s:>14.1f}"
              f"{speedup:>8.2f}x{output.metrics.mean_acceptance_length:>12.2f}{same:>6}")
    for name, reason in unavailable.items():
        print(f"{name:<10}unavailable: {reason}")
    for name, output in results.items():
        line = controller_line(name, output.metrics)
        if line:
            print(line)
    print("tokens/s: end to end (prefill included); decode tok/s and speedup: after the first token")
    if any(output.token_ids != plain.token_ids for output in results.values()):
        print("warning: a method produced other tokens than naive (see docs/verify.md on near-ties)", file=sys.stderr)
    return 0
