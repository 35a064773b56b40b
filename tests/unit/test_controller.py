"""The drafting controller (core/engine/controller.py): it weighs what a request's drafts
earn against the rows they cost and the proposer's own time, switches the proposer off where
drafting loses, and probes now and then to re-learn."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from specdec.engine.controller import MIN_LOSS, PROBE_INTERVAL_MAX, PROBE_INTERVAL_MIN, DraftController

#: A measured plain step: 10 ms fixed, 1 ms per row.
FIXED, PER_ROW = 0.010, 0.001


def measured_controller() -> DraftController:
    controller = DraftController()
    for rows in (1, 2, 4, 6) * 4:
        controller.step_time(rows, FIXED + PER_ROW * rows)
    return controller


def run_steps(controller: DraftController, steps: int, proposer_seconds: float, accept, k: int = 4,
              request_id: str = "r", always: bool = False, seconds: list | None = None) -> list[bool]:
    """``steps`` engine steps of one request whose proposer takes ``proposer_seconds`` and
    drafts ``k`` tokens of which ``accept(drafted)`` are accepted; returns whether it was
    proposed for, step by step (and appends each step's seconds to ``seconds``)."""
    proposed_steps = []
    for _ in range(steps):
        proposed = controller.proposing([request_id], np.array([always]), np.array([k]))
        lengths = np.array([k if proposed[0] else 0])
        if proposed[0]:
            controller.proposer_time(1, proposer_seconds)
        verified = controller.draft_lengths([request_id], lengths, None, 1, 1)
        accepted = np.array([min(accept(int(verified[0])), int(verified[0]))])
        controller.record([request_id], proposed, None, verified, accepted)
        step_seconds = FIXED + PER_ROW * (1 + int(verified[0]))
        controller.step_time(1 + int(verified[0]), step_seconds)
        if seconds is not None:
            seconds.append(step_seconds + (proposer_seconds if proposed[0] else 0.0))
        proposed_steps.append(bool(proposed[0]))
    return proposed_steps


def test_a_proposer_that_only_wastes_time_is_called_once_in_many_steps():
    controller = measured_controller()
    seconds = []
    calls = run_steps(controller, 1000, proposer_seconds=0.020, accept=lambda drafted: 0, seconds=seconds)
    assert calls[0] and not calls[1]  # one step shows it loses
    gaps = np.diff(np.flatnonzero(calls))
    # Its 20 ms call makes a probe dearer than the budget's cap: each waits until 3% of the
    # engine's time has paid for it (beyond the longest interval).
    assert gaps[0] > PROBE_INTERVAL_MIN and (gaps[1:] > PROBE_INTERVAL_MAX).all()
    # Once seen, it costs at most 3% over plain decoding (a plain step: FIXED + PER_ROW).
    plain = len(seconds[200:]) * (FIXED + PER_ROW)
    assert sum(seconds[200:]) <= 1.03 * plain
    # A new request of the same method starts off: the method's record says drafting loses.
    assert controller.shared_net < -MIN_LOSS
    assert not controller.proposing(["new"], np.array([False]), np.array([4]))[0]


def test_probes_of_a_cheap_call_back_off_by_doubling_the_interval():
    controller = measured_controller()
    calls = run_steps(controller, 1000, proposer_seconds=0.005, accept=lambda drafted: 0)
    gaps = np.diff(np.flatnonzero(calls))
    assert gaps[0] == PROBE_INTERVAL_MIN + 1 and (np.diff(gaps) >= 0).all()
    assert gaps[-1] == PROBE_INTERVAL_MAX + 1


def test_a_proposer_whose_drafts_pay_stays_on():
    controller = measured_controller()
    calls = run_steps(controller, 100, proposer_seconds=0.002, accept=lambda drafted: drafted)
    assert all(calls)
    assert controller.shared_net > 1.0


def test_a_cheap_proposer_stays_on_while_it_finds_nothing_or_is_wrong():
    """A lookup proposer's call costs a tenth of a millisecond: switching it off would only
    miss the next match. The rows of its wrong drafts are the adaptive length's to cut."""
    controller = measured_controller()
    assert all(run_steps(controller, 100, proposer_seconds=0.0001, accept=lambda drafted: 0, k=0))
    assert all(run_steps(controller, 100, proposer_seconds=0.0001, accept=lambda drafted: 0, k=4))
    assert controller.shared_net < 0  # its verified drafts lost, yet it stays on
    assert controller.proposing(["new"], np.array([False]), np.array([4]))[0]


def test_a_proposer_that_starts_to_pay_is_switched_back_on_by_a_probe():
    controller = measured_controller()
    assert sum(run_steps(controller, 40, proposer_seconds=0.020, accept=lambda drafted: 0)) < 10
    # Now it is fast and right: the next probe switches it on for good.
    calls = run_steps(controller, 200, proposer_seconds=0.001, accept=lambda drafted: drafted)
    first = calls.index(True)  # when the probe budget (3% of the time) has paid for the slow calls
    assert first <= 150 and all(calls[first:])


def test_a_probe_verifies_every_draft_the_policy_would_cut():
    """A class of drafts the adaptive length cuts whole is never verified, so its acceptance
    is never learned: a probe verifies it uncut."""
    controller = measured_controller()
    lengths = []
    for _ in range(3 * PROBE_INTERVAL_MIN):
        proposed = controller.proposing(["r"], np.array([False]), np.array([4]))
        # chances of 0.05 never pay for a row
        controller.acceptance.record(["r"], None, np.array([8]), np.array([0]))
        verified = controller.draft_lengths(["r"], np.array([4]), None, 1, 1)
        lengths.append(int(verified[0]))
        controller.record(["r"], proposed, None, verified, np.zeros(1, dtype=np.int64))
    assert 0 in lengths and 4 in lengths
    assert lengths.count(4) <= 3


def test_a_seeded_sampled_request_is_always_proposed_for_and_kept_whole():
    controller = measured_controller()
    calls = run_steps(controller, 30, proposer_seconds=0.020, accept=lambda drafted: 0, always=True)
    assert all(calls)
    assert controller.proposing(["r"], np.array([True]), np.array([4]))[0]
    assert controller.draft_lengths(["r"], np.array([4]), None, 1, 1)[0] == 4


def test_a_probe_waits_until_the_budget_covers_its_catch_up():
    """A proposer off for a request catches up over every token it missed when probed (a
    draft model runs the whole conversation so far): the controller learns that cost per token
    from catch-up calls, and a probe over a long conversation waits until 3% of the engine's
    time has paid for it, where a probe over a short one goes at once."""
    controller = measured_controller()
    controller.proposer_time(1, 0.005)
    controller.catch_up_time(1, 0.005 + 0.100, tokens=100)  # 1 ms a token beyond the usual call
    assert abs(controller.catch_up_seconds_per_token - 0.001) < 1e-9
    for _ in range(600):  # refill the budget (the catch-up above put it 0.1 s in debt)
        controller.step_time(1, FIXED + PER_ROW)
    run_steps(controller, 1, proposer_seconds=0.005, accept=lambda drafted: 0, request_id="long")
    run_steps(controller, 1, proposer_seconds=0.005, accept=lambda drafted: 0, request_id="short")

    def first_probe(request_id: str, unseen: int) -> int:
        for step in range(2000):
            if controller.proposing([request_id], np.array([False]), np.array([4]), np.array([unseen]))[0]:
                return step
            controller.record([request_id], np.array([False]), None, np.array([0]), np.array([0]))
            controller.step_time(1, FIXED + PER_ROW)
        return 2000

    short = first_probe("short", unseen=10)  # 4 + 5 + 10 ms: within the budget's cap (21 ms)
    long = first_probe("long", unseen=1000)  # 1 s: some 3000 steps of 11 ms
    assert short <= 2 * PROBE_INTERVAL_MIN and long == 2000


def test_the_proposer_time_per_request_is_robust_to_one_interrupted_call():
    controller = DraftController()
    for _ in range(10):
        controller.proposer_time(4, 0.004)
    assert controller.proposer_seconds == pytest.approx(0.001)  # calls of one size: all of it per request
    controller.proposer_time(4, 1.0)  # the process was descheduled
    assert controller.proposer_seconds < 0.002


def test_a_call_s_fixed_part_is_split_over_the_step_s_requests_not_those_called_for():
    """A call costs 0.13 ms plus 0.018 ms a request (hybrid's lookup at batch 32, measured).
    Calls for a few probed requests must not make a request's price their mean share (0.08 ms
    at two requests): at batch 32 that price crossed the 0.02-token line and switched requests
    off, which made the calls smaller still."""
    controller = DraftController()
    batch = [f"r{i}" for i in range(32)]
    controller.proposing(batch, np.zeros(32, dtype=bool), np.full(32, 5))
    for requests in (32, 30, 2, 1, 3, 28, 2, 32) * 3:
        controller.proposer_time(requests, 0.00013 + 0.000018 * requests)
    first, per_request = controller.proposer_calls.costs()
    assert first == pytest.approx(0.00013) and per_request == pytest.approx(0.000018)
    assert controller.proposer_seconds == pytest.approx(0.00013 / 32 + 0.000018)
    controller.proposing(["alone"], np.zeros(1, dtype=bool), np.full(1, 5))
    assert controller.proposer_seconds == pytest.approx(0.00013 + 0.000018)  # one request pays the whole call


def test_steps_without_the_proposer_are_counted_and_the_demo_says_so():
    from specdec.demo import controller_line
    from specdec.metrics import SpecMetrics

    metrics = SpecMetrics()
    for off in (True, True, False):
        metrics.record_step(0, 0, 1, proposer_off=off)
    total = metrics + metrics
    assert total.num_proposer_off_steps == 4 and total.to_dict()["num_proposer_off_steps"] == 4
    assert controller_line("mtp", total) == ("mtp: switched off by the controller on this prompt (4 of 6 steps "
                                             "decoded plainly: its drafts did not pay for their time)")
    assert controller_line("ngram", SpecMetrics(num_steps=6, num_proposer_off_steps=2)) == ""


def test_probes_back_off_while_the_policy_cuts_every_draft():
    """In a large batch only near-certain drafts pay for their rows: a cheap proposer's weak
    drafts are cut every step, and probing them at a fixed interval would cost rows for good."""
    controller = measured_controller()
    probes = []
    for _ in range(400):
        controller.proposing(["r"], np.array([False]), np.array([4]))
        controller.proposer_time(1, 0.0001)
        controller.acceptance.record(["r"], None, np.array([8]), np.array([0]))  # chances near 0
        verified = controller.draft_lengths(["r"], np.array([4]), None, 1, 1)
        probes.append(bool(verified[0]))
        controller.record(["r"], np.array([True]), None, verified, np.zeros(1, dtype=np.int64))
    gaps = np.diff(np.flatnonzero(probes))
    assert gaps[0] == PROBE_INTERVAL_MIN + 1 and gaps[-1] == PROBE_INTERVAL_MAX + 1
    assert sum(probes[-4 * PROBE_INTERVAL_MAX:]) <= 5


def test_drafts_of_part_of_a_batch_are_placed_at_their_rows():
    from specdec import Drafts

    part = Drafts.from_lists([[7, 8], [9]], probs=np.ones((2, 2, 3), np.float32), classes=[4, 2])
    whole = part.placed([1, 3], 4)
    assert whole.to_lists() == [[], [7, 8], [], [9]]
    assert whole.classes.tolist() == [0, 4, 0, 2]
    assert whole.probs.shape == (4, 2, 3) and whole.probs[[0, 2]].sum() == 0 and whole.probs[[1, 3]].all()
    assert (whole.token_ids[[0, 2]] == -1).all()


def test_a_request_whose_drafts_pay_on_average_stays_on_through_runs_of_misses():
    """One draft a step accepted 35% of the time, at a cost of about 23% of a token (its row
    and the proposer's call): drafting gains about 0.12 tokens a step on average, and runs of
    misses, which a mean over the last ten steps took for losses (off about half the time),
    must not switch it off for long."""
    rng = np.random.default_rng(3)
    controller = measured_controller()
    calls = run_steps(controller, 2000, proposer_seconds=0.0016, accept=lambda drafted: int(rng.random() < 0.35),
                      k=1)
    assert np.mean(calls) > 0.65, np.mean(calls)  # measured: 0.48 with a ten-step mean, 0.75 with twenty


def asked_after(controller: DraftController, chance: float, steps: int = 30, per_draft: float = 0.004,
                k: int = 5) -> list[int]:
    """Drafts asked of a proposer costing ``per_draft`` seconds a draft, over ``steps`` steps of
    one request whose drafts are each accepted with conditional ``chance`` (as counted)."""
    asked_steps = []
    rng = np.random.default_rng(0)
    for _ in range(steps):
        proposed = controller.proposing(["r"], np.array([False]), np.array([k]))
        asked = controller.drafts_to_ask(["r"], np.array([k]), 1, 1) if proposed[0] else np.array([0])
        if asked[0]:
            controller.proposer_time(1, per_draft * int(asked[0]), int(asked[0]))
        verified = controller.draft_lengths(["r"], asked, None, 1, 1)
        accepted = sum(1 for _ in itertools.takewhile(lambda _: rng.random() < chance, range(int(verified[0]))))
        controller.record(["r"], proposed & (asked > 0), None, verified, np.array([accepted]))
        controller.step_time(1 + int(verified[0]), FIXED + PER_ROW * (1 + int(verified[0])))
        asked_steps.append(int(asked[0]))
    return asked_steps


def test_a_proposer_paying_per_draft_is_asked_for_no_more_drafts_than_pay_for_it_too():
    """A draft model runs a forward per draft: drafts the verify cut would keep for their row
    alone may not pay for that forward as well. The controller asks for fewer, and for all
    of them when they are nearly always right."""
    sure = asked_after(measured_controller(), chance=0.99, steps=100)
    assert np.mean(sure[50:]) >= 4.5
    # Each accepted 85% of the time: all five pay for a 1 ms row (the fifth is accepted with
    # the others 44% of the time, against 1/11 of a token a plain step gives a millisecond);
    # with a 4 ms draft forward as well, two or three do (0.85 + 0.72 + 0.61 tokens in
    # 11 + 15 ms: 0.122 a millisecond, 0.116 with one).
    middling = asked_after(measured_controller(), chance=0.85, steps=100)
    assert middling[0] == 5  # the proposer's time not measured yet: all of them
    assert 1.0 <= np.mean(middling[50:]) <= 3.0 and max(middling[50:]) < 5
    # A draft that costs next to nothing is the verify cut's alone to cut.
    cheap = asked_after(measured_controller(), chance=0.85, steps=100, per_draft=0.00001)
    assert cheap[50:] == [5] * 50


def test_a_request_whose_first_draft_cannot_pay_at_a_large_batch_is_asked_for_none():
    """In a batch of 32 a verify row costs most of a token: a proposer accepted half the time
    (its first draft) drafts at a loss there, and the engine leaves the request out of the
    call rather than cut every draft after it. The same request alone is asked for drafts."""
    def controller_at(batch: int) -> DraftController:
        controller = DraftController()
        for rows in (batch, batch + 1) * 8:  # steps of one size: the fit splits them by its prior
            controller.step_time(rows, FIXED + PER_ROW * rows)
        for step in range(20):  # the method's drafts: the first accepted half the time
            controller.record(["other"], np.array([True]), None, np.array([1]), np.array([step % 2]))
            controller.proposer_time(1, 0.0005, 1)
            controller.proposer_time(1, 0.0009, 2)
        # a step of this batch's rows sets the rate drafts are weighed at (tokens a second)
        controller.draft_lengths([f"r{b}" for b in range(batch)], np.zeros(batch, dtype=np.int64), None, batch, batch)
        return controller

    ids = [f"r{b}" for b in range(32)]
    large = controller_at(32)
    large.proposing(ids, np.zeros(32, dtype=bool), np.full(32, 5))
    assert (large.drafts_to_ask(ids, np.full(32, 5), 32, 32) == 0).all()
    alone = controller_at(1)
    alone.proposing(["r"], np.array([False]), np.array([5]))
    assert alone.drafts_to_ask(["r"], np.array([5]), 1, 1)[0] >= 1
    # A seeded sampled request keeps all its drafts whatever the batch (its tokens must not
    # depend on what shares it).
    large.proposing(ids[:1], np.array([True]), np.array([5]))
    assert large.drafts_to_ask(ids[:1], np.array([5]), 32, 32)[0] == 5


def test_a_fresh_controller_asks_in_full_until_a_draft_is_seen_then_weighs_the_rows():
    """Before any call has returned a draft, whether drafts carry classes is unknown: all are
    asked for. After one (a model proposer's pass over a prompt), a large batch's rows alone,
    at a new method's prior chance, are not worth a first draft: the other requests are not
    run through the proposer's pass over their prompts until drafting is seen to pay."""
    ids = [f"r{b}" for b in range(32)]
    controller = DraftController()
    controller.proposing(ids, np.zeros(32, dtype=bool), np.full(32, 5))
    assert (controller.drafts_to_ask(ids, np.full(32, 5), 32, 32) == 5).all()
    controller.drafts_seen = True  # what the engine sets once a call returns a draft
    assert (controller.drafts_to_ask(ids, np.full(32, 5), 32, 32) == 0).all()
    assert controller.drafts_to_ask(["alone"], np.array([5]), 1, 1)[0] == 5
    controller.drafts_have_classes = True  # a lookup's match lengths: its chances need the class
    assert (controller.drafts_to_ask(ids, np.full(32, 5), 32, 32) == 5).all()


def test_a_probe_or_drafts_with_classes_are_asked_for_in_full():
    controller = measured_controller()
    asked_after(controller, chance=0.3)
    controller.proposing(["r"], np.array([True]), np.array([5]))  # a seeded sampled request: a probe
    assert controller.drafts_to_ask(["r"], np.array([5]), 1, 1)[0] == 5
    controller.proposing(["r"], np.array([False]), np.array([5]))
    assert controller.drafts_to_ask(["r"], np.array([5]), 1, 1)[0] < 5
    controller.drafts_have_classes = True  # an ngram match's length: known once drafted
    assert controller.drafts_to_ask(["r"], np.array([5]), 1, 1)[0] == 5


def test_a_proposer_s_time_is_split_into_its_first_call_and_a_cost_per_draft():
    from specdec.engine.controller import ProposerCostModel

    model = ProposerCostModel()
    for _ in range(10):
        model.observe(5, 0.005 + 5 * 0.008)
    first, per_draft = model.costs()
    assert first == 0.0 and abs(per_draft - (0.005 + 5 * 0.008) / 5) < 1e-12  # one length: all of it per draft
    for drafts in (1, 3, 2, 5, 4) * 6:
        model.observe(drafts, 0.005 + drafts * 0.008)
    first, per_draft = model.costs()
    assert abs(first - 0.005) < 1e-4 and abs(per_draft - 0.008) < 1e-4
    model.observe(2, 10.0)  # the process was descheduled: it counts as three times the fit
    assert model.costs()[1] < 0.012


def test_a_row_s_price_is_its_cost_in_tokens_of_the_step_without_drafts():
    """``ProposalBatch.row_price``: a few hundredths of a token at batch 1, most of one at
    batch 32 (steps of 10 ms plus 0.5 ms a row); nothing before a step is measured."""
    controller = DraftController()
    assert controller.row_price(32, 32) == 0.0
    for rows in (1, 2, 4, 8, 16, 32, 40) * 4:
        controller.step_time(rows, 0.010 + 0.0005 * rows)
    fixed, per_row = controller.step_costs.costs()
    assert controller.row_price(32, 32) == pytest.approx(per_row * 32 / (fixed + per_row * 32))
    assert controller.row_price(1, 1) < 0.1 and controller.row_price(32, 32) > 0.5
