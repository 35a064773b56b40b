"""Adaptive draft length: verify a draft token only when it pays for its row.

A step costs about ``F + c * rows`` seconds: ``F`` for what every step pays once (reading the
weights, Python and kernel-launch overhead), ``c`` per packed row (the multiply-adds of one
row, its attention). It emits ``sum_b (1 + accepted_b)`` tokens. Draft ``j`` of request ``b``
is accepted with probability about ``q_b ** j``, where ``q_b`` is the request's recent
per-token acceptance. Adding that row raises the step's expected tokens per second exactly
when ``q_b ** j / c`` exceeds the current ``tokens / seconds`` of the step, so the policy
takes candidate rows best first while that holds (:func:`choose_draft_lengths`).

At batch 1 on these CPUs ``c`` is a sixth of ``F``: drafts with a fair chance pass. In a
large batch the rows already dominate the step time, the bar rises towards 1, and only drafts
that are nearly certain remain: speculation never costs throughput by design.

``F`` and ``c`` are fitted online from the measured step times (a least-squares line over
recent steps), starting from a prior measured on this machine class.
"""

from __future__ import annotations

import numpy as np

#: Cost of one extra row relative to the fixed cost of a step, before anything is measured
#: (a 6-row step took 1.8x a 1-row step on the 2-core AVX2 machines).
PRIOR_ROW_COST = 0.16
#: Per-token acceptance assumed for a request before it has any history.
PRIOR_ACCEPTANCE = 0.6
#: Weight of the prior, in draft tokens.
PRIOR_WEIGHT = 2.0
#: How much of its history a request keeps each step.
DECAY = 0.8


class StepCostModel:
    """``seconds ~ fixed + per_row * rows``, fitted to recent steps with exponential forgetting."""

    def __init__(self, decay: float = 0.97):
        self.decay = decay
        self._sums = np.zeros(5)  # weight, rows, seconds, rows^2, rows*seconds

    def observe(self, rows: int, seconds: float) -> None:
        self._sums *= self.decay
        self._sums += (1.0, rows, seconds, rows * rows, rows * seconds)

    def costs(self) -> tuple[float, float]:
        """``(fixed, per_row)``; relative units (``fixed`` 1) until there are measurements."""
        weight, rows, seconds, rows2, rows_seconds = self._sums
        if weight < 1.0:
            return 1.0, PRIOR_ROW_COST
        mean_rows, mean_seconds = rows / weight, seconds / weight
        variance = rows2 / weight - mean_rows ** 2
        if variance < max(1.0, (0.25 * mean_rows) ** 2):
            # Steps of (nearly) one size, as in a large batch where drafts change the row count
            # by a few percent: a fitted slope would be mostly timing noise. Split their time
            # by the prior ratio instead.
            fixed = mean_seconds / (1.0 + PRIOR_ROW_COST * mean_rows)
            return fixed, PRIOR_ROW_COST * fixed
        per_row = (rows_seconds / weight - mean_rows * mean_seconds) / variance
        per_row = max(per_row, 0.02 * mean_seconds / max(mean_rows, 1.0))
        fixed = max(mean_seconds - per_row * mean_rows, 0.05 * mean_seconds)
        return fixed, per_row


def choose_draft_lengths(lengths: np.ndarray, acceptance: np.ndarray, base_rows: int, base_tokens: int,
                         fixed: float, per_row: float) -> np.ndarray:
    """Cut each request's draft so that the step's expected tokens per second is highest.

    :param lengths: ``[B]`` drafts each request has.
    :param acceptance: ``[B]`` estimated per-token acceptance ``q_b`` in [0, 1].
    :param base_rows: rows the step is measured from before any draft (the engine passes
        one per decoding request: a plain decode step, whatever prompt rows share the step).
    :param base_tokens: tokens the step emits without any draft.
    :returns: ``[B]`` draft lengths to verify (each at most ``lengths[b]``).
    """
    width = int(lengths.max()) if len(lengths) else 0
    if width == 0:
        return lengths
    j = np.arange(1, width + 1)
    value = acceptance[:, None] ** j[None, :]  # [B, k]: chance that draft j is accepted
    value = np.where(j[None, :] <= lengths[:, None], value, -1.0)
    order = np.argsort(-value, axis=None, kind="stable")
    values = value.reshape(-1)[order]
    values = values[values > 0]
    # Take candidate i while values[i] / per_row > tokens / seconds of the step so far.
    tokens = base_tokens + np.concatenate([[0.0], np.cumsum(values)[:-1]])
    seconds = fixed + per_row * (base_rows + np.arange(len(values)))
    worth = values * seconds > per_row * tokens
    taken = len(values) if worth.all() else int(np.argmin(worth))
    chosen = np.zeros(value.size, dtype=bool)
    chosen[order[:taken]] = True
    # Values fall with j inside a request, so the chosen drafts of a request form a prefix.
    return chosen.reshape(value.shape).sum(axis=1).astype(lengths.dtype)


class AcceptanceTracker:
    """Per-request estimate of the per-token acceptance ``q``: decayed counts of accepted
    drafts and of rejections (a step that kept fewer drafts than it had), i.e. the maximum
    likelihood ``q`` of a geometric acceptance model, pulled towards a prior."""

    def __init__(self):
        self._accepted: dict[str, float] = {}
        self._rejected: dict[str, float] = {}

    def estimate(self, request_ids: list[str]) -> np.ndarray:
        accepted = np.array([self._accepted.get(r, 0.0) for r in request_ids])
        rejected = np.array([self._rejected.get(r, 0.0) for r in request_ids])
        prior_accepted = PRIOR_WEIGHT * PRIOR_ACCEPTANCE
        return (accepted + prior_accepted) / (accepted + rejected + PRIOR_WEIGHT)

    def record(self, request_ids: list[str], draft_lengths: np.ndarray, accepted: np.ndarray) -> None:
        """Fold in one step. A step without drafts still decays the history, so that a request
        whose drafts were cut for a poor record drifts back to the prior and gets tried again."""
        for request_id, drafted, kept in zip(request_ids, draft_lengths.tolist(), accepted.tolist()):
            self._accepted[request_id] = self._accepted.get(request_id, 0.0) * DECAY + kept
            self._rejected[request_id] = self._rejected.get(request_id, 0.0) * DECAY + (kept < drafted)

    def forget(self, request_id: str) -> None:
        self._accepted.pop(request_id, None)
        self._rejected.pop(request_id, None)
