"""The drafting controller on the real default model: a proposer that only wastes time is
left out of nearly every step, and switching a request's proposer off and on mid-request
changes no token; a model proposer catches up over the steps it skipped and then drafts what
it would have drafted had it run every step."""

from __future__ import annotations

import time

import numpy as np
import pytest

import specdec
from specdec import SamplingParams
from specdec.engine.controller import DraftController
from specdec.engine.row_costs import ROW_COUNTS, measure_row_curve
from specdec.plugin_manager import load_plugins
from specdec.plugins.mtp import MtpProposer
from specdec.workloads import chat_prompts, code_edit_prompts

from mtp_drafts import record_mtp_drafts  # tests/mtp_drafts.py

pytestmark = pytest.mark.slow

PROMPTS = (*code_edit_prompts(2), *chat_prompts(1))
SAMPLING = SamplingParams(max_tokens=48, ignore_eos=True)


class SlowGarbage(specdec.Proposer):
    """Sleeps 20 ms per call (two naive steps of the default model) and drafts random tokens."""

    NAME = "test_slow_garbage"
    calls = 0

    def propose(self, batch: specdec.ProposalBatch) -> specdec.Drafts:
        type(self).calls += 1
        time.sleep(0.02)
        rng = np.random.default_rng(type(self).calls)
        return specdec.Drafts.from_lists([rng.integers(0, 49152, r.max_draft_len).tolist() for r in batch.requests])


def test_a_proposer_that_only_wastes_time_is_left_out_once_seen(model_session, monkeypatch):
    plugins = load_plugins()
    plugins.proposers.register(SlowGarbage, "tests/e2e/test_draft_controller.py")
    monkeypatch.setattr(model_session.llm.engine, "plugins", plugins)
    naive = model_session.run(None, PROMPTS, SAMPLING)
    try:
        first = model_session.run({"method": SlowGarbage.NAME}, PROMPTS[:1], SAMPLING, cache=False)
        calls_before = SlowGarbage.calls
        seen = model_session.run({"method": SlowGarbage.NAME}, PROMPTS[1:], SAMPLING, cache=False,
                                 fresh_controller=False)
    finally:
        model_session.llm.set_speculative_config(None)
    assert [o.token_ids for o in first + seen] == [o.token_ids for o in naive]
    assert first[0].metrics.num_proposer_off_steps >= 0.6 * first[0].metrics.num_steps
    # Seen before, it starts off and is probed after 8, 16, 32 steps at most: 48 tokens, 2 requests.
    steps = sum(o.metrics.num_steps for o in seen)
    assert SlowGarbage.calls - calls_before <= 6
    assert sum(o.metrics.num_proposer_off_steps for o in seen) >= steps - 6


def off_now_and_then(monkeypatch, period: int = 5) -> None:
    """Leave every request out of the proposer for ``period`` steps in every ``2 * period``
    (what the controller does to a request whose drafts stop paying), whatever it measures:
    in the other steps every request is proposed for, even where its first draft would not
    pay for its row and the call (which leaves it out of a step too)."""
    real = DraftController.proposing
    steps = iter(range(10 ** 9))

    def proposing(self, request_ids, always, max_draft_lens, unseen_tokens=None, without_proposer=None):
        self._requests.clear()  # its own judgement does not carry into the next step
        real(self, request_ids, always, max_draft_lens, unseen_tokens, without_proposer)
        return np.full(len(request_ids), (next(steps) // period) % 2 == 0)

    monkeypatch.setattr(DraftController, "proposing", proposing)
    monkeypatch.setattr(DraftController, "_first_draft_bar", lambda self, base_rows, base_tokens: -1.0)


@pytest.mark.parametrize("method", ["mtp", "hybrid", "ngram", "suffix"])
def test_switching_the_proposer_off_and_on_mid_request_changes_no_token(model_session, monkeypatch, method):
    naive = model_session.run(None, PROMPTS, SAMPLING, max_num_seqs=3)
    off_now_and_then(monkeypatch)
    outputs = model_session.run({"method": method}, PROMPTS, SAMPLING, max_num_seqs=3, cache=False)
    for output, reference in zip(outputs, naive):
        assert output.token_ids == reference.token_ids
        assert 0 < output.metrics.num_proposer_off_steps < output.metrics.num_steps


def test_mtp_catches_up_over_skipped_steps_to_the_drafts_it_would_have_made(model_session, monkeypatch):
    """The head's cache rows for the skipped positions are computed in one call when the
    request is proposed for again: its drafts then are those of a head that ran every step."""
    spec = {"method": "mtp", "num_model_steps": 2, "num_speculative_tokens": 2}
    every_step = record_mtp_drafts(monkeypatch)
    model_session.run(spec | {"adaptive_draft_length": False}, PROMPTS, SAMPLING, max_num_seqs=3, cache=False)
    monkeypatch.undo()
    after_gaps = record_mtp_drafts(monkeypatch)
    off_now_and_then(monkeypatch, period=4)
    model_session.run(spec, PROMPTS, SAMPLING, max_num_seqs=3, cache=False)
    both = sorted(set(every_step) & set(after_gaps))
    assert len(both) >= 10, "too few positions drafted in both runs to compare"
    # The controller may ask for fewer drafts than the head makes without it (drafts_to_ask)
    same = sum(every_step[key][: len(after_gaps[key])] == after_gaps[key] for key in both)
    assert same >= 0.95 * len(both), f"{same} of {len(both)} drafts equal"


class SlowFirstCall(specdec.Proposer):
    """Takes 0.2 s at a request's first call (a model proposer running its prompt) and no time
    after; drafts nothing."""

    NAME = "test_slow_first_call"

    def __init__(self, config=None, spec_config=None):
        super().__init__(config, spec_config)
        self.seen: set[str] = set()

    def propose(self, batch: specdec.ProposalBatch) -> specdec.Drafts:
        if any(r.request_id not in self.seen for r in batch.requests):
            time.sleep(0.2)
        self.seen.update(r.request_id for r in batch.requests)
        return specdec.Drafts.empty(len(batch))


def test_a_catch_up_call_does_not_teach_the_controller_what_a_step_costs(model_session, monkeypatch):
    """A request's first proposal carries one-time work (a draft model's pass over the prompt):
    the controller learns the proposer's time from the calls after it, so one slow first call
    neither switches a cheap proposer off nor leaves its estimate high."""
    plugins = load_plugins()
    plugins.proposers.register(SlowFirstCall, "tests/e2e/test_draft_controller.py")
    monkeypatch.setattr(model_session.llm.engine, "plugins", plugins)
    try:
        [output] = model_session.run({"method": SlowFirstCall.NAME}, PROMPTS[:1], SAMPLING, cache=False)
        learned = model_session.llm.engine.controller.proposer_seconds
    finally:
        model_session.llm.set_speculative_config(None)
    assert learned is not None and learned < 0.02, learned
    assert output.metrics.num_proposer_off_steps == 0


def test_a_request_left_out_is_not_caught_up_once_it_has_no_room_to_draft(model_session, monkeypatch):
    """A model proposer keeps up with a request it drafts for, a row or two a step, even at
    its last step (no room for a draft). One the controller left out (its proposer on, its
    first draft not worth its row) is not handed every row it missed at that step: the
    catch-up would buy no draft, the request ends there."""
    calls = iter(range(10 ** 9))
    monkeypatch.setattr(DraftController, "_first_draft_bar",  # worth it for a few steps, then not
                        lambda self, rows, tokens: -1.0 if next(calls) < 3 else 2.0)
    handed: list[tuple[int, int]] = []  # (rows handed over, drafts it may make) per request and call
    real_propose = MtpProposer.propose

    def propose(self, batch):
        handed.extend((len(r.hidden_positions), r.max_draft_len) for r in batch.requests)
        return real_propose(self, batch)

    monkeypatch.setattr(MtpProposer, "propose", propose)
    [output] = model_session.run({"method": "mtp"}, PROMPTS[:1], SAMPLING, cache=False)
    assert output.metrics.num_proposer_off_steps >= output.metrics.num_steps - 16
    # Probes catch up over the steps they missed, to draft; without room to draft, nothing
    # but the row or two of a step the proposer ran in.
    assert all(rows <= 6 for rows, room in handed if room == 0), handed


def test_the_engine_measures_what_a_verify_row_costs_on_this_machine(llm):
    """The row curve the controller prices rows by at batch 1: the real model's passes at 1 to
    4 rows, measured once per engine over blocks it gives back."""
    engine = llm.engine
    llm.set_speculative_config({"method": "ngram"})
    assert engine.controller.step_costs.row_curve is engine._measured_row_curve is not None
    free = engine.kv.pool.num_free
    curve = measure_row_curve(engine.model, engine.kv.pool, engine.block_size, engine.model_config.vocab_size,
                              engine.max_model_len)
    assert engine.kv.pool.num_free == free
    assert sorted(curve) == list(ROW_COUNTS) and curve[1] == 1.0
    ratios = [curve[rows] for rows in ROW_COUNTS]
    assert ratios == sorted(ratios) and ratios[-1] < ROW_COUNTS[-1]  # rows share one read of the weights
    llm.set_speculative_config({"method": "ngram", "adaptive_draft_length": False})
    engine.reset_controller()
    assert engine.controller.step_costs.row_curve is None  # nothing to price
    llm.set_speculative_config({"method": "ngram"})
    engine.reset_controller()  # as the other tests expect it
