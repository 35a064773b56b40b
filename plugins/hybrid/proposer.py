"""The ``hybrid`` method: a model proposer drafts first, a lookup proposer continues the draft.

As FastDeploy's ``mtp_strategy: with_ngram``: each step the model proposer (``mtp``)
drafts up to ``num_model_steps`` tokens; then the lookup proposer (``ngram``) continues from
the request's tokens followed by those drafts, up to ``num_speculative_tokens`` in all. Where
the model drafts nothing (a request whose state it has not caught up with), the lookup drafts
alone. Where the lookup matches the context on its own, its draft may go first and alone
instead: by default when drafts of that match length have been accepted at least as well as
the model's (learned per step from what the target accepted: ``leader.py``); with
``draft_lookup_first: n`` whenever the match is ``n`` tokens or longer; with 0 never
(FastDeploy's order). A request the lookup leads skips the model that step: its hidden
states wait in the proposer and go to the model with its next model-first step, in one
catch-up. Both parts are other registered proposers, built through the public
:meth:`specdec.ProposerContext.create_proposer`; any model proposer and any proposer that
drafts from a request's own tokens compose this way.

The lookup proposer sees each request twice. On the context alone (the lookup-first match) it
sees a request of its own that lives as long as the real one and grows with its accepted
tokens, as it would running on its own: its index is extended, not rebuilt, each step. After
the model's drafts it sees a one-step request holding the context plus those drafts (as
prompt), started and finished around its ``propose`` call: drafts that the target may reject
never enter its per-request state.
"""

from __future__ import annotations

import time
from typing import Optional

import attrs
import numpy as np

import specdec
from specdec.sdk import Drafts, ProposalBatch, ProposalRequest, in_range, one_of, require_paddle

from .leader import MODEL, LeaderStats

#: Appended to a request id for the lookup proposer's one-step request (context + drafts).
LOOKUP_SUFFIX = "/hybrid-lookup"
#: Appended to a request id for the lookup proposer's request on the context alone, which
#: lives as long as the real request.
CONTEXT_SUFFIX = "/hybrid-context"


@attrs.define(frozen=True, kw_only=True)
class HybridConfig:
    """Flat keys of ``--speculative-config`` for ``method: hybrid``.

    :ivar draft_model_method: the proposer that drafts first (a registered method name).
    :ivar draft_lookup_method: the proposer that continues the draft.
    :ivar draft_lookup_first: when the lookup, on the context alone, matches a suffix of at
        least this many tokens (its ``Drafts.classes``), its draft goes first and the model
        drafts nothing for that request this step; 0 never (FastDeploy's order); ``None``
        (the default) where drafts of that match length have been accepted at least as well
        as the model's (``leader.py``). A long match is a near-certain draft the model's
        would only cut short.
    :ivar mtp_strategy: FastDeploy's key: ``with_ngram`` with ``method: mtp`` selects this
        method; it changes nothing here.
    """

    draft_model_method: str = "mtp"
    draft_lookup_method: str = "ngram"
    draft_lookup_first: Optional[int] = attrs.field(default=None, validator=attrs.validators.optional(in_range(0, 64)))
    mtp_strategy: str = attrs.field(default="default", validator=one_of("default", "with_ngram"))


class HybridProposer(specdec.Proposer):
    """Model drafts (``num_model_steps`` of them), then lookup drafts after them."""

    NAME = "hybrid"
    Config = HybridConfig
    USED_MODEL_KEYS = frozenset({"num_model_steps", "model", "quantization"})
    #: FastDeploy's spelling of this method.
    ALSO_SELECTED_BY = ({"method": "mtp", "mtp_strategy": "with_ngram"},)
    #: FastDeploy's spelling: MTP drafts 2 tokens, ngram continues them.
    DEMO_CONFIG = {"method": "mtp", "mtp_strategy": "with_ngram", "num_model_steps": 2, "num_speculative_tokens": 5}
    #: Follows the model proposer's (set in :meth:`setup`).
    NEEDS_HIDDEN_STATES = True

    def __init__(self, config: HybridConfig | None = None, spec_config=None):
        super().__init__(config or HybridConfig(), spec_config)

    def setup(self, context: specdec.ProposerContext) -> None:
        if self.config.draft_model_method == self.NAME or self.config.draft_lookup_method == self.NAME:
            raise specdec.SpecdecError("draft_model_method and draft_lookup_method must name other methods")
        self.model = context.create_proposer(self.config.draft_model_method)
        self.lookup = context.create_proposer(self.config.draft_lookup_method)
        self.NEEDS_HIDDEN_STATES = bool(self.model.NEEDS_HIDDEN_STATES)
        #: Whether the model can catch up at the end of a step (its ``catch_up``); this
        #: proposer asks for it (``CATCHES_UP_AFTER_STEP``) at the steps where it has a request to
        #: start it for (``catch_up``), and otherwise takes the states with the next proposal.
        self._model_catches_up = self.NEEDS_HIDDEN_STATES and bool(self.model.CATCHES_UP_AFTER_STEP)
        self.CATCHES_UP_AFTER_STEP = False
        self.model_steps = self.spec_config.num_model_steps if self.spec_config is not None else 1
        self.leaders = LeaderStats()
        #: Decayed means of the model's seconds per request and of the time between two
        #: proposals (a step): the model's cost in tokens of a step, for the leader choice.
        self._model_seconds = 0.0
        self._lookup_seconds = 0.0  # the continuation lookup's, per request
        self._step_seconds = 0.0
        self._last_proposal: float | None = None
        #: Per request: the kind of draft it got this step (leader.py), until on_step.
        self._led: dict[str, int] = {}
        #: Per request whose model drafts the lookup continued this step: how many model drafts.
        self._continued: dict[str, int] = {}
        #: Per request led by the lookup: the hidden states the model has not seen yet.
        self._waiting: dict[str, list[tuple[object, np.ndarray]]] = {}
        #: Requests the model drafted for at the current step, the lookup matching nothing
        #: (their catch-up runs at its end).
        self._model_led: set[str] = set()
        self._catch_up_seconds = 0.0  # the model's catch_up since its last propose
        #: Requests whose context request the lookup has started (:meth:`_matches`).
        self._context_started: set[str] = set()
        #: This step's context requests, by real request id, for the lookup's ``on_step``.
        self._context_requests: dict[str, ProposalRequest] = {}

    def hidden_state_layers(self):
        """The model proposer's (hybrid hands it the states as they come)."""
        return self.model.hidden_state_layers()

    def on_request_start(self, request: ProposalRequest) -> None:
        self.model.on_request_start(request)

    def on_step(self, batch: ProposalBatch, accepted: list[np.ndarray]) -> None:
        context_rows = []
        for request, tokens in zip(batch.requests, accepted):
            kind = self._led.pop(request.request_id, None)
            if kind is not None:  # all but the last token appended were accepted drafts
                self.leaders.record(kind, max(len(tokens) - 1, 0))
            model_drafts = self._continued.pop(request.request_id, None)
            if model_drafts is not None:
                self.leaders.record_continuation(max(len(tokens) - 1 - model_drafts, 0))
            context = self._context_requests.pop(request.request_id, None)
            if context is not None:
                context_rows.append((context, tokens))
        self._context_requests.clear()
        if context_rows:
            self.lookup.on_step(ProposalBatch([c for c, _ in context_rows]), [t for _, t in context_rows])
        self.model.on_step(batch, accepted)

    def catch_up(self, batch: ProposalBatch) -> None:
        """The model's catch-up at the end of the step (its ``catch_up``) for the requests it
        drafted for at this step where the lookup matched nothing: those it most likely drafts
        for at the next (where the lookup matched, it may well lead the next step, and the
        catch-up would be spent for nothing), and those bringing their prompt's states (which
        never wait: see :meth:`propose`). The others' states wait for the model's next turn,
        as those of a request the lookup leads."""
        ahead = [r for r in batch.requests if r.request_id in self._model_led or _hands_prompt_states(r)]
        for request in batch.requests:
            if request.request_id not in self._model_led and not _hands_prompt_states(request):
                self._wait(request)
        self._model_led.clear()
        if ahead:
            started = time.perf_counter()
            self.model.catch_up(ProposalBatch(ahead))
            self._catch_up_seconds += time.perf_counter() - started

    def on_request_finish(self, request_id: str) -> None:
        self._led.pop(request_id, None)
        self._continued.pop(request_id, None)
        self._waiting.pop(request_id, None)
        if request_id in self._context_started:
            self._context_started.discard(request_id)
            self.lookup.on_request_finish(request_id + CONTEXT_SUFFIX)
        self.model.on_request_finish(request_id)

    def propose(self, batch: ProposalBatch) -> Drafts:
        """Per request, the lookup's own draft where it leads, else model drafts then lookup
        drafts after them. Classes: 0 for a model-first draft, the matched length for a
        lookup-first one (the adaptive draft length learns each kind's acceptance)."""
        self.leaders.next_step()
        self._time_step()
        rest: dict[int, list[int]] = {}
        classes = np.zeros(len(batch), dtype=np.int64)
        matches = self._matches(batch)
        model_pays = self._model_pays(batch)
        for b, (draft, matched) in matches.items():
            reproducible = batch.requests[b].reproducible
            if self._lookup_leads(matched, len(batch), reproducible) or not (model_pays or reproducible):
                rest[b], classes[b] = draft, matched
                self._led[batch.requests[b].request_id] = self.leaders.kind(matched)
        skipped = [] if model_pays else [b for b, r in enumerate(batch.requests) if b not in rest and not r.reproducible]
        if skipped:
            self.leaders.skip_model()
            if self.leaders.retry_due(MODEL):
                skipped = skipped[1:]  # one request measures the model again
        left_out = set(skipped)  # (a list's membership test would cost a batch of 256 65k comparisons a step)
        model_rows = [b for b in range(len(batch)) if b not in rest and b not in left_out]
        # Prompt states never wait: the engine shares a prompt's blocks once they are handed
        # over, and a request that shares them must find the model's rows there.
        prompt_rows = [b for b in [*rest, *skipped] if _hands_prompt_states(batch.requests[b])]
        catching_up_now = set(prompt_rows)
        for b in [*rest, *skipped]:
            if b not in catching_up_now:
                self._wait(batch.requests[b])
        model_requests = [attrs.evolve(batch.requests[b], max_draft_len=min(batch.requests[b].max_draft_len,
                                                                            self.model_steps)) for b in model_rows]
        model_requests += [attrs.evolve(batch.requests[b], max_draft_len=0) for b in prompt_rows]  # no drafts
        model_batch = ProposalBatch([self._with_waiting_states(request) for request in model_requests])
        model_drafts = Drafts.empty(len(batch))
        self._model_led = {batch.requests[b].request_id for b in model_rows if b not in matches}
        self.CATCHES_UP_AFTER_STEP = self._model_catches_up and bool(self._model_led)
        if model_requests:
            started = time.perf_counter()
            model_drafts = self.model.propose(model_batch).clipped(
                np.array([r.max_draft_len for r in model_batch.requests], dtype=np.int64)).placed(
                    model_rows + prompt_rows, len(batch))
            seconds = time.perf_counter() - started + self._catch_up_seconds
            self._catch_up_seconds = 0.0
            self._model_seconds = _decayed(self._model_seconds, seconds / len(model_requests))
        first = model_drafts.to_lists()
        for b in model_rows:
            if first[b]:
                self._led[batch.requests[b].request_id] = MODEL
        lookups = []
        continue_them = self.leaders.continuation_pays(self._lookup_cost(len(batch)))
        for b in model_rows:
            if batch.requests[b].max_draft_len <= len(first[b]):
                continue
            context_draft = matches.get(b, ([], 0))[0]
            agreed = _agreed_continuation(context_draft, first[b])
            if not first[b] and self.config.draft_lookup_first == 0:  # no match looked up yet
                lookups.append((b, self._lookup_request(batch.requests[b], [])))
            elif not first[b]:  # the model drafted nothing: the lookup's draft on the context alone
                rest[b] = context_draft
            elif agreed is not None:  # the context's match goes on past the model's drafts: no lookup
                rest[b] = agreed[: batch.requests[b].max_draft_len - len(first[b])]
            elif continue_them or batch.requests[b].reproducible:  # a seeded one's drafts: its own tokens only
                lookups.append((b, self._lookup_request(batch.requests[b], first[b])))
        if lookups:
            started = time.perf_counter()
            found = self._look_up([request for _, request in lookups])
            self._lookup_seconds = _decayed(self._lookup_seconds, (time.perf_counter() - started) / len(lookups))
            for row, (b, _) in enumerate(lookups):
                rest[b] = found.token_ids[row, : found.lengths[row]].tolist()
                if first[b]:  # a continuation, paid for whether it found anything or not
                    self._continued[batch.requests[b].request_id] = len(first[b])
        drafts = [first[b] + rest.get(b, []) for b in range(len(batch))]
        return Drafts.from_lists(drafts, probs=self._probs(model_drafts, drafts), classes=classes)

    def _lookup_leads(self, matched: int, batch_size: int, reproducible: bool) -> bool:
        """Whether the lookup's draft on a match of ``matched`` tokens goes first. The learned
        choice weighs timing and every request's acceptance, so a ``reproducible`` request
        (seeded, sampled) takes the model first unless ``draft_lookup_first`` is set."""
        setting = self.config.draft_lookup_first
        if setting is None and reproducible:
            return False
        if setting is None:
            return self.leaders.lookup_leads(matched, self._model_cost(batch_size))
        return 0 < setting <= matched

    def _model_pays(self, batch: ProposalBatch) -> bool:
        """Whether to run the model this step: its first-led drafts have been accepted at
        least a verified row's price and its own time, in tokens (always under a set
        ``draft_lookup_first``, whose order the user chose)."""
        if self.config.draft_lookup_first is not None:
            return True
        return self.leaders.model_pays(batch.row_price + self._model_cost(len(batch)))

    def _time_step(self) -> None:
        """Time between two proposals: about a step (the engine proposes once a step)."""
        now = time.perf_counter()
        if self._last_proposal is not None:
            interval = now - self._last_proposal
            if self._step_seconds:  # a gap (steps without a proposal, an idle engine) is not a step
                interval = min(interval, 3.0 * self._step_seconds)
            self._step_seconds = _decayed(self._step_seconds, interval)
        self._last_proposal = now

    def _model_cost(self, batch_size: int) -> float:
        """The model's time for one request in tokens: the batch emits about ``batch_size``
        tokens a step, so a step's time is worth that many."""
        if not self._step_seconds:
            return 0.0
        return min(batch_size * self._model_seconds / self._step_seconds, 1.0)

    def _lookup_cost(self, batch_size: int) -> float:
        """A continuation lookup's time for one request in tokens (as :meth:`_model_cost`)."""
        if not self._step_seconds:
            return 0.0
        return min(batch_size * self._lookup_seconds / self._step_seconds, 1.0)

    def _matches(self, batch: ProposalBatch) -> dict[int, tuple[list[int], int]]:
        """Per batch row that may draft: the lookup's draft on the context alone and its
        matched length, where it found one (none with ``draft_lookup_first: 0``)."""
        rows = [b for b, r in enumerate(batch.requests) if r.max_draft_len > 0]
        if not rows or self.config.draft_lookup_first == 0:
            return {}
        requests = []
        for b in rows:
            request = batch.requests[b]
            context = _context_request(request)
            if request.request_id not in self._context_started:
                self._context_started.add(request.request_id)
                self.lookup.on_request_start(attrs.evolve(context, max_draft_len=0))
            self._context_requests[request.request_id] = context
            requests.append(context)
        found = self.lookup.propose(ProposalBatch(requests)).clipped(
            np.array([r.max_draft_len for r in requests], dtype=np.int64))
        if found.classes is None:
            return {}
        return {b: (found.token_ids[row, : found.lengths[row]].tolist(), int(found.classes[row]))
                for row, b in enumerate(rows) if found.lengths[row] > 0}

    def _wait(self, request: ProposalRequest) -> None:
        """Keep the hidden states of a request the model skips this step for its next turn."""
        if request.hidden_positions is not None and len(request.hidden_positions):
            self._waiting.setdefault(request.request_id, []).append((request.hidden_states,
                                                                     np.asarray(request.hidden_positions)))

    def _with_waiting_states(self, request: ProposalRequest) -> ProposalRequest:
        """``request`` with the states that waited for it in front of its own (dropped when
        its own start again at or before them: it was preempted and recomputes)."""
        waiting = self._waiting.pop(request.request_id, None)
        if not waiting or request.hidden_positions is None:
            return request
        positions = np.asarray(request.hidden_positions)
        if len(positions) and int(positions[0]) <= int(waiting[-1][1][-1]):
            return request
        parts = [states for states, _ in waiting] + ([request.hidden_states] if len(positions) else [])
        request.hidden_states = require_paddle().concat(parts, axis=0)
        request.hidden_positions = np.concatenate([p for _, p in waiting] + [positions])
        return request

    @staticmethod
    def _lookup_request(request: ProposalRequest, drafted: list[int]) -> ProposalRequest:
        """The lookup's one-step request: ``request``'s context and ``drafted`` as its prompt
        (its tenant too: a lookup that keeps other requests' text, ``suffix``, keeps tenants apart)."""
        tokens = np.concatenate([request.token_ids, np.asarray(drafted, dtype=np.int64)])
        return ProposalRequest(request.request_id + LOOKUP_SUFFIX, tokens, len(tokens),
                               request.max_draft_len - len(drafted), sampling=request.sampling, rng=request.rng,
                               tenant=request.tenant)

    def _look_up(self, requests: list[ProposalRequest]) -> Drafts:
        """The lookup proposer's drafts for one-step requests (started and finished here)."""
        for request in requests:
            self.lookup.on_request_start(attrs.evolve(request, max_draft_len=0))
        try:
            drafts = self.lookup.propose(ProposalBatch(requests))
        finally:
            for request in requests:
                self.lookup.on_request_finish(request.request_id)
        return drafts.clipped(np.array([r.max_draft_len for r in requests], dtype=np.int64))

    @staticmethod
    def _probs(model_drafts: Drafts, drafts: list[list[int]]) -> np.ndarray | None:
        """``Drafts.probs`` when the model sampled its drafts: its distributions, then one-hot
        rows for the lookup's drafts (a deterministic function of the tokens before them)."""
        if model_drafts.probs is None:
            return None
        width = max(len(d) for d in drafts)
        probs = np.zeros((len(drafts), width, model_drafts.probs.shape[-1]), dtype=np.float32)
        probs[:, : model_drafts.width] = model_drafts.probs[:, :width]
        for row, draft in enumerate(drafts):
            for position in range(int(model_drafts.lengths[row]), len(draft)):
                probs[row, position, draft[position]] = 1.0
        return probs


def _hands_prompt_states(request: ProposalRequest) -> bool:
    """Whether ``request`` brings hidden states of its prompt's positions (its first proposal,
    or the first after a recomputation)."""
    positions = request.hidden_positions
    return positions is not None and len(positions) > 0 and int(positions[0]) < request.num_prompt_tokens - 1


def _context_request(request: ProposalRequest) -> ProposalRequest:
    """The lookup's request on ``request``'s context alone, which lives as long as it does
    (its prompt, its tenant, its sampling: a lookup treats it as it would the request)."""
    return ProposalRequest(request.request_id + CONTEXT_SUFFIX, request.token_ids, request.num_prompt_tokens,
                           request.max_draft_len, sampling=request.sampling, rng=request.rng, tenant=request.tenant)


def _agreed_continuation(context_draft: list[int], model_draft: list[int]) -> list[int] | None:
    """What the lookup's draft on the context alone says follows the model's drafts, where it
    begins with them (its match, followed by the model's tokens, is a match of the context plus
    those drafts, which a lookup would find again); None where they differ or either is empty."""
    n = len(model_draft)
    if n == 0 or len(context_draft) <= n or context_draft[:n] != model_draft:
        return None
    return context_draft[n:]


def _decayed(mean: float, sample: float) -> float:
    """A decayed mean (a tenth of each new sample) that starts at its first sample (0: none yet)."""
    return sample if not mean else 0.9 * mean + 0.1 * sample
