"""``specdec demo``, the main job of ``make run``: every built-in method against plain decoding.

Generates from one code-edit prompt on the default model with plain decoding (``naive``) and
with each built-in method (or the one ``--speculative-config`` names), checks they gave the
same tokens (greedy decoding is lossless), and prints the text and a table of tokens/s,
decode speedup and mean acceptance length.
"""

from __future__ import annotations

import sys

from .config import EngineConfig
from .workloads import code_edit_prompts


def _run(llm, prompt, sampling):
    llm.generate(prompt, sampling, use_chat_template=True)  # warm-up: first-call allocations
    llm.reset_prefix_cache()  # the timed run prefills its prompt itself, as a fresh request would
    return llm.generate(prompt, sampling, use_chat_template=True)[0]


def _rate(output) -> float:
    return output.num_generated_tokens / output.elapsed_s if output.elapsed_s else 0.0


#: The built-in methods the demo compares with plain decoding when no speculative config is given.
DEMO_METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 5},
    "mtp": {"method": "mtp"},
    # The seed system's spelling of hybrid: MTP drafts 2 tokens, ngram continues them.
    "hybrid": {"method": "mtp", "mtp_strategy": "with_ngram", "num_model_steps": 2, "num_speculative_tokens": 5},
}


def run_demo(config: EngineConfig, plugins, max_tokens: int = 128, progress: bool = True) -> int:
    """Run the demo on the engine ``config`` describes: its speculative method against naive,
    or, when it is ``naive``, every method of :data:`DEMO_METHODS`; print the output and a
    table; return the exit status."""
    from .api import LLM
    from .errors import SpecdecError
    from .sampling import SamplingParams

    llm = LLM(config=config, plugins=plugins, progress=progress)
    prompt = code_edit_prompts(1)[0]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    methods = {"naive": {"method": "naive"}}
    if config.speculative.method == "naive":
        methods.update(DEMO_METHODS)
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
    print("tokens/s: end to end (prefill included); decode tok/s and speedup: after the first token")
    if any(output.token_ids != plain.token_ids for output in results.values()):
        print("warning: a method produced other tokens than naive (see docs/verify.md on near-ties)", file=sys.stderr)
    return 0
