"""The drafting controller: per request and step, whether to call the proposer and how many of
its drafts to verify, so that speculation never makes decoding slower.

Drafting costs time twice: the proposer's own call (a model head or a draft model: a good part
of a step) and a verified row per draft token (``adaptive.py``). Both are measured here, the
proposer's as a call's fixed part plus a part per request it drafted for, the rest of a step
per packed row. A request's share of a call is its own part plus the fixed part split over
the step's decoding requests: what a call for all of them costs each (a call for a few probed
requests costs each more, and that price, taken for drafting's, would switch more off).
Each step a request's drafting earns ``accepted`` tokens and costs ``per_row * verified +
proposer share`` seconds (``per_row`` fitted to whole steps: a row's forward pass and the host
work on its logits), which the batch would otherwise have spent on plain decoding at
``bar`` tokens per second: its *net* is ``accepted - bar * cost`` tokens. The controller keeps a
decayed mean of it per request (a new request starts from the method's mean) and:

- stops calling the proposer for a request whose mean net is below ``-MIN_LOSS`` tokens per
  step (drafting loses there; a plain step is what it gets instead), unless the proposer's
  own time is worth less than that (a lookup's: its rows are the adaptive length's to cut);
- *probes* a request that has had no draft verified for ``interval`` steps (its proposer off,
  or every draft cut by the adaptive draft length): that step it is proposed for and its
  drafts are verified uncut, so that the acceptance it would get is measured again, not
  assumed. A probe after which nothing changed (the proposer stays off, or the policy still
  cuts every draft) doubles the interval, up to :data:`PROBE_INTERVAL_MAX` steps: a proposer
  that only wastes time is called once in that many steps, and in a large batch, where only
  near-certain drafts pay for their rows, the probes' rows stay a few percent of a step.
  Probes also share a budget: 3% of the engine's time (:data:`PROBE_TIME_SHARE`), the longest
  idle request first. A proposer call that carries a catch-up (a request's first proposal, or
  one after steps it was left out of) charges the budget what it took beyond the usual: a
  draft model's pass over a prompt is a probe's real cost. The controller learns that cost
  per token caught up, so a probe's price includes the catch-up it will carry (a draft model
  off since the prompt runs over the whole conversation so far); a probe dearer than the
  budget holds waits until the budget has grown to its price.

A proposer whose time grows with the drafts it makes (a draft model runs a forward per draft)
is asked for no more drafts than the adaptive draft length would verify of them, each draft
counted with its share of the proposer's time as well as its row (:meth:`drafts_to_ask`): a
step on which the policy verifies two drafts does not pay for five draft forwards.

A request whose proposer was off gets the hidden states of every step it skipped at its next
proposal (the engine keeps them): a model proposer catches up over them in one call. The
proposer's usual time is learned from the calls without such a catch-up only.

A seeded request at temperature > 0 is always proposed for and verified uncut: which drafts
are verified decides which random numbers it draws, and its tokens must depend on its seed
alone. Temperature-0 output never depends on these choices (verification is lossless).
"""

from __future__ import annotations

import attrs
import numpy as np

from .adaptive import AcceptanceModel, StepCostModel, choose_draft_lengths

#: A request whose drafting loses more than this many tokens per step, on its decayed mean,
#: stops calling the proposer. A proposer whose call costs less than this (a lookup
#: proposer's tenth of a millisecond) is never switched off: the rows its drafts cost are the
#: adaptive draft length's to cut, and off it would miss the next match.
MIN_LOSS = 0.02
#: How much of its net a request keeps per draft verified in a step it is proposed for (at
#: least one a step): the last twenty drafts or so count, however many a step verifies. A mean
#: over ten steps took a run of one-draft misses for a loss: the shipped MTP head, accepted 45%
#: on chat and paying, was off for 56% of its steps (2026-12-05), 20% with twenty; a draft
#: model verifying five drafts a step is judged on about four steps, as with ten (Qwen chat:
#: 0.92-0.94x naive with a twenty-step mean, 0.96x with ten, 0.92-0.98x per draft over two
#: runs of the same drafting decisions: docs/benchmarks/decode.md).
REQUEST_DECAY = 0.95
#: How much of the method's net is kept per request-step (a new request starts from it).
SHARED_DECAY = 0.98
#: Steps without a verified draft before a request is probed, at first and at most.
PROBE_INTERVAL_MIN = 8
PROBE_INTERVAL_MAX = 64
#: The share of the engine's time that probes may take, on average (their verified rows and
#: the proposer's time): in a batch of 32 all requests are due at once, and their rows would
#: cost more than the drafts win.
PROBE_TIME_SHARE = 0.03
#: How far beyond a waiting probe's price the budget may grow (its price moves a little with
#: the step's measured costs while it waits).
PROBE_PRICE_MARGIN = 1.05
#: How much of its mean a proposer call may take before it counts as interrupted.
PROPOSER_OUTLIER_FACTOR = 3.0
#: How much of its history the fit of a proposer's time per draft keeps per call.
PROPOSER_FIT_DECAY = 0.95


class ProposerCostModel:
    """Seconds against a count, ``first + per_unit * units``, fitted to recent proposer calls
    with exponential forgetting. The controller keeps two: a call's seconds per request against
    its longest draft (``first + per_draft * drafts``: a draft model's call runs a forward per
    draft, the first one over the rows the target accepted too), and a call's seconds against
    the requests it drafted for (``first``: what a call costs however few they are, Python and
    one native call at least).

    While the calls are all about one count the two parts cannot be told apart, and the whole
    time counts per unit: the dearer guess for more units, which makes the calls differ and so
    tells them apart."""

    def __init__(self):
        # weight, units, seconds, units^2, units*seconds: floats, not an array (a few
        # microseconds less a call, on the caches a forward pass has just flushed)
        self._sums = [0.0] * 5
        self._costs: tuple[float, float] | None = None  # costs() until the next observe()

    @property
    def measured(self) -> bool:
        return self._sums[0] >= 1.0

    def observe(self, units: int, seconds: float) -> None:
        """A call of ``units`` (drafts, or requests) took ``seconds``; one far slower than the
        fit predicts (an interrupted call) counts as :data:`PROPOSER_OUTLIER_FACTOR` times it."""
        if self.measured:
            seconds = min(seconds, PROPOSER_OUTLIER_FACTOR * self.predicted(units))
        units, seconds = float(units), float(seconds)
        self._sums = [PROPOSER_FIT_DECAY * total + value
                      for total, value in zip(self._sums, (1.0, units, seconds, units * units, units * seconds))]
        self._costs = None

    def costs(self) -> tuple[float, float]:
        """``(first, per_unit)`` seconds; ``(0, 0)`` before any call."""
        if self._costs is None:
            self._costs = self._fit()
        return self._costs

    def predicted(self, units: int) -> float:
        """Seconds of a call of ``units`` by the fit (0 before any call)."""
        first, per_unit = self.costs()
        return first + per_unit * units

    def _fit(self) -> tuple[float, float]:
        weight, units, seconds, units2, units_seconds = self._sums
        if not self.measured:
            return 0.0, 0.0
        mean_units, mean_seconds = units / weight, seconds / weight
        whole = mean_seconds / max(mean_units, 1.0)
        variance = units2 / weight - mean_units ** 2
        if variance < 0.25:
            return 0.0, whole
        per_unit = (units_seconds / weight - mean_units * mean_seconds) / variance
        per_unit = min(max(per_unit, 0.1 * whole), whole)
        return max(mean_seconds - per_unit * mean_units, 0.0), per_unit


@attrs.define(slots=True)
class _RequestState:
    net: float
    proposing: bool = True
    idle_steps: int = 0  # steps in a row without a verified draft
    interval: int = PROBE_INTERVAL_MIN
    steps_since_probe: int = PROBE_INTERVAL_MAX
    verified_since_probe: bool = False  # drafts the policy chose (not a probe) were verified
    probing: bool = False
    kept: bool = False  # seeded and sampled: proposed for and verified uncut every step


class DraftController:
    """What the engine learned about one method: acceptance per draft class and position
    (:class:`AcceptanceModel`), a step's fixed and per-row cost besides the proposer
    (:class:`StepCostModel`), the proposer's time per request, and each request's on/off state.

    The engine calls, each step: :meth:`proposing` (whom to propose for), :meth:`proposer_time`
    (after the call), :meth:`draft_lengths` (how many drafts to verify), :meth:`record` (what
    was accepted), :meth:`step_time` (what the step cost besides the proposer); and
    :meth:`forget` when a request ends."""

    def __init__(self, row_curve: dict[int, float] | None = None):
        """``row_curve``: what a pass of a few rows costs on this machine (``row_costs.py``),
        the step-cost fit's prior where its steps are too alike to fit a slope."""
        self.acceptance = AcceptanceModel()
        self.step_costs = StepCostModel(row_curve=row_curve)
        #: A proposer call's seconds against the requests it drafted for (see proposer_seconds).
        self.proposer_calls = ProposerCostModel()
        #: Decoding requests at this step (set by proposing): what a call's fixed part is split over.
        self._batch_requests = 1
        #: A proposer call's time per request against its longest draft (what one more draft
        #: costs).
        self.proposer_costs = ProposerCostModel()
        #: Whether the method's drafts carry classes (``Drafts.classes``, set by the engine):
        #: a draft's chance then depends on a class known only once it is drafted.
        self.drafts_have_classes = False
        #: Whether a proposer call has returned a draft yet (:meth:`proposer_time` with drafts,
        #: or the engine after a catch-up call): until then whether drafts carry classes is not
        #: known.
        self.drafts_seen = False
        self.shared_net = 0.0
        self._requests: dict[str, _RequestState] = {}
        self._bar = 0.0  # tokens per second of this step without drafts (set by draft_lengths)
        #: Mean seconds a catch-up costs per token the proposer had not seen (None until one
        #: is measured).
        self.catch_up_seconds_per_token: float | None = None
        #: Seconds of probes the budget holds (PROBE_TIME_SHARE of every step's time, at most
        #: _probe_cap, or _probe_waiting: a little more than the price of the dearest probe it
        #: could not pay, the last time any probe was due); None until a step is measured.
        self._probe_credit: float | None = None
        self._probe_cap = 0.0
        self._probe_waiting = 0.0

    def _state(self, request_id: str) -> _RequestState:
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestState(net=self.shared_net, proposing=self._method_pays())
        return state

    def proposing(self, request_ids: list[str], always: np.ndarray, max_draft_lens: np.ndarray,
                  unseen_tokens: np.ndarray | None = None, without_proposer: np.ndarray | None = None) -> np.ndarray:
        """``[B]`` bool: the requests the proposer is called for this step: those whose
        drafting pays, those due for a probe that the probe budget covers (the longest idle
        first), and those ``always`` marks (seeded, sampled).

        ``max_draft_lens``: the most drafts each may verify; ``unseen_tokens``: the tokens of
        each the proposer has not been shown (what a probe's catch-up runs over). Together,
        what a probe of it costs. ``without_proposer`` marks the requests whose drafts this
        step come from elsewhere (their predicted output): a probe of one costs its rows only,
        and the engine does not call the proposer for it whatever this returns."""
        self._batch_requests = max(len(request_ids), 1)
        states = [self._state(request_id) for request_id in request_ids]
        due = []
        for b, (state, kept, most) in enumerate(zip(states, always.tolist(), max_draft_lens.tolist())):
            state.kept = state.probing = bool(kept)
            if not state.probing and state.idle_steps >= state.interval and most > 0:
                due.append(b)
        if due:  # the budget's ceiling follows the probes due now (set by those it cannot pay)
            self._probe_waiting = 0.0
        asks_one = bool(due) and self._asks_per_draft()  # a probe then asks for one draft
        for b in sorted(due, key=lambda b: -states[b].idle_steps):
            unseen = 0 if unseen_tokens is None else int(unseen_tokens[b])
            calls_proposer = not states[b].proposing and (without_proposer is None or not without_proposer[b])
            drafts = min(int(max_draft_lens[b]), 1) if asks_one else int(max_draft_lens[b])
            states[b].probing = self._afford_probe(drafts, calls_proposer, unseen)
        return np.array([state.proposing or state.probing for state in states], dtype=bool)

    def _afford_probe(self, drafts: int, calls_proposer: bool, catch_up_tokens: int) -> bool:
        """Whether the probe budget covers a probe of ``drafts`` drafts (their rows, and, when
        the proposer is off for the request (``calls_proposer``), its time and the catch-up
        over ``catch_up_tokens``), taking it from the budget if so. A probe dearer than the
        budget holds waits for it: the budget may then grow beyond its cap, up to that price
        (and a margin, for the price moving with the step's measured costs)."""
        if self._probe_credit is None:  # nothing measured yet
            return True
        _, per_row = self.step_costs.costs()
        cost = drafts * per_row
        if calls_proposer:
            cost += self._proposer_cost(drafts) + catch_up_tokens * (self.catch_up_seconds_per_token or 0.0)
        if self._probe_credit < cost:
            self._probe_waiting = max(self._probe_waiting, PROBE_PRICE_MARGIN * cost)
            return False
        self._probe_credit -= cost
        return True

    def proposer_time(self, num_requests: int, seconds: float, drafts: int = 0) -> None:
        """One proposer call took ``seconds`` for ``num_requests`` requests, the longest of
        its drafts ``drafts`` tokens long."""
        if num_requests <= 0:
            return
        if drafts > 0:
            self.drafts_seen = True
            self.proposer_costs.observe(drafts, seconds / num_requests)
        self.proposer_calls.observe(num_requests, seconds)

    @property
    def proposer_seconds(self) -> float | None:
        """The proposer's seconds per request at this step (None until a call is measured): its
        part per request plus the call's fixed part split over the step's decoding requests,
        what each pays of a call for all of them. Priced by what the last few calls cost each
        (a mean share), a proposer whose calls cost mostly their fixed part would look dearer
        the fewer requests it is called for, and switch more off: at batch 32 hybrid's lookup
        went from 32 requests on to 5 within a turn (2026-12-06, docs/benchmarks/batch.md)."""
        if not self.proposer_calls.measured:
            return None
        first, per_request = self.proposer_calls.costs()
        return first / self._batch_requests + per_request

    def catch_up_time(self, num_requests: int, seconds: float, tokens: int = 0,
                      request_ids: list[str] | None = None) -> None:
        """A proposer call for ``num_requests`` requests (``request_ids``) that carried a
        catch-up over ``tokens`` tokens it had not seen (see ``Engine._catching_up``) took
        ``seconds``: it teaches the catch-up's cost per token, and when one of the requests
        is probed (None: assume so), what it took beyond the proposer's usual time comes out
        of the probe budget. A probe of a draft model off since a long conversation began
        then puts the budget in debt, and the next probes wait until the engine has run long
        enough to pay for it. A new request's pass over its prompt, with the method's drafting
        paying, is what drafting it costs, not a probe's: charged to the probes, it would hold
        back the probe of a request switched off by one bad first step for hundreds of steps."""
        extra = max(seconds - self.proposer_calls.predicted(num_requests), 0.0)
        if tokens > 0:  # the first call, before the usual time is known, counts whole: an upper bound
            share = extra / tokens
            mean = self.catch_up_seconds_per_token
            self.catch_up_seconds_per_token = share if mean is None else 0.8 * mean + 0.2 * share
        probed = request_ids is None or any(self._state(r).probing for r in request_ids)
        if self._probe_credit is not None and probed:
            self._probe_credit -= extra

    def step_time(self, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` packed rows took ``seconds`` besides its proposer call:
        the forward pass and all the host work around it (packing, verifying and sampling
        each row's logits, updating), which grows with the rows too."""
        self.step_costs.observe(rows, seconds)
        self._probe_cap = PROBE_TIME_SHARE * PROBE_INTERVAL_MAX * seconds
        credit = self._probe_cap if self._probe_credit is None else self._probe_credit + PROBE_TIME_SHARE * seconds
        self._probe_credit = min(credit, max(self._probe_cap, self._probe_waiting))

    def drafts_to_ask(self, request_ids: list[str], max_draft_lens: np.ndarray, base_rows: int,
                      base_tokens: int) -> np.ndarray:
        """``[B]`` how many drafts to ask the proposer for, of the ``max_draft_lens`` each may
        verify: as many as the adaptive draft length would verify if each draft cost its
        share of the proposer's time per draft too (:class:`ProposerCostModel`), at
        least one while the first draft pays (whether to draft at all is :meth:`proposing`'s
        to say, on the mean of many steps: the chances of the first draft move too fast for
        it; but see the next paragraph). A request probed this
        step is asked for one: whether drafting pays for it is whether its first draft does
        (:meth:`record`), and the drafts after it are this cut's to choose once it is on. A
        seeded sampled request is asked for all. Call it after :meth:`proposing`.

        None (0) where the first draft cannot pay at this step's costs even at the better of
        the request's own chance and the method's shared one (:meth:`_first_draft_bar`): in a
        large batch a verify row costs most of a token, and the engine then leaves the
        request out of the proposer call instead of cutting all its drafts after it. Such a
        request is switched off, as :meth:`record` switches off one whose drafting loses: its
        probes then pay for the proposer's call and its catch-up.

        ``max_draft_lens`` where its drafts carry classes (their chances depend on a class
        known only once drafted: the verify cut still applies) or before any call has returned
        a draft (which tells whether they do); without the first cut while the proposer's time
        per draft is unmeasured or negligible. The first-draft test still applies then, with
        the proposer's mean time per request, or none before a call is timed, and a new
        method's prior chance: in a large batch a fresh engine does not run a model proposer's
        pass over every prompt before it has seen drafting pay."""
        width = int(max_draft_lens.max(initial=0))
        if width == 0 or self.drafts_have_classes or not self.drafts_seen:
            return max_draft_lens
        chances = self.acceptance.chances(request_ids, None, width)
        asked = max_draft_lens
        if width > 1 and self._asks_per_draft():
            fixed, per_row = self.step_costs.costs()
            _, per_draft = self.proposer_costs.costs()
            asked = choose_draft_lengths(max_draft_lens, chances, base_rows, base_tokens, fixed, per_row,
                                         draft_cost=per_draft)
        bar = self._first_draft_bar(base_rows, base_tokens)
        shared = self.acceptance.shared_first_chance()
        out = []
        for request_id, chance, wanted, most in zip(request_ids, chances[:, 0].tolist(), asked.tolist(),
                                                    max_draft_lens.tolist()):
            state = self._state(request_id)
            if state.kept:
                out.append(most)
            elif state.probing:
                out.append(min(1, most))
            elif max(chance, shared) <= bar:
                state.proposing = False  # off until a probe finds drafting pays again
                out.append(0)
            else:
                out.append(min(max(wanted, 1), most))
        return np.array(out, dtype=max_draft_lens.dtype)

    def row_price(self, base_rows: int, base_tokens: int) -> float:
        """What verifying one more draft costs this step, in tokens of the step without drafts
        (``base_rows`` rows emitting ``base_tokens`` tokens): the acceptance chance a draft must
        beat to pay for its own row (``ProposalBatch.row_price``). 0 before a step is measured."""
        if not self.step_costs.measured:
            return 0.0
        return self.step_costs.costs()[1] * self._tokens_per_second(base_rows, base_tokens)

    def _tokens_per_second(self, base_rows: int, base_tokens: int) -> float:
        """This step's tokens per second without drafts, by the step-cost fit (per unit of its
        relative costs before a step is measured): what turns seconds into tokens of a step."""
        fixed, per_row = self.step_costs.costs()
        return base_tokens / (fixed + per_row * base_rows)

    def _first_draft_bar(self, base_rows: int, base_tokens: int) -> float:
        """The chance a request's first draft must beat, at the better of its own chance and
        the method's shared one, to be worth its verify row and one proposer call per request
        at this step's costs (the verify cut's test for a step's first draft, the most lenient).
        The shared chance moves slowly, so a run of misses does not stop a request that pays
        on average; at batch 1 a row costs a few percent of a token and every request passes,
        at batch 32 it costs most of one and a method accepted half the time does not."""
        _, per_row = self.step_costs.costs()
        return (per_row + self._proposer_cost(1)) * self._tokens_per_second(base_rows, base_tokens)

    def draft_lengths(self, request_ids: list[str], lengths: np.ndarray, classes, base_rows: int,
                      base_tokens: int, adaptive: bool = True) -> np.ndarray:
        """``[B]`` drafts to verify of the ``lengths`` proposed: the adaptive draft length's
        cut (``adaptive``), except for the requests probed this step, which keep them all.

        ``base_rows`` / ``base_tokens``: the rows and tokens of this step without drafts."""
        fixed, per_row = self.step_costs.costs()
        # before a step is measured the costs are relative: nothing to weigh a proposer's seconds against
        self._bar = self._tokens_per_second(base_rows, base_tokens) if self.step_costs.measured else 0.0
        if not adaptive or not lengths.any():
            return lengths
        chances = self.acceptance.chances(request_ids, classes, int(lengths.max()))
        chosen = choose_draft_lengths(lengths, chances, base_rows, base_tokens, fixed, per_row)
        probing = [b for b, request_id in enumerate(request_ids) if self._state(request_id).probing]
        if probing:
            chosen = chosen.copy()
            chosen[probing] = lengths[probing]
        return chosen

    def record(self, request_ids: list[str], proposed: np.ndarray, classes, verified: np.ndarray,
               accepted: np.ndarray) -> None:
        """Fold in one step: request ``b`` was proposed for (``proposed[b]``), verified
        ``verified[b]`` drafts of class ``classes[b]`` and accepted ``accepted[b]`` of them."""
        self.acceptance.record(request_ids, classes, verified, accepted)
        _, per_row = self.step_costs.costs()
        negligible = self._proposer_negligible()
        # Before a step and a proposer call without catch-up are measured, a step's net would
        # be its accepted drafts for free: it teaches nothing (a draft model's first steps would
        # otherwise keep it on for ten steps more).
        costs_known = self._bar > 0.0 and self.proposer_seconds is not None
        for request_id, was_proposed, drafted, gained in zip(request_ids, proposed.tolist(), verified.tolist(),
                                                             accepted.tolist()):
            state = self._state(request_id)
            state.steps_since_probe += 1
            state.idle_steps = 0 if drafted else state.idle_steps + 1
            if drafted and not state.probing:
                state.verified_since_probe = True
            if not was_proposed:
                continue
            if costs_known:
                if state.probing and not state.kept and self._per_draft_costs() is not None:
                    # How many drafts a step asks for is drafts_to_ask's to choose: drafting
                    # pays if drafting one does.
                    gained, drafted = min(gained, 1), min(drafted, 1)
                net = gained - self._bar * (per_row * drafted + self._proposer_cost(drafted))
                self.shared_net = SHARED_DECAY * self.shared_net + (1.0 - SHARED_DECAY) * net
                keep = REQUEST_DECAY ** max(drafted, 1)
                state.net = net if state.probing else keep * state.net + (1.0 - keep) * net
            paying = negligible or state.net >= -MIN_LOSS
            if state.probing:
                # A probe that neither switches the proposer back on nor follows drafts the
                # policy chose to verify since the previous probe waits twice as long for the
                # next one: whether the proposer is off or its drafts are cut, it found nothing.
                if state.verified_since_probe:
                    state.interval = PROBE_INTERVAL_MIN
                elif not (paying and not state.proposing):
                    state.interval = min(2 * state.interval, PROBE_INTERVAL_MAX)
                state.probing = state.verified_since_probe = False
                state.steps_since_probe = state.idle_steps = 0
            elif state.proposing and not paying:
                # Switched off: soon after a probe switched it on, the next probe waits longer;
                # after a good while on, it comes soon again.
                longer = min(2 * state.interval, PROBE_INTERVAL_MAX)
                state.interval = longer if state.steps_since_probe <= state.interval else PROBE_INTERVAL_MIN
                state.idle_steps = 0
            state.proposing = paying

    def _asks_per_draft(self) -> bool:
        """Whether :meth:`drafts_to_ask` cuts the drafts asked for: the proposer's time per
        draft is measured and worth weighing, and the step's costs are known."""
        return (self._per_draft_costs() is not None and self.step_costs.measured
                and not self._proposer_negligible())

    def _per_draft_costs(self) -> tuple[float, float] | None:
        """The proposer's ``(first, per_draft)`` seconds per request where drafts are asked
        for by that measure (:meth:`drafts_to_ask`: drafts without classes), else None."""
        if self.drafts_have_classes or not self.proposer_costs.measured:
            return None
        return self.proposer_costs.costs()

    def _proposer_cost(self, drafts: int) -> float:
        """Seconds of the proposer's time for one request drafting ``drafts`` tokens (a call
        costs at least one): by its time per draft where that is the measure, else its mean
        time per request."""
        costs = self._per_draft_costs()
        if costs is not None:
            first, per_draft = costs
            return first + per_draft * max(drafts, 1)
        return self.proposer_seconds or 0.0

    def _proposer_negligible(self) -> bool:
        """Whether a proposer call costs less than :data:`MIN_LOSS` tokens of a plain step."""
        return self._bar * (self.proposer_seconds or 0.0) < MIN_LOSS

    def _method_pays(self) -> bool:
        """Whether a new request starts with the proposer on: the method's drafting has paid
        on the whole, or its proposer costs next to nothing."""
        return self._proposer_negligible() or self.shared_net >= -MIN_LOSS

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)
        self._requests.pop(request_id, None)
