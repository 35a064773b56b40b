"""The MTP head shipped for the default model: ``{"method": "mtp"}`` works out of the box, and
its first-position acceptance on held-out prompts (the benchmark's code-edit prompts and plain
chat prompts, none of them in its training data) holds the figure docs/methods.md documents."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specdec import SamplingParams
from specdec.workloads import chat_prompts, code_edit_prompts

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[2] / "docs" / "methods.md"
PROMPTS = tuple(code_edit_prompts(6)) + tuple(chat_prompts(6))
MARGIN = 0.05


def documented_acceptance() -> float:
    """The figure in docs/methods.md: "first-position acceptance on the held-out set: NN%"."""
    match = re.search(r"first-position acceptance on the held-out set: (\d+(?:\.\d+)?)%", DOCS.read_text())
    assert match, "docs/methods.md documents no held-out first-position acceptance"
    return float(match.group(1)) / 100


def test_shipped_head_holds_its_documented_acceptance(model_session):
    sampling = SamplingParams(max_tokens=64)
    naive = model_session.run(None, PROMPTS, sampling, max_num_seqs=12)
    outputs = model_session.run({"method": "mtp", "adaptive_draft_length": False}, PROMPTS, sampling,
                                max_num_seqs=12, cache=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in naive]
    drafts = sum(o.metrics.num_drafts for o in outputs)
    first = sum(o.metrics.accepted_per_position[0] for o in outputs if o.metrics.accepted_per_position)
    assert drafts > 300
    assert first / drafts >= documented_acceptance() - MARGIN, (first / drafts, documented_acceptance())
