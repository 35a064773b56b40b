"""The adaptive draft-length policy: the row choice, the cost fit and the acceptance estimate."""

from __future__ import annotations

import numpy as np

from specdec.engine.adaptive import (
    PRIOR_ACCEPTANCE,
    PRIOR_ROW_COST,
    AcceptanceModel,
    StepCostModel,
    choose_draft_lengths,
)


def geometric(q, width: int = 5) -> np.ndarray:
    """``[B, width]`` chances ``q_b ** j``."""
    return np.asarray(q, dtype=float)[:, None] ** np.arange(1, width + 1)[None, :]


def test_batch_one_keeps_likely_drafts_and_drops_unlikely_ones():
    # fixed 1, per row 0.16: draft j is kept while q^j / 0.16 beats tokens / seconds.
    lengths = choose_draft_lengths(np.array([5]), geometric([0.6]), base_rows=1, base_tokens=1,
                                   fixed=1.0, per_row=0.16)
    # q^j = .6, .36, .216, .13, .078; tokens/seconds after 3 rows: 2.176/1.48 = 1.47 > .13/.16
    assert lengths.tolist() == [3]


def test_the_exact_rule_on_a_hand_case():
    values = 0.9 ** np.arange(1, 6)
    fixed, per_row = 1.0, 0.9
    tokens, seconds, taken = 1.0, fixed + per_row, 0
    for v in values:  # the rule written out: take while v / per_row > tokens / seconds
        if v / per_row <= tokens / seconds:
            break
        tokens, seconds, taken = tokens + v, seconds + per_row, taken + 1
    got = choose_draft_lengths(np.array([5]), geometric([0.9]), 1, 1, fixed, per_row)
    assert got.tolist() == [taken] and 0 < taken < 5


def test_large_batches_keep_only_near_certain_drafts():
    batch = 64
    q = np.full(batch, 0.7)
    q[:4] = 0.99
    lengths = choose_draft_lengths(np.full(batch, 5), geometric(q), base_rows=batch, base_tokens=batch,
                                   fixed=1.0, per_row=0.16)
    assert lengths[4:].sum() == 0  # 0.7 does not pay for a row when rows dominate the step
    assert (lengths[:4] > 0).all()


def test_never_more_than_proposed_and_prefixes_only():
    rng = np.random.default_rng(0)
    for _ in range(50):
        batch = int(rng.integers(1, 20))
        lengths = rng.integers(0, 6, batch)
        q = rng.random(batch)
        got = choose_draft_lengths(lengths, geometric(q), batch, batch, 1.0, float(rng.uniform(0.01, 1)))
        assert (got <= lengths).all() and (got >= 0).all()
        # A request with a higher q never gets fewer rows than one with a lower q, when both
        # have drafts to spare.
        order = np.argsort(q)
        spare = lengths[order] == lengths.max()
        assert np.all(np.diff(got[order][spare]) >= 0)


def test_cost_model_recovers_a_line():
    model = StepCostModel()
    assert model.costs() == (1.0, PRIOR_ROW_COST)
    rng = np.random.default_rng(1)
    for _ in range(200):
        rows = int(rng.integers(1, 40))
        model.observe(rows, 0.020 + 0.003 * rows)
    fixed, per_row = model.costs()
    assert abs(fixed - 0.020) < 1e-6 and abs(per_row - 0.003) < 1e-7


def test_cost_model_with_one_step_size_uses_the_prior_ratio():
    model = StepCostModel()
    for _ in range(10):
        model.observe(4, 0.05)
    fixed, per_row = model.costs()
    assert abs(fixed + 4 * per_row - 0.05) < 1e-9 and abs(per_row / fixed - PRIOR_ROW_COST) < 1e-9


def test_no_history_means_the_prior():
    chances = AcceptanceModel().chances(["a", "b"], np.array([0, 3]), 4)
    assert np.allclose(chances, PRIOR_ACCEPTANCE ** np.arange(1, 5))


def test_acceptance_is_learned_per_draft_class():
    """Long-match drafts accepted whole, one-token matches rejected: after a few steps the
    first kind is verified whole at batch 1 and the second not at all."""
    model = AcceptanceModel()
    for step in range(30):
        model.record([f"r{step}", f"s{step}"], np.array([4, 1]), np.array([5, 5]), np.array([5, 0]))
    strong, weak = model.chances(["new1", "new2"], np.array([4, 1]), 5)
    assert strong[-1] > 0.8 and weak[0] < 0.1  # the prior (0.6, worth 2 drafts) still weighs in
    unseen = model.chances(["new3"], np.array([2]), 5)[0]
    assert np.allclose(unseen, PRIOR_ACCEPTANCE ** np.arange(1, 6))  # no history for class 2
    lengths = choose_draft_lengths(np.array([5, 5]), np.stack([strong, weak]), base_rows=2, base_tokens=2,
                                   fixed=1.0, per_row=0.06)
    assert lengths.tolist() == [5, 0]
    assert model.chances(["x"], None, 5)[0].tolist() == unseen.tolist()  # None: everything is class 0


def test_acceptance_is_conditional_per_position_not_geometric():
    """Drafts whose first token is a coin flip but whose rest follows whenever the first
    does (a copy either lines up or not): the chance of draft 5 stays near that of draft 1,
    where a geometric model would give q ** 5."""
    model = AcceptanceModel()
    for step in range(200):
        kept = 5 if step % 2 else 0
        model.record([f"r{step}"], np.array([1]), np.array([5]), np.array([kept]))
    chances = model.chances(["new"], np.array([1]), 5)[0]
    assert 0.4 < chances[0] < 0.6
    assert chances[4] > 0.9 * chances[0]


def test_a_request_own_history_outweighs_the_shared_one_and_is_forgotten():
    model = AcceptanceModel()
    for _ in range(10):
        model.record(["good", "bad"], np.array([0, 0]), np.array([4, 4]), np.array([4, 0]))
    good, bad = model.chances(["good", "bad"], np.array([0, 0]), 4)[:, 0]
    shared = model.chances(["other"], np.array([0]), 4)[0, 0]
    assert good > 0.85 and bad < 0.2 and bad < shared < good
    for _ in range(30):  # bad stops drafting: its history fades back to the shared estimate
        model.record(["bad"], np.array([0]), np.array([0]), np.array([0]))
    assert abs(model.chances(["bad"], np.array([0]), 4)[0, 0] - shared) < 0.05
    model.forget("good")
    assert model.chances(["good"], np.array([0]), 4)[0, 0] == model.chances(["other"], np.array([0]), 4)[0, 0]


def test_cost_model_ignores_the_slope_of_a_narrow_row_range():
    """A large batch varies its rows by a few drafts: the fitted slope would be timing noise."""
    model = StepCostModel()
    rng = np.random.default_rng(2)
    for _ in range(100):
        rows = int(rng.integers(32, 40))
        model.observe(rows, 0.2 * rng.uniform(0.8, 1.2))  # no real dependence on rows
    fixed, per_row = model.costs()
    assert abs(per_row / fixed - PRIOR_ROW_COST) < 1e-9


def test_an_interrupted_step_does_not_switch_drafting_off():
    """One step of 4 rows measured 20x too slow (the core was taken away): the fitted row cost
    stays near the truth, and a draft with a fair chance is still verified."""
    clean, noisy = StepCostModel(), StepCostModel()
    rng = np.random.default_rng(3)
    for step in range(40):
        rows = int(rng.integers(1, 6))
        seconds = 0.010 + 0.001 * rows
        clean.observe(rows, seconds)
        noisy.observe(rows, seconds * (20.0 if step == 30 else 1.0))
    (fixed, per_row), (clean_fixed, clean_per_row) = noisy.costs(), clean.costs()
    assert per_row < 2 * clean_per_row and fixed > 0.5 * clean_fixed
    chosen = choose_draft_lengths(np.array([4]), PRIOR_ACCEPTANCE ** np.arange(1, 5)[None, :], base_rows=1,
                                  base_tokens=1, fixed=fixed, per_row=per_row)
    assert chosen[0] > 0


def test_a_row_never_costs_more_than_twice_the_fixed_part_of_a_step():
    from specdec.engine.adaptive import MAX_ROW_COST

    model = StepCostModel()
    for step in range(60):  # timing noise that happens to grow with the rows
        rows = 1 + step % 6
        model.observe(rows, 0.001 + 0.010 * rows)
    fixed, per_row = model.costs()
    assert MAX_ROW_COST == 2.0 and per_row <= MAX_ROW_COST * fixed * 1.0001


def test_one_request_s_cut_is_the_batch_rule_s():
    """A single request takes a shortcut (its drafts in order); it must cut where the batch
    rule would cut the same request next to one that drafts nothing."""
    rng = np.random.default_rng(7)
    for _ in range(500):
        length = int(rng.integers(1, 9))
        chances = np.cumprod(rng.uniform(0.05, 1.0, size=(1, 8)), axis=1)
        fixed, per_row, draft_cost = 1.0, float(rng.uniform(0.01, 0.5)), float(rng.choice([0.0, rng.uniform(0, 0.5)]))
        base = int(rng.integers(1, 4))
        alone = choose_draft_lengths(np.array([length]), chances, base, base, fixed, per_row, draft_cost)
        paired = choose_draft_lengths(np.array([length, 0]), np.vstack([chances, chances]), base, base, fixed,
                                      per_row, draft_cost)
        assert alone[0] == paired[0]


def test_steps_too_alike_to_fit_take_the_measured_row_curve():
    """One request's steps of one or two rows: the fit's prior is the machine's row curve (a
    second row 3% of a pass on AVX-512, 21% on AVX2: docs/benchmarks/decode.md), so the same
    steps price a row five times higher where the ISA makes it dearer."""
    prices = {}
    for isa, curve in {"avx512": {1: 1.0, 2: 1.03, 3: 1.09, 4: 1.23},
                       "avx2": {1: 1.0, 2: 1.21, 3: 1.43, 4: 1.72}}.items():
        model = StepCostModel(row_curve=curve)
        for step in range(40):
            model.observe(2 if step % 10 else 1, 0.004)  # mean 1.9 rows, variance 0.09
        fixed, per_row = model.costs()
        # A step of r rows takes fixed + per_row * r: the rows up to the mean + 1 (two) as the curve has them.
        assert abs(per_row / (fixed + per_row) - (curve[2] - 1.0)) < 1e-9
        assert abs(fixed + 1.9 * per_row - 0.004) < 1e-4
        prices[isa] = per_row
    assert prices["avx2"] > 5 * prices["avx512"]


def test_a_row_curve_is_not_used_beyond_its_rows_nor_below_a_floor():
    flat = StepCostModel(row_curve={1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0})
    assert 0.02 <= flat.prior_ratio(1.0) < 0.021  # timing noise, not a free row
    assert flat.prior_ratio(4.0) == PRIOR_ROW_COST  # a batch's rows: beyond what was measured
    assert StepCostModel().prior_ratio(1.0) == PRIOR_ROW_COST  # no curve measured
    batch = StepCostModel(row_curve={1: 1.0, 2: 1.2})
    for _ in range(20):
        batch.observe(33, 0.05)  # 32 requests and a draft: the prior measured at batch 64
    fixed, per_row = batch.costs()
    assert abs(per_row / fixed - PRIOR_ROW_COST) < 1e-9
