"""Which proposer leads a hybrid draft, learned from what the target accepted.

A hybrid draft has two shapes: the model's tokens continued by the lookup (*model first*,
FastDeploy's order), or the lookup's own draft where it matches the context (*lookup first*;
its kind is the length of the match, as ``Drafts.classes``). They are accepted about as often
at the first position, but a model miss throws away the lookup's continuation, and a long
match is right far more often than a short one. :class:`LeaderStats` keeps, per kind, a
decayed mean of the draft tokens accepted per step, and lets the lookup lead where its kind has
done at least as well as the model, less what the model's call costs (a lookup-led step skips
it): the model's measured time per request, in tokens of a step. A kind that has not led for
:data:`RETRY_STEPS` steps leads once more, so a kind that once lost is measured again.

Where model-first drafts have been accepted less than a verified row and the model's call cost
(``ProposalBatch.row_price``: in a large batch a row costs most of a token), the model is not
run at all: every request with a match gets the lookup's draft, the others none, as ``ngram``
alone would draft (:meth:`LeaderStats.model_pays`), but for one request every
:data:`RETRY_STEPS` steps, whose steps measure the model afresh.

The same measure decides whether a model-first draft is continued by the lookup at all: a
decayed mean of the continuation tokens accepted per continued step, against the lookup
call's cost in tokens. Measured on the default model's shipped head (2026-12-05): of 213
continuation tokens drafted after the head's on 8 chat prompts, 1 was accepted; on 8 code
edits, 2 of 682 (where the context matches well the lookup leads instead).
"""

from __future__ import annotations

import numpy as np

#: Matches at least this long share one kind.
MAX_KIND = 8
#: Tokens accepted per step assumed for every kind before any is measured, and its weight.
PRIOR_ACCEPTED = 1.0
PRIOR_WEIGHT = 1.0
#: How much of its history a kind keeps per step it leads (about the last 30 count).
DECAY = 0.97
#: Steps after which a kind that has not led leads once more (and after which a model-first
#: draft not continued is continued once more).
RETRY_STEPS = 32
MODEL = 0  # the kind of a model-first draft
#: Where the continuations of model-first drafts are counted, as one more kind (the lookup
#: tokens accepted after the model's, per continued step).
CONTINUATION = MAX_KIND + 1


class LeaderStats:
    """Decayed accepted-tokens means of model-first drafts (kind 0), lookup-first drafts
    (kind = matched length, capped at :data:`MAX_KIND`) and the lookup's continuations of
    model-first drafts (:data:`CONTINUATION`)."""

    def __init__(self):
        self._accepted = np.full(CONTINUATION + 1, PRIOR_ACCEPTED * PRIOR_WEIGHT)
        self._weight = np.full(CONTINUATION + 1, PRIOR_WEIGHT)
        self._last_led = np.zeros(CONTINUATION + 1, dtype=np.int64)
        self._step = 0
        self._model_skipped = False

    @staticmethod
    def kind(matched: int) -> int:
        return min(max(int(matched), 0), MAX_KIND)

    def mean(self, kind: int) -> float:
        return float(self._accepted[kind] / self._weight[kind])

    def lookup_leads(self, matched: int, model_cost: float = 0.0) -> bool:
        """Whether a lookup draft that matched ``matched`` tokens should go first and alone;
        ``model_cost``: what running the model for the request costs, in tokens."""
        kind = self.kind(matched)
        if kind == MODEL:
            return False
        return self.mean(kind) >= self.mean(MODEL) - model_cost or self.retry_due(kind)

    def model_pays(self, price: float) -> bool:
        """Whether a model-first draft is worth running the model: its steps have had at
        least ``price`` tokens accepted (a verified row's price and the model's time, in
        tokens)."""
        return self.mean(MODEL) >= price

    def skip_model(self) -> None:
        """The model was skipped this step for its price: its next measure starts afresh."""
        self._model_skipped = True

    def retry_due(self, kind: int) -> bool:
        """Whether ``kind`` has not led for :data:`RETRY_STEPS` steps (it is measured again)."""
        return self._step - self._last_led[kind] > RETRY_STEPS

    def next_step(self) -> None:
        self._step += 1

    def record(self, kind: int, accepted: int) -> None:
        """A draft of ``kind`` had ``accepted`` of its tokens accepted. The model's first
        steps after it was skipped for its price (:meth:`skip_model`) start its mean afresh:
        it was measured at another step's price (a large batch cuts its drafts, which counts
        as none accepted)."""
        if kind == MODEL and self._model_skipped:
            self._accepted[kind] = self._weight[kind] = 0.0
            self._model_skipped = False
        self._accepted[kind] = DECAY * self._accepted[kind] + accepted
        self._weight[kind] = DECAY * self._weight[kind] + 1.0
        self._last_led[kind] = self._step

    def continuation_pays(self, lookup_cost: float) -> bool:
        """Whether to continue a model-first draft with the lookup: its continuations have
        been accepted at least ``lookup_cost`` tokens a step (the lookup call's time, in tokens
        of a step), or none has run for :data:`RETRY_STEPS` steps."""
        return self.mean(CONTINUATION) >= lookup_cost or self.retry_due(CONTINUATION)

    def record_continuation(self, accepted: int) -> None:
        """A continued model-first draft had ``accepted`` of its lookup tokens accepted."""
        self.record(CONTINUATION, accepted)
