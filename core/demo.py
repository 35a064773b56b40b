"""``specdec demo``, the main job of ``make run``: ngram speculation vs plain decoding.

Generates from one code-edit prompt on the default model twice, plain (``naive``) and with
ngram speculation, checks both gave the same tokens (greedy decoding is lossless), and prints the
text with tokens/s, mean acceptance length, acceptance rate and the speedup.
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


#: What the demo compares with plain decoding when no speculative config is given.
DEMO_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 5}


def run_demo(config: EngineConfig, plugins, max_tokens: int = 128, progress: bool = True) -> int:
    """Run the demo on the engine ``config`` describes (its speculative config against naive);
    print the comparison; return the exit status."""
    from .api import LLM
    from .sampling import SamplingParams

    llm = LLM(config=config, plugins=plugins, progress=progress)
    prompt = code_edit_prompts(1)[0]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    speculative = _run(llm, prompt, sampling)
    llm.set_speculative_config({"method": "naive"})
    plain = _run(llm, prompt, sampling)

    print(f"prompt:\n{prompt}\n")
    print(f"output ({config.speculative.method}):\n{speculative.text}\n")
    m = speculative.metrics
    print(f"{'':24}{'naive':>12}{config.speculative.method:>12}")
    print(f"{'tokens generated':24}{plain.num_generated_tokens:>12}{speculative.num_generated_tokens:>12}")
    print(f"{'tokens/s':24}{_rate(plain):>12.1f}{_rate(speculative):>12.1f}   (prefill included)")
    print(f"{'decode tokens/s':24}{plain.decode_tokens_per_s:>12.1f}{speculative.decode_tokens_per_s:>12.1f}"
          "   (after the first token)")
    print(f"{'mean acceptance length':24}{plain.metrics.mean_acceptance_length:>12.2f}{m.mean_acceptance_length:>12.2f}")
    print(f"{'acceptance rate':24}{'-':>12}{m.acceptance_rate:>12.2f}")
    speedup = _rate(speculative) / _rate(plain) if _rate(plain) else 0.0
    decode = plain.decode_tokens_per_s
    decode_speedup = speculative.decode_tokens_per_s / decode if decode else 0.0
    print(f"speedup over naive: {speedup:.2f}x end to end, {decode_speedup:.2f}x decoding")
    if plain.token_ids != speculative.token_ids:
        print("warning: the two runs produced different tokens (see docs/verify.md on near-ties)", file=sys.stderr)
    return 0
