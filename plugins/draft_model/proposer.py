"""The ``draft_model`` method: a smaller model with the target's tokenizer drafts k tokens ahead.

Each step, for every request that may draft, the draft model first catches up: one row per
token it has not run yet (the prompt at the first proposal, then the tokens the target
appended; after a step that accepted drafts, their rows are already there). The last of those
rows predicts draft 1; then the model runs one row per request and draft, feeding each draft
back in, up to the request's ``max_draft_len`` (vLLM's and the seed system's
``num_speculative_tokens``). All requests run in one batched forward per round, on the
target's kernels, with the draft's KV cache over the request's own blocks
(:meth:`specdec.ProposerContext.load_model`).

A draft whose top probability falls below ``draft_p_min`` ends the request's draft there (as
llama.cpp's ``--draft-p-min``): the draft model's next forward would mostly be wasted. At
temperature > 0 drafts are sampled from the draft's distribution processed like the target's,
which goes with them as ``Drafts.probs`` so that ``rejection`` stays lossless.

Which of the cache's rows hold the draft's keys and values is tracked per request
(:class:`_RequestState`). A prefix-cache hit is trusted block by block only where the draft
itself wrote that block for the same prefix (a chained hash of the tokens): a block another
request filled while its draft was switched off holds no draft rows, and is run again.
"""

from __future__ import annotations

from typing import Optional

import attrs
import numpy as np

import specdec
from specdec.sdk import (AttentionMetadata, ConfigError, Drafts, ProposalBatch, ProposalRequest, SpecdecError,
                         in_range, processed_probs, resolve_model_path, sample_tokens)


@attrs.define(frozen=True, kw_only=True)
class DraftModelConfig:
    """Flat keys of ``--speculative-config`` for ``method: draft_model`` (besides ``model``,
    ``quantization`` and ``num_speculative_tokens``).

    :ivar draft_p_min: stop a request's draft after a token the draft model gave less than
        this probability (0 drafts ``num_speculative_tokens`` always).
    """

    draft_p_min: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))


@attrs.define(slots=True)
class _RequestState:
    """What the draft model's cache holds for one request.

    :ivar cached: the draft's rows are valid below this position (tokens of the request).
    :ivar next_position: the first hidden position the next proposal should bring (None
        before the target has run: a request's first proposal may come before its prompt's
        forward); another one means the target started over (a preemption).
    :ivar blocks: the request's block table at the last proposal; blocks only get added to
        it, unless the request was preempted.
    :ivar ahead: ``(position, tokens)``: rows written past ``cached`` for the last step's
        drafts, valid where the target accepted them.
    :ivar block_hashes: chained hashes of the request's full blocks whose rows the draft
        wrote, in order (see :attr:`DraftModelProposer._filled`).
    """

    cached: int = 0
    next_position: Optional[int] = None
    blocks: Optional[np.ndarray] = None
    ahead: Optional[tuple[int, np.ndarray]] = None
    block_hashes: list[int] = attrs.Factory(list)


class DraftModelProposer(specdec.Proposer):
    """A draft model of the target's tokenizer, run k autoregressive steps per step."""

    NAME = "draft_model"
    Config = DraftModelConfig
    #: For ``block_table`` and ``hidden_positions`` (where the target computed from: a cached
    #: prefix, a recomputation); the states themselves are not read.
    NEEDS_HIDDEN_STATES = True
    USED_MODEL_KEYS = frozenset({"model", "quantization"})

    def __init__(self, config: DraftModelConfig | None = None, spec_config=None):
        super().__init__(config or DraftModelConfig(), spec_config)

    @classmethod
    def check_config(cls, spec_config) -> None:
        """The draft model is named and found (before the target loads)."""
        if not spec_config.model:
            raise ConfigError("model: draft_model needs the draft model (a GGUF file, a checkpoint directory or "
                              "an alias), as in {\"method\": \"draft_model\", \"model\": \"draft.gguf\"}")
        try:
            resolve_model_path(spec_config.model, "model")
        except SpecdecError as exc:
            raise ConfigError(str(exc)) from None

    def setup(self, context: specdec.ProposerContext) -> None:
        spec = self.spec_config
        self.check_config(spec)  # also when built by another method (hybrid)
        self.draft = context.load_model(spec.model, quantization=spec.quantization)
        self.block_size = context.block_size
        self.vocab_size = self.draft.vocab_size
        self._fallback_rng = np.random.default_rng(0)  # for requests built without a generator
        self._requests: dict[str, _RequestState] = {}
        #: Block id -> chained hash of the tokens up to its end, for blocks whose rows the
        #: draft wrote: a prefix-cache hit on such a block (same hash) needs no recomputation.
        self._filled: dict[int, int] = {}

    def on_request_finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def propose(self, batch: ProposalBatch) -> Drafts:
        drafts: list[list[int]] = [[] for _ in batch.requests]
        drafting = []
        for b, request in enumerate(batch.requests):
            state = self._synced(request)
            if request.max_draft_len > 0:
                drafting.append((b, request, state))
        if not drafting:
            return Drafts.from_lists(drafts)
        probs = self._draft(drafting, drafts)
        return Drafts.from_lists(drafts, probs=probs)

    # -- the cache's bookkeeping -------------------------------------------------------------

    def _synced(self, request: ProposalRequest) -> _RequestState:
        """The request's state, brought up to this step: where the target (re)starts it (a new
        request, a recomputation after preemption), the blocks the draft filled for the same
        tokens; then the rows of last step's drafts that the target accepted."""
        state = self._requests.get(request.request_id)
        positions = request.hidden_positions
        table = request.block_table
        if state is None or _restarted(state, positions, table):
            state = self._requests[request.request_id] = _RequestState()
            state.cached = self._trusted_prefix(request, state)
        if positions is not None and len(positions):
            state.next_position = int(positions[-1]) + 1
        if table is not None:
            state.blocks = table.copy()
        if state.ahead is not None:
            position, tokens = state.ahead
            state.ahead = None
            if position == state.cached:
                actual = request.token_ids[position: position + len(tokens)]
                same = actual == tokens[: len(actual)]
                state.cached += len(same) if same.all() else int(np.argmin(same))
        state.cached = min(state.cached, len(request.token_ids) - 1)
        return state

    def _trusted_prefix(self, request: ProposalRequest, state: _RequestState) -> int:
        """How many leading positions of the request's blocks hold the draft's rows for its
        tokens: whole blocks the draft itself filled for the same tokens before them (such as a
        prefix another request shares), up to the last token (whose row gives the logits)."""
        table = request.block_table
        if table is None:
            return 0
        size = self.block_size
        digest = 0
        for index in range(min((len(request.token_ids) - 1) // size, len(table))):
            digest = hash((digest, request.token_ids[index * size: (index + 1) * size].tobytes()))
            if self._filled.get(int(table[index])) != digest:
                break
            state.block_hashes.append(digest)
        return len(state.block_hashes) * size

    def _overwriting(self, table: np.ndarray, start: int, end: int) -> None:
        """Positions ``start .. end - 1`` of a request are about to be written: their blocks no
        longer hold what :attr:`_filled` says (until :meth:`_record_filled` says it again)."""
        for index in range(start // self.block_size, (end - 1) // self.block_size + 1):
            self._filled.pop(int(table[index]), None)

    def _record_filled(self, request: ProposalRequest, state: _RequestState) -> None:
        """Note the full blocks below ``state.cached`` as filled by the draft for their prefix."""
        size, table = self.block_size, request.block_table
        digest = state.block_hashes[-1] if state.block_hashes else 0
        for index in range(len(state.block_hashes), state.cached // size):
            digest = hash((digest, request.token_ids[index * size: (index + 1) * size].tobytes()))
            state.block_hashes.append(digest)
            self._filled[int(table[index])] = digest

    # -- drafting ----------------------------------------------------------------------------

    def _draft(self, drafting, drafts: list[list[int]]) -> Optional[np.ndarray]:
        """Round 1 catches each request up and drafts its first token; round ``j`` runs one row
        per request still drafting, its draft ``j - 1`` at its position. Returns
        ``Drafts.probs`` when a draft was sampled."""
        requests = [request for _, request, _ in drafting]
        starts = [state.cached for _, _, state in drafting]
        query_lens = [len(r.token_ids) - start for r, start in zip(requests, starts)]
        tokens = np.concatenate([r.token_ids[start:] for r, start in zip(requests, starts)])
        meta = AttentionMetadata.build(query_lens, starts, [r.block_table for r in requests],
                                       self.block_size)
        for request, start in zip(requests, starts):
            self._overwriting(request.block_table, start, len(request.token_ids))
        logits = self.draft.forward(tokens, meta, np.cumsum(query_lens) - 1)
        for request, (_, _, state) in zip(requests, drafting):
            state.cached = len(request.token_ids)
            self._record_filled(request, state)
        sampled: dict[int, list[np.ndarray]] = {}
        active = list(range(len(drafting)))
        while True:
            chosen, probs, confident = self._choose(logits, [requests[k] for k in active])
            for row, k in enumerate(active):
                drafts[drafting[k][0]].append(int(chosen[row]))
                if probs is not None:
                    sampled.setdefault(drafting[k][0], []).append(probs[row])
            keep = [row for row, k in enumerate(active)
                    if confident[row] and len(drafts[drafting[k][0]]) < requests[k].max_draft_len]
            if not keep:
                break
            active = [active[row] for row in keep]
            # Draft j - 1 sits at position len(token_ids) + j - 2 (j - 1 drafts so far).
            positions = [len(requests[k].token_ids) + len(drafts[drafting[k][0]]) - 1 for k in active]
            for k, position in zip(active, positions):
                self._overwriting(requests[k].block_table, position, position + 1)
            meta = AttentionMetadata.build([1] * len(active), positions,
                                           [requests[k].block_table for k in active], self.block_size)
            logits = self.draft.forward(chosen[keep], meta, np.arange(len(active)))
        for b, request, state in drafting:
            written = drafts[b][:-1]  # the rows fed back in; the last draft's row is not computed
            if written:
                state.ahead = (len(request.token_ids), np.asarray(written, dtype=np.int64))
        return self._probs_array(sampled, drafts)

    def _choose(self, logits: np.ndarray, requests: list[ProposalRequest]):
        """Each row's draft (the argmax for a greedy request, else a sample from the processed
        distribution, returned too), and whether its probability reached ``draft_p_min``."""
        p_min = self.config.draft_p_min
        if all(r.temperature <= 0.0 for r in requests):
            chosen = logits.argmax(axis=-1)
            if p_min <= 0.0:
                return chosen, None, np.ones(len(requests), dtype=bool)
            top = logits.max(axis=-1, keepdims=True)
            confidence = 1.0 / np.exp(logits - top).sum(axis=-1)  # the argmax's softmax probability
            return chosen, None, confidence >= p_min
        temperature = np.array([r.temperature for r in requests])
        top_k = np.array([0 if r.sampling is None else r.sampling.top_k for r in requests], dtype=np.int64)
        top_p = np.array([1.0 if r.sampling is None else r.sampling.top_p for r in requests])
        probs = processed_probs(logits[:, None, :], temperature, top_k, top_p)[:, 0]
        uniforms = np.array([(r.rng or self._fallback_rng).random() if r.temperature > 0.0 else 0.0
                             for r in requests])
        chosen = sample_tokens(probs[:, None], uniforms[:, None])[:, 0]
        confidence = probs[np.arange(len(requests)), chosen]
        return chosen, probs, confidence >= p_min

    def _probs_array(self, sampled: dict[int, list[np.ndarray]], drafts: list[list[int]]) -> Optional[np.ndarray]:
        """``Drafts.probs``, ``[B, k, V]``: each sampled draft's distribution; ``None`` when no
        draft was sampled."""
        if not sampled:
            return None
        width = max(len(d) for d in drafts)
        out = np.zeros((len(drafts), width, self.vocab_size), dtype=np.float32)
        for row, rows in sampled.items():
            out[row, : len(rows)] = rows
        return out


def _restarted(state: _RequestState, positions: Optional[np.ndarray], table: Optional[np.ndarray]) -> bool:
    """Whether the target started the request over since its last proposal (preempted and
    recomputed): its hidden states restart before where they left off, or its blocks changed."""
    if positions is not None and len(positions) and state.next_position is not None \
            and int(positions[0]) != state.next_position:
        return True
    known = state.blocks
    return known is not None and table is not None and not np.array_equal(table[: len(known)], known)
