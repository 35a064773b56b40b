"""SpecMetrics: recording steps, summing requests, derived values, the JSON form."""

from __future__ import annotations

import pytest

from specdec.metrics import SpecMetrics


def recorded(*steps):
    m = SpecMetrics()
    for draft_len, accepted, emitted in steps:
        m.record_step(draft_len, accepted, emitted)
    return m


def test_empty():
    m = SpecMetrics()
    assert m.acceptance_rate == 0.0 and m.mean_acceptance_length == 0.0
    assert m.to_dict() == {"num_steps": 0, "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                           "acceptance_rate": 0.0, "mean_acceptance_length": 0.0, "accepted_per_position": [],
                           "num_proposer_off_steps": 0}


def test_record_steps():
    m = recorded((3, 2, 3), (0, 0, 1), (5, 0, 1), (2, 2, 3))
    assert m.num_steps == 4
    assert m.num_drafts == 3  # the step without a draft is not a draft
    assert m.num_draft_tokens == 10
    assert m.num_accepted_tokens == 4
    assert m.num_emitted_tokens == 8
    # position 0 accepted in 2 drafts, position 1 in 2, positions 2..4 never
    assert m.accepted_per_position == [2, 2, 0, 0, 0]
    assert m.acceptance_rate == 4 / 10
    assert m.mean_acceptance_length == 8 / 4


def test_plain_decoding():
    m = recorded(*[(0, 0, 1)] * 7)
    assert (m.num_steps, m.num_drafts, m.num_draft_tokens, m.num_emitted_tokens) == (7, 0, 0, 7)
    assert m.accepted_per_position == []
    assert m.acceptance_rate == 0.0 and m.mean_acceptance_length == 1.0


def test_per_position_grows_with_longer_drafts():
    m = recorded((1, 1, 2))
    assert m.accepted_per_position == [1]
    m.record_step(4, 3, 4)
    assert m.accepted_per_position == [2, 1, 1, 0]
    m.record_step(2, 1, 2)
    assert m.accepted_per_position == [3, 1, 1, 0]


def test_sum_and_total():
    a = recorded((3, 3, 4), (3, 1, 2))
    b = recorded((5, 5, 6), (0, 0, 1), (1, 0, 1))
    c = SpecMetrics()
    s = a + b
    assert s == SpecMetrics(num_steps=5, num_drafts=4, num_draft_tokens=12, num_accepted_tokens=9,
                            num_emitted_tokens=14, accepted_per_position=[3, 2, 2, 1, 1])
    assert b + a == s
    assert s + c == s and c + s == s
    assert SpecMetrics.total([a, b, c]) == s
    assert SpecMetrics.total([]) == SpecMetrics()
    assert s.acceptance_rate == 9 / 12 and s.mean_acceptance_length == 14 / 5
    # summing does not touch its operands
    assert a.accepted_per_position == [2, 1, 1] and b.accepted_per_position == [1, 1, 1, 1, 1]
    assert all(type(x) is int for x in s.accepted_per_position)


def test_to_dict_rounds_derived_values():
    m = recorded((3, 1, 2), (3, 0, 1), (3, 0, 1))
    d = m.to_dict()
    assert d == {"num_steps": 3, "num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 1,
                 "acceptance_rate": 0.1111, "mean_acceptance_length": 1.3333,
                 "accepted_per_position": [1, 0, 0], "num_proposer_off_steps": 0}
    d["accepted_per_position"].append(99)
    assert m.accepted_per_position == [1, 0, 0]  # a copy


@pytest.mark.parametrize("steps", [[(5, 5, 6)] * 3, [(4, 0, 1), (4, 4, 5), (2, 1, 2)]])
def test_emitted_is_steps_plus_accepted_when_nothing_is_cut(steps):
    m = recorded(*steps)
    assert m.num_emitted_tokens == m.num_steps + m.num_accepted_tokens
    assert m.mean_acceptance_length == pytest.approx(1 + m.num_accepted_tokens / m.num_steps, rel=1e-12)
