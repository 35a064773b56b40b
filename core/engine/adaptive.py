"""Adaptive draft length: verify a draft token only when it pays for its row.

A step costs about ``F + c * rows`` seconds: ``F`` for what every step pays once (reading the
weights, Python and kernel-launch overhead), ``c`` per packed row (the multiply-adds of one
row, its attention). It emits ``sum_b (1 + accepted_b)`` tokens. Draft ``j`` of request ``b``
is accepted (with all drafts before it) with a chance ``a_bj`` that :class:`AcceptanceModel`
learns per kind of draft and per request. Adding that row raises the step's expected tokens
per second exactly when ``a_bj / c`` exceeds the current ``tokens / seconds`` of the step, so
the policy takes candidate rows best first while that holds (:func:`choose_draft_lengths`).

At batch 1 ``c`` is a small fraction of ``F``, so drafts with a fair chance pass. In a large
batch the rows already dominate the step time, the bar rises towards 1, and only drafts that
are nearly certain remain: speculation never costs throughput by design
(docs/benchmarks/batch.md has the measured ``F`` and ``c``).

``F`` and ``c`` are fitted online from the measured step times (a least-squares line over
recent steps), starting from a prior measured on this machine class.
"""

from __future__ import annotations

import numpy as np

#: Cost of one extra row relative to the fixed cost of a step, before anything is measured,
#: and for batches whose steps are all about one size: a batch-64 decode step's rows measured
#: on a 2-core AVX2 machine (docs/benchmarks/batch.md); the fit corrects it within a few steps.
#: Steps of fewer rows than the engine's measured row curve covers (``row_costs.py``) take
#: the curve's instead: there a row costs what the machine's ISA makes it.
PRIOR_ROW_COST = 0.16
#: Conditional acceptance of a draft token assumed before anything is measured.
PRIOR_ACCEPTANCE = 0.6
#: Weight of that prior in the shared statistics, in draft tokens.
PRIOR_WEIGHT = 2.0
#: Weight of the shared estimate in a request's own, in draft tokens.
REQUEST_PRIOR_WEIGHT = 1.0
#: How much of its history a request keeps each step.
DECAY = 0.8
#: How much of the shared history is kept each step (about the last 200 steps count).
SHARED_DECAY = 0.995


#: A step measured at more than this many times what the fit predicts for its rows was
#: interrupted (another process on the core, a page fault, a garbage collection): it counts
#: as this many times the prediction, so that one such step cannot tilt the line. A real change
#: of speed still moves the fit within a few steps.
OUTLIER_FACTOR = 2.0
#: Steps the fit needs before it judges a step an outlier.
OUTLIER_MIN_STEPS = 4.0
#: The most a row may cost, in fixed costs of a step: a decode row's multiply-adds take less
#: time than reading every weight once (measured 0.1-0.5 with all cores, docs/benchmarks/batch.md;
#: about twice that on one thread), so a fitted slope above this is timing noise.
MAX_ROW_COST = 2.0
#: The least a row costs by the measured row curve, in 1-row passes: a curve flatter than this
#: is timing noise (the fit's own least slope is 2% of a step per row too).
MIN_ROW_SHARE = 0.02


class StepCostModel:
    """``seconds ~ fixed + per_row * rows``, fitted to recent steps with exponential forgetting.

    Robust to the noise of a shared machine: a step far slower than predicted is clipped
    (:data:`OUTLIER_FACTOR`), and a row never costs more than :data:`MAX_ROW_COST` times the
    fixed part of a step, so that one noisy slope cannot switch drafting off for good."""

    def __init__(self, decay: float = 0.97, row_curve: dict[int, float] | None = None):
        """``row_curve``: a pass's time by its rows over a 1-row pass's, measured on this
        machine (:func:`specdec.engine.row_costs.measure_row_curve`), or None."""
        self.decay = decay
        self.row_curve = row_curve
        self._sums = [0.0] * 5  # weight, rows, seconds, rows^2, rows*seconds (floats: see ProposerCostModel)
        #: costs() until the next observe(): the controller asks for it many times a step.
        self._costs: tuple[float, float] | None = None

    def observe(self, rows: int, seconds: float) -> None:
        if self._sums[0] >= OUTLIER_MIN_STEPS:
            fixed, per_row = self.costs()
            seconds = min(seconds, OUTLIER_FACTOR * (fixed + per_row * rows))
        rows, seconds = float(rows), float(seconds)
        self._sums = [self.decay * total + value
                      for total, value in zip(self._sums, (1.0, rows, seconds, rows * rows, rows * seconds))]
        self._costs = None

    @property
    def measured(self) -> bool:
        """Whether :meth:`costs` are in seconds (else relative to a fixed cost of 1)."""
        return self._sums[0] >= 1.0

    def costs(self) -> tuple[float, float]:
        """``(fixed, per_row)``; relative units (``fixed`` 1) until there are measurements."""
        if self._costs is None:
            self._costs = self._fit()
        return self._costs

    def _fit(self) -> tuple[float, float]:
        weight, rows, seconds, rows2, rows_seconds = self._sums
        if not self.measured:
            return 1.0, self.prior_ratio(1.0)
        mean_rows, mean_seconds = rows / weight, seconds / weight
        variance = rows2 / weight - mean_rows ** 2
        if variance < max(1.0, (0.25 * mean_rows) ** 2):
            # Steps of (nearly) one size, as in a large batch where drafts change the row count
            # by a few percent, or one request's steps at batch 1: a fitted slope would be
            # mostly timing noise. Split their time by the prior ratio instead.
            ratio = self.prior_ratio(mean_rows)
            fixed = mean_seconds / (1.0 + ratio * mean_rows)
            return fixed, ratio * fixed
        per_row = (rows_seconds / weight - mean_rows * mean_seconds) / variance
        per_row = max(per_row, 0.02 * mean_seconds / max(mean_rows, 1.0))
        # at most MAX_ROW_COST times the fixed cost (fixed = mean - per_row * mean_rows)
        per_row = min(per_row, MAX_ROW_COST * mean_seconds / (1.0 + MAX_ROW_COST * mean_rows))
        fixed = max(mean_seconds - per_row * mean_rows, 0.05 * mean_seconds)
        return fixed, per_row

    def prior_ratio(self, mean_rows: float) -> float:
        """A row's cost over a step's fixed part, for steps of about ``mean_rows`` rows that
        the fit cannot tell apart: from the measured row curve where it covers one row more
        than that (the mean cost of the rows up to there, so that the next draft's row is
        priced too), else :data:`PRIOR_ROW_COST`."""
        curve = self.row_curve
        if not curve:
            return PRIOR_ROW_COST
        top = int(mean_rows) + 1
        if top not in curve or 1 not in curve:
            return PRIOR_ROW_COST
        # A step of r rows takes F + c * r: the curve gives c over F + c (a 1-row pass); c over F is asked.
        share = (curve[top] - curve[1]) / (curve[1] * (top - 1))
        share = min(max(share, MIN_ROW_SHARE), MAX_ROW_COST / (1.0 + MAX_ROW_COST))
        return share / (1.0 - share)


def choose_draft_lengths(lengths: np.ndarray, chances: np.ndarray, base_rows: int, base_tokens: int,
                         fixed: float, per_row: float, draft_cost: float = 0.0) -> np.ndarray:
    """Cut each request's draft so that the step's expected tokens per second is highest.

    :param lengths: ``[B]`` drafts each request has.
    :param chances: ``[B, W]`` (``W >= lengths.max()``), the estimated chance that request
        ``b``'s draft ``j + 1`` is accepted, i.e. that drafts ``1 .. j + 1`` all are
        (non-increasing along a row; see :meth:`AcceptanceModel.chances`).
    :param base_rows: rows the step is measured from before any draft (the engine passes
        one per decoding request: a plain decode step, whatever prompt rows share the step).
    :param base_tokens: tokens the step emits without any draft.
    :param draft_cost: seconds each draft costs besides its row: the proposer's time per
        draft, when deciding how many drafts to ask a proposer for (a draft model's forward
        per draft); 0 once the drafts exist, when deciding how many to verify.
    :returns: ``[B]`` draft lengths to verify (each at most ``lengths[b]``).
    """
    width = int(lengths.max()) if len(lengths) else 0
    if width == 0:
        return lengths
    cost = per_row + draft_cost
    if len(lengths) == 1:  # one request: its drafts in order (a few microseconds, not tens)
        tokens, seconds, taken = float(base_tokens), fixed + per_row * base_rows, 0
        for value in chances[0, :width].tolist():
            if value <= 0 or value * seconds <= cost * tokens:
                break
            tokens, seconds, taken = tokens + value, seconds + cost, taken + 1
        return np.array([taken], dtype=lengths.dtype)
    j = np.arange(1, width + 1)
    value = np.where(j[None, :] <= lengths[:, None], chances[:, :width], -1.0)  # [B, k]
    order = np.argsort(-value, axis=None, kind="stable")
    values = value.reshape(-1)[order]
    values = values[values > 0]
    # Take candidate i while values[i] / its cost > tokens / seconds of the step so far.
    tokens = base_tokens + np.concatenate([[0.0], np.cumsum(values)[:-1]])
    seconds = fixed + per_row * base_rows + cost * np.arange(len(values))
    worth = values * seconds > cost * tokens
    taken = len(values) if worth.all() else int(np.argmin(worth))
    chosen = np.zeros(value.size, dtype=bool)
    chosen[order[:taken]] = True
    # Chances fall with j inside a request (ties keep their order: the sort is stable), so
    # the chosen drafts of a request form a prefix.
    return chosen.reshape(value.shape).sum(axis=1).astype(lengths.dtype)


class AcceptanceModel:
    """The chance that a draft token is accepted, learned from what earlier steps accepted.

    Drafts are not alike: an ngram draft copied after a 4-token match is accepted whole most
    of the time, one found by a 1-token match rarely gets its first token through. A proposer says which kind each
    draft is (``Drafts.classes``; ngram and suffix give the length of the match), and the
    model keeps, per class and draft position ``j``, the conditional acceptance
    ``p(j) = P(draft j accepted | drafts before it accepted)`` as decayed counts:

    - shared counts over all requests, starting from :data:`PRIOR_ACCEPTANCE` at the first
      position and from the estimate at position ``j - 1`` at position ``j`` (a position
      never verified, because every step cut the drafts before it, is taken to be like the
      last one measured rather than like nothing measured: otherwise a cut that once stopped
      at three drafts would never learn that the fourth pays), and
    - each request's own counts, pulled towards the shared estimate (a prior worth
      :data:`REQUEST_PRIOR_WEIGHT` drafts): a request whose output copies its prompt
      closely is told apart from one that does not, once it has a history.

    The chance of draft ``j`` is the product ``p(1) ... p(j)``. A request's history decays with
    every step, drafted or not, so that a request whose drafts were cut for a poor record
    drifts back to the shared estimate and gets tried again.
    """

    def __init__(self):
        self._shared: dict[int, np.ndarray] = {}  # class -> [2, W]: verified, accepted
        self._own: dict[str, dict[int, np.ndarray]] = {}  # request -> class -> [2, W]
        # A request's counts are decayed when next touched, by DECAY per step since the last
        # time: a step costs nothing for the requests that did not draft in it.
        self._own_step: dict[str, int] = {}
        self._step = 0
        # class -> the shared p(1..W) as floats, until the next record(): the controller asks
        # for chances two or three times a step, and at batch 1 each numpy call it saves is a
        # few microseconds, ten times that on the caches a forward pass has just flushed.
        self._shared_p_cache: dict[int, list[float]] = {}

    def _own_counts(self, request_id: str) -> dict[int, np.ndarray] | None:
        own = self._own.get(request_id)
        if own is not None:
            elapsed = self._step - self._own_step[request_id]
            if elapsed:
                factor = DECAY ** elapsed
                for counts in own.values():
                    counts *= factor
                self._own_step[request_id] = self._step
        return own

    @staticmethod
    def _grown(counts: np.ndarray | None, width: int) -> np.ndarray:
        if counts is None:
            return np.zeros((2, width))
        if counts.shape[1] < width:
            counts = np.concatenate([counts, np.zeros((2, width - counts.shape[1]))], axis=1)
        return counts

    def _shared_p(self, draft_class: int, width: int) -> list[float]:
        """The shared conditional acceptance ``p(1) .. p(width)`` of ``draft_class``."""
        cached = self._shared_p_cache.get(draft_class)
        if cached is not None and len(cached) >= width:
            return cached[:width]
        counts = self._shared.get(draft_class)
        if counts is None:
            p = [PRIOR_ACCEPTANCE] * width
        else:
            verified, accepted = counts.tolist()
            p, prior = [], PRIOR_ACCEPTANCE
            for j in range(width):
                seen, took = (verified[j], accepted[j]) if j < len(verified) else (0.0, 0.0)
                prior = (took + PRIOR_WEIGHT * prior) / (seen + PRIOR_WEIGHT)
                p.append(prior)
        self._shared_p_cache[draft_class] = p
        return p

    def shared_first_chance(self, draft_class: int = 0) -> float:
        """The chance that a first draft of ``draft_class`` is accepted, over all requests."""
        return self._shared_p(draft_class, 1)[0]

    def chances(self, request_ids: list[str], classes: np.ndarray | None, width: int) -> np.ndarray:
        """``[B, width]``: the chance that draft ``j + 1`` of request ``b`` (of class
        ``classes[b]``; ``None``: all of class 0) is accepted along with every draft before it."""
        labels = [0] * len(request_ids) if classes is None else classes.tolist()
        rows = []
        for request_id, draft_class in zip(request_ids, labels):
            prior = self._shared_p(draft_class, width)
            own = (self._own_counts(request_id) or {}).get(draft_class)
            if own is None:
                p = prior
            else:
                verified, accepted = own.tolist()
                p = [(accepted[j] + REQUEST_PRIOR_WEIGHT * prior[j]) / (verified[j] + REQUEST_PRIOR_WEIGHT)
                     if j < len(verified) else prior[j] for j in range(width)]
            chance, row = 1.0, []
            for value in p:
                chance *= value
                row.append(chance)
            rows.append(row)
        return np.array(rows, dtype=np.float64).reshape(len(request_ids), width)

    def record(self, request_ids: list[str], classes: np.ndarray | None, draft_lengths: np.ndarray,
               accepted: np.ndarray) -> None:
        """Fold in one step: request ``b`` verified ``draft_lengths[b]`` drafts of class
        ``classes[b]`` and accepted the first ``accepted[b]`` of them."""
        labels = [0] * len(request_ids) if classes is None else classes.tolist()
        self._step += 1
        for counts in self._shared.values():
            counts *= SHARED_DECAY
        self._shared_p_cache.clear()
        for request_id, draft_class, drafted, kept in zip(request_ids, labels, draft_lengths.tolist(),
                                                          accepted.tolist()):
            if drafted == 0:
                continue
            own = self._own_counts(request_id)
            if own is None:
                own = self._own[request_id] = {}
                self._own_step[request_id] = self._step
            # Positions 0 .. kept were verified with all before them accepted (position
            # `kept` only if it exists: it is the first rejected one); 0 .. kept-1 accepted.
            for table in (self._shared, own):
                counts = table.get(draft_class)
                if counts is None or counts.shape[1] < drafted:
                    counts = table[draft_class] = self._grown(counts, drafted)
                counts[0, :min(kept + 1, drafted)] += 1.0
                counts[1, :kept] += 1.0

    def forget(self, request_id: str) -> None:
        self._own.pop(request_id, None)
        self._own_step.pop(request_id, None)
