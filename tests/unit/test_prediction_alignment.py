"""The prediction draft source alone (``specdec.engine.prediction``): alignment after
insertions and deletions, composition with a method's drafts, the counts."""

from __future__ import annotations

import numpy as np
import pytest

from specdec import SamplingParams
from specdec.engine.prediction import CLASS_BASE, PREDICTION_DRAFT_TOKENS, Predictions, _Alignment, check_prediction
from specdec.errors import RequestError
from specdec.metrics import SpecMetrics
from specdec.proposer import DRAFT_PAD, Drafts

PREDICTION = list(range(100, 140))  # 40 distinct tokens


class _Request:
    """What ``Predictions`` reads of an engine request."""

    def __init__(self, request_id: str, generated, prediction=PREDICTION, k=None):
        self.request_id = request_id
        self.generated_ids = np.asarray(generated, dtype=np.int64)
        self.sampling = SamplingParams(prediction=prediction, num_speculative_tokens=k)
        self.metrics = SpecMetrics()


def test_drafts_from_the_start_then_follow_the_output():
    alignment = _Alignment(PREDICTION)
    draft, length = alignment.draft(np.array([], dtype=np.int64), 5)
    assert draft.tolist() == PREDICTION[:5] and length == 0
    draft, length = alignment.draft(np.asarray(PREDICTION[:7]), 4)
    assert draft.tolist() == PREDICTION[7:11] and length == 7


def test_realigns_after_an_insertion_and_a_deletion():
    alignment = _Alignment(PREDICTION)
    # The output inserted tokens the prediction lacks: nothing matches, no draft.
    inserted = PREDICTION[:10] + [7, 8, 9]
    assert len(alignment.draft(np.asarray(inserted), 4)[0]) == 0
    # ... and came back to the predicted text: drafting resumes right after it.
    draft, _ = alignment.draft(np.asarray(inserted + PREDICTION[10:13]), 4)
    assert draft.tolist() == PREDICTION[13:17]
    # The output skipped 10 predicted tokens (a deletion): the match is found further on.
    deleted = inserted + PREDICTION[10:13] + PREDICTION[23:26]
    draft, length = alignment.draft(np.asarray(deleted), 4)
    assert draft.tolist() == PREDICTION[26:30] and length >= 3


def test_a_repeated_passage_aligns_at_the_place_after_the_last_one():
    prediction = [1, 2, 3, 4, 50, 51, 1, 2, 3, 4, 60, 61]
    alignment = _Alignment(prediction)
    assert alignment.draft(np.asarray([1, 2, 3, 4]), 2)[0].tolist() == [50, 51]
    assert alignment.draft(np.asarray([1, 2, 3, 4, 50, 51, 1, 2, 3, 4]), 2)[0].tolist() == [60, 61]


def _compose(predictions, requests, method, caps, rooms):
    """The engine's order: this step's prediction drafts, then composed with the method's."""
    return predictions.compose(requests, method, caps, predictions.drafts(requests, rooms))


def test_compose_replaces_shorter_method_drafts_and_labels_them():
    predictions = Predictions()
    requests = [_Request("a", PREDICTION[:3]), _Request("b", [5, 6], prediction=())]
    method = Drafts.from_lists([[9, 9], [7, 7, 7]], classes=[2, 3])
    drafts, caps = _compose(predictions, requests, method, np.array([3, 3]), np.array([8, 3]))
    assert drafts.to_lists() == [PREDICTION[3:11], [7, 7, 7]]
    assert caps.tolist() == [8, 3]
    assert drafts.classes.tolist() == [CLASS_BASE + 3, 3]  # a 3-token match
    assert drafts.token_ids[1, 3:].tolist() == [DRAFT_PAD] * 5
    predictions.record(requests, np.array([8, 3]), np.array([5, 3]))
    assert (requests[0].metrics.num_prediction_accepted, requests[0].metrics.num_prediction_rejected) == (5, 3)
    assert requests[1].metrics.num_prediction_accepted == 0  # the method's draft is not counted


def test_compose_makes_prediction_drafts_one_hot_among_sampled_drafts():
    predictions = Predictions()
    probs = np.full((1, 2, 200), 1 / 200, dtype=np.float32)
    method = Drafts.from_lists([[9, 9]], probs=probs)
    drafts, _ = _compose(predictions, [_Request("a", [])], method, np.array([2]), np.array([4]))
    assert drafts.probs.shape == (1, 4, 200)
    assert drafts.probs[0, np.arange(4), PREDICTION[:4]].tolist() == [1.0] * 4
    assert drafts.probs.sum() == pytest.approx(4.0)


def test_a_short_match_leaves_the_methods_draft():
    predictions = Predictions()
    # 130 occurs in the prediction, but only the last two tokens match.
    method = Drafts.from_lists([[1, 2]])
    drafts, _ = _compose(predictions, [_Request("a", [5, 129, 130])], method, np.array([2]), np.array([8]))
    assert drafts.to_lists() == [[1, 2]]
    # Without a draft of the method's, the prediction's is taken.
    drafts, _ = _compose(predictions, [_Request("a", [5, 129, 130])], Drafts.empty(1), np.array([2]), np.array([8]))
    assert drafts.to_lists() == [PREDICTION[31:39]]


def test_a_confident_prediction_draft_leads_and_needs_no_proposer_call():
    requests = [_Request("start", []), _Request("synced", PREDICTION[:3]), _Request("chance", [5, 129, 130]),
                _Request("near the end", PREDICTION[:-2]), _Request("none", [5, 6], prediction=())]
    predicted = Predictions().drafts(requests, np.array([8, 8, 8, 8, 8]))
    assert sorted(predicted) == [0, 1, 2, 3]
    # The method could draft 3: a 2-token chance match, or 2 tokens left, may lose to it.
    assert Predictions.leading(predicted, np.array([3, 3, 3, 3, 3])).tolist() == [True, True, False, False, False]
    assert Predictions.leading(predicted, np.array([3, 3, 3, 2, 3])).tolist() == [True, True, False, True, False]


def test_draft_lengths():
    request = _Request("a", [])
    assert Predictions.max_draft_len(request, 3) == PREDICTION_DRAFT_TOKENS
    assert Predictions.max_draft_len(_Request("b", [], prediction=()), 3) == 3
    assert Predictions.max_draft_len(_Request("c", [], k=0), 3) == 0  # speculation off for the request


def test_check_prediction_names_the_field():
    check_prediction([1, 2], 10, 8)
    for bad, vocab, context in (([10], 10, 8), ([-1], 10, 8), (list(range(9)), 100, 8)):
        with pytest.raises(RequestError) as info:
            check_prediction(bad, vocab, context)
        assert info.value.param == "prediction"
    with pytest.raises(RequestError):
        SamplingParams(prediction=[1.5])
