"""specdec.testing.check_proposer catches each broken rule with a one-line message."""

from __future__ import annotations

import numpy as np
import pytest

import specdec
from specdec.testing import check_proposer


class Good(specdec.Proposer):
    NAME = "good"

    def propose(self, batch):
        return specdec.Drafts.from_lists([[1] * r.max_draft_len for r in batch.requests])


def proposer(name, propose):
    return type(name, (specdec.Proposer,), {"NAME": name, "propose": propose})


def test_good_proposer_passes():
    check_proposer(Good)


@pytest.mark.parametrize("cls, message", [
    (proposer("toolong", lambda self, batch: specdec.Drafts.from_lists(
        [[1] * (r.max_draft_len + 1) for r in batch.requests])),
     "toolong.propose: request 'one-token' drafted 5 tokens, max_draft_len is 4"),
    (proposer("notdrafts", lambda self, batch: [[] for _ in batch.requests]),
     "notdrafts.propose: returned list, expected specdec.Drafts"),
    (proposer("rows", lambda self, batch: specdec.Drafts.empty(len(batch) + 1)),
     "rows.propose: lengths must be an integer array of shape (0,), got int64 shape (1,)"),
    (proposer("range", lambda self, batch: specdec.Drafts.from_lists(
        [[10**6][: r.max_draft_len] for r in batch.requests])),
     "range.propose: request 'one-token' drafted token ids outside [0, 512): [1000000]"),
    (proposer("pads", lambda self, batch: specdec.Drafts(
        token_ids=np.zeros((len(batch), 2), dtype=np.int64), lengths=np.zeros(len(batch), dtype=np.int64))),
     "pads.propose: request 'one-token' has padding [0, 0], expected every entry to be -1"),
    (proposer("classes", lambda self, batch: specdec.Drafts.from_lists(
        [[] for _ in batch.requests], classes=[-1] * len(batch))),
     "classes.propose: classes must be 1 non-negative integer labels, got int64 [-1]"),
])
def test_broken_proposers_fail_with_the_rule_they_break(cls, message):
    with pytest.raises(AssertionError) as excinfo:
        check_proposer(cls)
    assert str(excinfo.value) == message


def test_writing_into_the_context_is_caught():
    def propose(self, batch):
        for request in batch.requests:
            request.token_ids[0] = 0
        return specdec.Drafts.empty(len(batch))

    with pytest.raises(ValueError, match="read-only"):
        check_proposer(proposer("writer", propose))


def test_not_a_proposer_or_nameless_is_refused():
    with pytest.raises(AssertionError, match="not a subclass of specdec.Proposer"):
        check_proposer(object)
    with pytest.raises(AssertionError, match="must set NAME"):
        check_proposer(proposer("", Good.propose))
