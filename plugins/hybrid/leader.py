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
#: Steps after which a kind that has not led leads once more.
RETRY_STEPS = 32

MODEL = 0  # the kind of a model-first draft


class LeaderStats:
    """Decayed accepted-tokens means of model-first drafts (kind 0) and lookup-first drafts
    (kind = matched length, capped at :data:`MAX_KIND`)."""

    def __init__(self):
        self._accepted = np.full(MAX_KIND + 1, PRIOR_ACCEPTED * PRIOR_WEIGHT)
        self._weight = np.full(MAX_KIND + 1, PRIOR_WEIGHT)
        self._last_led = np.zeros(MAX_KIND + 1, dtype=np.int64)
        self._step = 0

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
        return self.mean(kind) >= self.mean(MODEL) - model_cost or self._step - self._last_led[kind] > RETRY_STEPS

    def next_step(self) -> None:
        self._step += 1

    def record(self, kind: int, accepted: int) -> None:
        """A draft of ``kind`` had ``accepted`` of its tokens accepted."""
        self._accepted[kind] = DECAY * self._accepted[kind] + accepted
        self._weight[kind] = DECAY * self._weight[kind] + 1.0
        self._last_led[kind] = self._step
