"""The ``hybrid`` method (MTP drafts, then ngram continues them) on the real default model:
greedy output equal to naive token for token, alone and batched with continuous batching;
FastDeploy's spelling selects it; the lookup really continues the model's drafts."""

from __future__ import annotations

import pytest

from specdec import SamplingParams
from specdec.workloads import code_edit_prompts

from mtp_drafts import count_mtp_catch_ups, record_mtp_drafts  # tests/mtp_drafts.py

pytestmark = pytest.mark.slow

PROMPTS = tuple(code_edit_prompts(5))
SAMPLING = SamplingParams(max_tokens=64, ignore_eos=True)
#: As FastDeploy writes it.
SEED_SPEC = {"method": "mtp", "mtp_strategy": "with_ngram", "num_model_steps": 2, "num_speculative_tokens": 5,
             "adaptive_draft_length": False}


def assert_equal_to_naive(model_session, spec, batch, label):
    naive = model_session.run(None, PROMPTS, SAMPLING, max_num_seqs=batch)
    outputs = model_session.run(spec, PROMPTS, SAMPLING, max_num_seqs=batch, cache=False)
    for prompt, got, want in zip(PROMPTS, outputs, naive):
        message = model_session.describe_divergence(prompt, want.token_ids, got.token_ids, label=label)
        assert message is None, message
    return outputs


@pytest.mark.parametrize("batch", [1, 3])
def test_hybrid_is_lossless_at_temperature_zero(model_session, batch):
    outputs = assert_equal_to_naive(model_session, SEED_SPEC, batch, "hybrid")
    assert model_session.llm.engine.spec.method == "hybrid"
    # Drafts longer than num_model_steps: ngram continued the model's drafts, and some of the
    # continued positions were accepted.
    per_position = [sum(o.metrics.accepted_per_position[i] for o in outputs
                        if len(o.metrics.accepted_per_position) > i) for i in range(5)]
    assert per_position[2] > 0, per_position
    assert all(o.metrics.num_draft_tokens <= 5 * o.metrics.num_steps for o in outputs)


def test_hybrid_with_lookup_first_is_lossless(model_session):
    spec = {**SEED_SPEC, "draft_lookup_first": 3}
    outputs = assert_equal_to_naive(model_session, spec, 3, "hybrid (lookup first)")
    assert model_session.llm.engine.proposer.config.draft_lookup_first == 3
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0


def test_a_lookup_led_step_skips_the_model_which_catches_up_later(model_session, monkeypatch):
    """Where the lookup leads, the model is not run for that request; its states wait and go
    with the next model-first step: the model's drafts are then those of a model run every step."""
    from specdec.plugins.mtp import MtpProposer

    def record(drafts_at: dict, seen: list):
        real = MtpProposer.propose

        def propose(self, batch):
            drafts = real(self, batch)
            seen.append(len(batch))
            for request, draft in zip(batch.requests, drafts.to_lists()):
                if draft:
                    drafts_at[(request.num_prompt_tokens, len(request.token_ids))] = draft
            return drafts

        monkeypatch.setattr(MtpProposer, "propose", propose)

    every_step, seen = {}, []
    record(every_step, seen)
    model_session.run({**SEED_SPEC, "draft_lookup_first": 0}, PROMPTS, SAMPLING, max_num_seqs=3, cache=False)
    lookup_first, seen = {}, []
    record(lookup_first, seen)
    outputs = assert_equal_to_naive(model_session, {**SEED_SPEC, "draft_lookup_first": 2}, 3, "hybrid (lookup first)")
    # the model saw a request in fewer than 80% of its steps: the lookup led the rest
    assert sum(seen) < 0.8 * sum(o.metrics.num_steps for o in outputs), "the lookup never led"
    both = set(every_step) & set(lookup_first)
    assert len(both) >= 10
    assert sum(every_step[key] == lookup_first[key] for key in both) >= 0.95 * len(both)
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0


def test_the_model_s_catch_up_at_the_end_of_a_step_drafts_what_it_drafts_in_propose(model_session, monkeypatch):
    """Where the model led a step without a lookup match, its catch-up starts at the end of the
    step (``CATCHES_UP_AFTER_STEP``, the model's ``catch_up``); elsewhere the states wait as
    before. The model's drafts, the tokens and the acceptance counts are those of the catch-up
    run inside ``propose``."""
    from specdec.plugin_manager import load_plugins
    from specdec.plugins.hybrid import HybridProposer

    class InProposeHybrid(HybridProposer):
        NAME = "test_hybrid_in_propose"
        ALSO_SELECTED_BY = ()

        def setup(self, context):
            super().setup(context)
            self._model_catches_up = False

    calls = count_mtp_catch_ups(monkeypatch)
    seen = record_mtp_drafts(monkeypatch)
    plugins = load_plugins()
    plugins.proposers.register(InProposeHybrid, "tests/e2e/test_hybrid.py")
    monkeypatch.setattr(model_session.llm.engine, "plugins", plugins)
    spec = {"num_model_steps": 2, "num_speculative_tokens": 5, "adaptive_draft_length": False,
            "draft_lookup_first": 2}
    runs, drafts = {}, {}
    try:
        for method in ("hybrid", "test_hybrid_in_propose"):
            seen.clear()
            runs[method] = model_session.run({"method": method, **spec}, PROMPTS, SAMPLING, max_num_seqs=3,
                                             cache=False)
            drafts[method] = dict(seen)
            if method == "hybrid":
                assert len(calls) > 10, len(calls)
                called = len(calls)
        assert len(calls) == called
    finally:
        model_session.llm.set_speculative_config(None)
    assert drafts["hybrid"] == drafts["test_hybrid_in_propose"]
    for a, b in zip(runs["hybrid"], runs["test_hybrid_in_propose"]):
        assert list(a.token_ids) == list(b.token_ids)
        assert a.metrics.num_accepted_tokens == b.metrics.num_accepted_tokens


def test_a_request_sharing_a_prompt_prefix_finds_the_model_s_rows_there(model_session, monkeypatch):
    """The prompts share their first blocks (the chat template's system prompt), which later
    requests take from the prefix cache, and the lookup leads many first steps: still, when a
    request's first states reach the model from past a shared prefix, the model's cache holds
    its rows in every shared block (the first request's prompt states never wait for a
    model-led step; the engine shares blocks only once their states are handed over). Before
    that, a request admitted while the first one's states waited attended over rows never
    written (uninitialized memory), and its drafts depended on which request the lookup led
    first and on what that memory held."""
    import numpy as np

    from specdec.plugins.mtp import MtpProposer

    starts = []
    real_setup, real_inputs = MtpProposer.setup, MtpProposer._catch_up_inputs

    def setup(self, context):  # every row the head has not written reads NaN
        real_setup(self, context)
        for layer in self.head.cache._caches:
            np.from_dlpack(layer)[...] = np.nan  # (paddle's fill_ refuses NaN)

    def catch_up_inputs(self, requests):
        for request in requests:
            first = int(request.hidden_positions[0])
            if first > 0 and self._next_position.get(request.request_id) != first:  # from past a cached prefix
                shared = [int(block) for block in request.block_table[: first // self.block_size]]
                rows = np.asarray(self.head.cache.export_blocks(shared)[0])
                starts.append([not np.isnan(rows[i]).any() for i in range(len(shared))])
        return real_inputs(self, requests)

    monkeypatch.setattr(MtpProposer, "setup", setup)
    monkeypatch.setattr(MtpProposer, "_catch_up_inputs", catch_up_inputs)
    spec = {**SEED_SPEC, "method": "hybrid", "draft_lookup_first": 2}
    outputs = model_session.run(spec, PROMPTS, SAMPLING, max_num_seqs=3, cache=False)
    assert len(starts) == len(PROMPTS) - 1, starts  # every prompt but the first shares a prefix
    assert all(all(blocks) and blocks for blocks in starts), starts
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0


def leader_stats(accepted_by_match: dict, steps: int = 20):
    """Leader statistics after ``steps`` steps in which a draft led by each matched length
    (0: the model) had ``accepted_by_match[length]`` tokens accepted."""
    from specdec.plugins.hybrid.leader import LeaderStats

    stats = LeaderStats()
    for _ in range(steps):
        stats.next_step()
        for matched, accepted in accepted_by_match.items():
            stats.record(LeaderStats.kind(matched), accepted)
    return stats


def test_by_default_the_lookup_leads_where_its_drafts_have_done_better():
    from specdec.plugins.hybrid.leader import RETRY_STEPS

    stats = leader_stats({0: 1, 4: 3, 1: 0})
    assert stats.lookup_leads(4)
    assert not stats.lookup_leads(1) and not stats.lookup_leads(0)
    for _ in range(RETRY_STEPS + 1):
        stats.next_step()
    assert stats.lookup_leads(1)  # not led for long: measured again


def test_hybrid_with_suffix_lookup_is_lossless(model_session):
    spec = {"method": "hybrid", "draft_lookup_method": "suffix", "num_model_steps": 1, "num_speculative_tokens": 4,
            "adaptive_draft_length": False}
    assert_equal_to_naive(model_session, spec, 5, "hybrid (mtp + suffix)")


@pytest.mark.parametrize("keys, message", [
    ({"draft_model_method": "nope"}, "speculative_config.method: proposer 'hybrid': method: unknown proposer 'nope'"),
    ({"draft_lookup_method": "hybrid"}, "speculative_config.method: proposer 'hybrid': draft_model_method and "
                                        "draft_lookup_method must name other methods"),
])
def test_a_bad_component_is_a_one_line_error_and_keeps_the_method(model_session, keys, message):
    import specdec

    llm = model_session.llm
    llm.set_speculative_config({"method": "ngram"})
    with pytest.raises(specdec.SpecdecError) as caught:
        llm.set_speculative_config({"method": "hybrid", **keys})
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)
    assert llm.engine.spec.method == "ngram"
    llm.set_speculative_config(None)


def test_the_model_s_cost_tips_the_lead_to_a_lookup_nearly_as_good():
    stats = leader_stats({0: 1, 2: 0.9})
    assert not stats.lookup_leads(2) and stats.lookup_leads(2, model_cost=0.2)


def test_a_continuation_never_accepted_stops_being_looked_up_and_is_measured_again():
    """Continuing the model's drafts with the lookup pays only where its tokens are accepted
    at least as often as the lookup call costs (in tokens of a step)."""
    from specdec.plugins.hybrid.leader import RETRY_STEPS, LeaderStats

    stats = LeaderStats()
    assert stats.continuation_pays(0.05)  # nothing measured: the prior continues
    for _ in range(20):
        stats.next_step()
        stats.record_continuation(0)
    assert not stats.continuation_pays(0.05)
    assert stats.continuation_pays(0.0)  # free: always worth it
    for _ in range(RETRY_STEPS + 1):
        stats.next_step()
    assert stats.continuation_pays(0.05)  # not continued for long: measured again
    for _ in range(5):
        stats.next_step()
        stats.record_continuation(2)
    assert stats.continuation_pays(0.05)


def test_a_context_match_that_goes_on_past_the_model_s_drafts_continues_them():
    from specdec.plugins.hybrid.proposer import _agreed_continuation

    assert _agreed_continuation([5, 6, 7, 8], [5]) == [6, 7, 8]
    assert _agreed_continuation([5, 6, 7, 8], [5, 6]) == [7, 8]
    assert _agreed_continuation([5, 6, 7], [4]) is None  # the model drafted something else
    assert _agreed_continuation([5], [5]) is None  # nothing after the model's drafts
    assert _agreed_continuation([], [5]) is None and _agreed_continuation([5, 6], []) is None


def test_the_lookup_s_context_request_lives_and_ends_with_the_request(model_session):
    """The lookup's request on the context alone is started once per request, extended each
    step, and finished with it: no index outlives its request."""
    outputs = assert_equal_to_naive(model_session, {**SEED_SPEC, "draft_lookup_first": None}, 3,
                                    "hybrid (context requests)")
    proposer = model_session.llm.engine.proposer
    lookup = proposer.lookup
    indexes = lookup._compiled if lookup._compiled is not None else lookup._indexes
    assert len(indexes) == 0 and not proposer._context_started
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0


def test_the_lookup_s_requests_carry_the_request_s_tenant():
    """A lookup that keeps other requests' text (``suffix``) keeps tenants apart by the
    request's tenant: both requests hybrid makes for it carry it."""
    import numpy as np

    from specdec.plugins.hybrid.proposer import HybridProposer, _context_request
    from specdec.sdk import ProposalRequest

    request = ProposalRequest("r", np.arange(12, dtype=np.int64), 8, 5, tenant="team-a")
    context, continued = _context_request(request), HybridProposer._lookup_request(request, [3])
    assert context.tenant == continued.tenant == "team-a"
    assert context.num_prompt_tokens == 8 and len(continued.token_ids) == 13


def test_the_model_is_skipped_where_its_drafts_cannot_pay_their_rows_and_measured_afresh():
    """In a large batch a verified row costs most of a token (``ProposalBatch.row_price``):
    model-first steps accepted less than that and the model's time skip the model; after a
    skip, its next measure replaces the old one, taken at another price."""
    from specdec.plugins.hybrid.leader import MODEL

    stats = leader_stats({0: 0.4})
    assert stats.model_pays(0.1) and not stats.model_pays(0.8)
    stats.next_step()
    stats.record(MODEL, 0)  # not skipped: folded into the mean
    assert 0.3 < stats.mean(MODEL) < 0.4
    stats.skip_model()
    stats.next_step()
    stats.record(MODEL, 2)
    assert stats.mean(MODEL) == 2.0


def test_a_row_dearer_than_the_model_s_drafts_leaves_the_lookup_alone(model_session, monkeypatch):
    """With every row priced above what the model's drafts are accepted, hybrid drafts as the
    lookup alone would (the model runs only for a retry now and then); still lossless."""
    from specdec.engine.controller import DraftController
    from specdec.plugins.mtp import MtpProposer

    asked = []
    real = MtpProposer.propose

    def propose(self, batch):
        asked.append(sum(r.max_draft_len > 0 for r in batch.requests))
        return real(self, batch)

    monkeypatch.setattr(MtpProposer, "propose", propose)
    monkeypatch.setattr(DraftController, "row_price", lambda self, rows, tokens: 5.0)
    outputs = assert_equal_to_naive(model_session, {"method": "hybrid"}, 3, "hybrid (model skipped)")
    steps = sum(o.metrics.num_steps for o in outputs)
    assert sum(asked) <= 3 + steps // 32, (sum(asked), steps)
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0
