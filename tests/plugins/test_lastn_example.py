"""The example third-party package examples/specdec-plugin-lastn, installed as users install it."""

from __future__ import annotations

from importlib import metadata

import numpy as np
import pytest

import specdec
from specdec.plugin_manager import load_plugins
from specdec.testing import check_proposer

PIP_COMMAND = "pip install -e examples/specdec-plugin-lastn"


def lastn_module():
    try:
        import specdec_plugin_lastn
    except ImportError:
        pytest.fail(f"the example plugin is not installed; run: {PIP_COMMAND}")
    return specdec_plugin_lastn


def test_lastn_is_registered_when_installed(monkeypatch):
    monkeypatch.delenv("SPECDEC_LOAD_PLUGINS", raising=False)
    try:
        version = metadata.version("specdec-plugin-lastn")
    except metadata.PackageNotFoundError:
        pytest.fail(f"specdec-plugin-lastn is not installed; run: {PIP_COMMAND}")
    plugins = load_plugins()
    assert "lastn" in plugins.proposers, f"lastn not registered: {plugins.errors}"
    info = next(info for info in plugins.infos if info.name == "lastn")
    assert (info.distribution, info.version, info.builtin, info.error) == ("specdec-plugin-lastn", version, False, None)
    assert info.registered["proposers"] == ["lastn"]
    assert plugins.proposers.get("lastn") is lastn_module().LastNProposer


def test_lastn_passes_the_conformance_kit():
    module = lastn_module()
    check_proposer(module.LastNProposer)
    check_proposer(module.LastNProposer, config=module.LastNConfig(lastn_lookback=3))


def draft(tokens, max_draft_len, **config):
    module = lastn_module()
    proposer = module.LastNProposer(module.LastNConfig(**config))
    request = specdec.ProposalRequest(request_id="r", token_ids=np.array(tokens, dtype=np.int64),
                                      num_prompt_tokens=len(tokens), max_draft_len=max_draft_len)
    return proposer.propose(specdec.ProposalBatch(requests=[request])).to_lists()[0]


def test_lastn_drafts_the_continuation_of_the_previous_occurrence():
    assert draft([5, 1, 2, 3, 9, 9, 5], 3) == [1, 2, 3]
    assert draft([5, 1, 2, 3, 9, 5, 7, 5], 3) == [7, 5, 7]  # the most recent occurrence wins


def test_lastn_extends_a_repetition_loop_periodically():
    assert draft([8, 1, 2, 3, 1, 2, 3, 1], 7) == [2, 3, 1, 2, 3, 1, 2]
    assert draft([4, 4], 3) == [4, 4, 4]


def test_lastn_drafts_nothing_without_a_previous_occurrence_or_budget():
    assert draft([1, 2, 3], 4) == []
    assert draft([7], 4) == []
    assert draft([1, 2, 1], 0) == []


def test_lastn_lookback_limits_the_search():
    tokens = [5, 1, 2] + [9] * 10 + [6, 5]
    assert draft(tokens, 2) == [1, 2]
    assert draft(tokens, 2, lastn_lookback=5) == []
    assert draft(tokens, 2, lastn_lookback=0) == [1, 2]  # 0 searches everything


def test_lastn_config_validates():
    with pytest.raises(ValueError, match="lastn_lookback must be >= 0"):
        lastn_module().LastNConfig(lastn_lookback=-1)
