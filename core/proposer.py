"""The proposer contract: what a speculative method receives each step and what it returns.

A proposer drafts up to ``max_draft_len`` tokens per request; the target model then verifies
all of them in one forward pass. Third-party methods subclass :class:`Proposer` and register
it through the ``specdec_register_proposers`` hook (see :mod:`specdec.hookspecs`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Optional, Sequence

import attrs
import numpy as np

from .plugin import Plugin

#: Value written into the padding of ``Drafts.token_ids``; never a real token id.
DRAFT_PAD = -1


@attrs.define(slots=True)
class ProposalRequest:
    """One request as a proposer sees it.

    :ivar request_id: unique id of the request for the lifetime of the engine.
    :ivar token_ids: int64 numpy array, the prompt tokens followed by every generated token.
        It is a read-only view into the engine's buffer: do not keep it across steps.
    :ivar num_prompt_tokens: how many of ``token_ids`` are the prompt.
    :ivar max_draft_len: the most drafts the engine will verify for this request this step
        (0 means: propose nothing).
    :ivar hidden_states: for a proposer with ``NEEDS_HIDDEN_STATES`` (else ``None``): ``[n, H]``
        float32, the target's last-layer hidden states (before the final norm; ``[n,
        len(layers) * H]``, those layers' states side by side, for a proposer whose
        :meth:`Proposer.hidden_state_layers` names layers) at the positions the target
        computed since this request's previous proposal whose next token is now decided; after a prefill, every prompt position the target computed (positions
        served from the prefix cache are not computed). Rows of rejected drafts are never
        passed. A paddle tensor on the model's device; ``numpy.asarray`` of it works.
    :ivar hidden_positions: ``[n]`` int64 with ``hidden_states``: ``hidden_states[i]`` is the
        state at position ``hidden_positions[i]``, and ``token_ids[hidden_positions[i] + 1]`` is
        the token that followed it. Increasing; a preempted request starts again from the
        positions it recomputes.
    :ivar block_table: for a proposer with ``NEEDS_HIDDEN_STATES``: ``[num_blocks]`` int32, the
        request's KV cache blocks in position order, for the proposer's own cache layers
        (:meth:`specdec.ProposerContext.create_cache_layers`). Read-only.
    :ivar sampling: the request's :class:`specdec.SamplingParams` (``None``: greedy). A
        proposer that samples its drafts (a model at temperature > 0) samples them from its
        own distribution processed the same way (``processed_probs``) and returns it as
        ``Drafts.probs``, which keeps ``rejection`` lossless and accepts more than argmax
        drafts do.
    :ivar rng: the request's own random generator (``None`` outside the engine). Draw the
        draft's randomness from it, never from a global one, so that a seeded request
        repeats its tokens.
    :ivar tenant: who sent the request: an opaque id the server derives from the API key it
        came with (None without one, and outside the server). A proposer that learns from
        finished requests can keep tenants apart with it (``suffix``'s cache scope), so that
        one tenant's text never drafts for another.
    """

    request_id: str
    token_ids: np.ndarray
    num_prompt_tokens: int
    max_draft_len: int
    hidden_states: Any = None
    hidden_positions: Optional[np.ndarray] = None
    block_table: Optional[np.ndarray] = None
    sampling: Any = None
    rng: Optional[np.random.Generator] = None
    tenant: Optional[str] = None

    @property
    def temperature(self) -> float:
        """The request's temperature (0: greedy, also without ``sampling``)."""
        return 0.0 if self.sampling is None else float(self.sampling.temperature)

    @property
    def reproducible(self) -> bool:
        """Whether the request samples with its own seed (``SamplingParams.reproducible``).
        Its drafts must then be a function of its own tokens (and its ``rng``) alone: a
        proposer that chooses by timing, learns across requests or drafts from other
        requests' text (``hybrid``'s leader, ``suffix``'s response trees) leaves those out
        for it. The engine, for its part, always proposes for it and verifies every draft."""
        return self.sampling is not None and self.sampling.reproducible

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@attrs.define(slots=True)
class ProposalBatch:
    """The requests of one step, in the order of the batch dimension of the returned drafts.

    :ivar row_price: what verifying one draft costs this step, in tokens of the step without
        drafts: the chance of acceptance below which a draft loses time even if proposing it
        were free (a few hundredths of a token at batch 1 on the default model, most of one at
        batch 32). 0 until the engine has measured a step, and whenever the adaptive draft
        length is off. A proposer that drafts in more than one way (``hybrid``) may skip a
        way whose drafts have been accepted less often than this; the engine's verify cut
        drops such drafts anyway, after the proposer has spent its time on them.
    """

    requests: list[ProposalRequest]
    row_price: float = 0.0

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def max_draft_len(self) -> int:
        return max((r.max_draft_len for r in self.requests), default=0)


@attrs.define(slots=True)
class Drafts:
    """Draft tokens for a batch: a padded ``[B, k]`` int64 array plus per-request lengths.

    :ivar token_ids: ``[B, k]`` int64, row ``b`` holds ``lengths[b]`` drafts then ``DRAFT_PAD``.
    :ivar lengths: ``[B]`` int64, the number of drafts of each request.
    :ivar probs: optional ``[B, k, V]`` float32, the proposer's distribution each draft was
        sampled from. The ``rejection`` verify strategy uses it; without it, drafts count as
        deterministic (one-hot), which is right for lookup methods such as ngram.
    :ivar classes: optional ``[B]`` int64, what kind of draft each request got, as a small
        non-negative label of the proposer's choosing (ngram and suffix: the length of the
        context suffix they matched). The adaptive draft length learns how often
        each kind is accepted and verifies weak kinds shorter; without it, every draft is
        one kind (0).
    """

    token_ids: np.ndarray
    lengths: np.ndarray
    probs: Optional[np.ndarray] = None
    classes: Optional[np.ndarray] = None

    @classmethod
    def from_lists(cls, drafts: Sequence[Sequence[int]], probs: Optional[np.ndarray] = None,
                   classes: Optional[Sequence[int]] = None) -> "Drafts":
        """Build drafts from one list of token ids per request (lists may differ in length)
        and, optionally, one class label per request."""
        counts = [len(d) for d in drafts]
        width = max(counts, default=0)
        if all(count == width for count in counts):  # one array straight from the lists (batch 1)
            token_ids = np.array(drafts, dtype=np.int64).reshape(len(drafts), width)
        else:
            token_ids = np.full((len(drafts), width), DRAFT_PAD, dtype=np.int64)
            for row, draft in enumerate(drafts):
                if len(draft):
                    token_ids[row, : len(draft)] = draft
        lengths = np.array(counts, dtype=np.int64)
        if classes is not None:
            classes = np.asarray(classes, dtype=np.int64)
        return cls(token_ids=token_ids, lengths=lengths, probs=probs, classes=classes)

    @classmethod
    def empty(cls, batch_size: int) -> "Drafts":
        """No drafts for any of ``batch_size`` requests."""
        return cls(
            token_ids=np.full((batch_size, 0), DRAFT_PAD, dtype=np.int64),
            lengths=np.zeros(batch_size, dtype=np.int64),
        )

    @property
    def batch_size(self) -> int:
        return self.token_ids.shape[0]

    @property
    def width(self) -> int:
        """``k``, the padded draft width (the longest draft of the batch)."""
        return self.token_ids.shape[1]

    def select(self, rows: Sequence[int]) -> "Drafts":
        """The drafts of the requests at ``rows`` (in that order), at the same width."""
        rows = np.asarray(rows, dtype=np.int64)
        return Drafts(token_ids=self.token_ids[rows], lengths=self.lengths[rows],
                      probs=None if self.probs is None else self.probs[rows],
                      classes=None if self.classes is None else self.classes[rows])

    def placed(self, rows: Sequence[int], batch_size: int) -> "Drafts":
        """These drafts (of a part of a batch) at ``rows`` of a batch of ``batch_size``
        requests; the other requests get none."""
        rows = np.asarray(rows, dtype=np.int64)
        token_ids = np.full((batch_size, self.width), DRAFT_PAD, dtype=np.int64)
        token_ids[rows] = self.token_ids
        lengths = np.zeros(batch_size, dtype=np.int64)
        lengths[rows] = self.lengths
        probs = classes = None
        if self.probs is not None:
            probs = np.zeros((batch_size, *self.probs.shape[1:]), dtype=self.probs.dtype)
            probs[rows] = self.probs
        if self.classes is not None:
            classes = np.zeros(batch_size, dtype=np.int64)
            classes[rows] = self.classes
        return Drafts(token_ids=token_ids, lengths=lengths, probs=probs, classes=classes)

    def to_lists(self) -> list[list[int]]:
        return [self.token_ids[b, : self.lengths[b]].tolist() for b in range(self.batch_size)]

    def clipped(self, max_lengths: np.ndarray) -> "Drafts":
        """Return drafts with each request's length cut to ``max_lengths[b]``, pads rewritten."""
        lengths = np.minimum(self.lengths, max_lengths).astype(np.int64)
        width = int(lengths.max()) if len(lengths) else 0
        token_ids = self.token_ids[:, :width].copy()
        token_ids[np.arange(width)[None, :] >= lengths[:, None]] = DRAFT_PAD
        probs = self.probs[:, :width] if self.probs is not None else None
        return Drafts(token_ids=token_ids, lengths=lengths, probs=probs, classes=self.classes)


def valid_draft_classes(classes, batch_size: int) -> Optional[np.ndarray]:
    """``classes`` (see :attr:`Drafts.classes`) as an int64 array when it holds one non-negative
    integer label per request of a batch of ``batch_size``, else ``None``."""
    classes = np.asarray(classes)
    if classes.shape != (batch_size,) or not np.issubdtype(classes.dtype, np.integer) or np.any(classes < 0):
        return None
    return classes.astype(np.int64, copy=False)


class Proposer(Plugin):
    """Base class of speculative methods.

    Subclasses set ``NAME`` and implement :meth:`propose`. They may declare an attrs class
    ``Config``: its fields become flat keys of the speculative config, and the engine passes
    the structured instance as ``config``. ``spec_config`` is the whole
    :class:`specdec.config.SpeculativeConfig` (``num_speculative_tokens`` and friends).

    The lifecycle methods are optional no-ops here; stateful methods (suffix trees, MTP)
    override them to keep their state in step with the engine.

    Model-based methods (MTP, EAGLE, Medusa, draft models) also override :meth:`setup`, which
    hands them the target model, and set ``NEEDS_HIDDEN_STATES`` to receive the target's
    hidden states with each request (docs/plugins.md, "Model-based proposers").
    """

    #: Set to True when the proposer never drafts (``naive``): the engine then forces
    #: ``num_speculative_tokens`` to 0.
    DRAFTS_NOTHING: ClassVar[bool] = False
    #: The model-based core keys of the speculative config this method reads, of
    #: ``num_model_steps``, ``model`` and ``quantization``. Any of them set (to other than its
    #: default) for a method that does not list it is a config error.
    USED_MODEL_KEYS: ClassVar[frozenset[str]] = frozenset()
    #: Other spellings that select this method: each a mapping of config keys to values that,
    #: all present in a speculative config, make it this method (hybrid declares the seed
    #: system's ``{"method": "mtp", "mtp_strategy": "with_ngram"}``). The keys other than
    #: ``method`` must be fields of this method's ``Config``.
    ALSO_SELECTED_BY: ClassVar[tuple[Mapping[str, Any], ...]] = ()
    #: The speculative config ``specdec demo`` shows this method with (``method`` added);
    #: ``None`` leaves the method out of the demo.
    DEMO_CONFIG: ClassVar[Optional[Mapping[str, Any]]] = None
    #: Set to True to receive ``hidden_states``, ``hidden_positions`` and ``block_table`` in
    #: every :class:`ProposalRequest`. The engine then calls :meth:`propose` for every decoding
    #: request, also when it may not draft (``max_draft_len`` 0; the method must still return
    #: no drafts longer than that), except for a request whose drafting the controller has
    #: switched off: that one's next proposal brings every state since its previous one. A
    #: request's first states (its prompt's) come at its first decode step whatever the
    #: controller says (asked for no drafts where it would not have drafted), and its prompt
    #: blocks join the prefix cache only once they have come: the method writes its own cache
    #: rows for the states it is handed in the call that hands them (or, for
    #: :meth:`catch_up`, before its next call), so a request that shares those blocks finds
    #: them there.
    NEEDS_HIDDEN_STATES: ClassVar[bool] = False
    #: With ``NEEDS_HIDDEN_STATES``: set to True (in :meth:`setup`, say) to be handed each
    #: step's hidden states at the end of that step, in :meth:`catch_up`, instead of with the
    #: next proposal, so that a model proposer can run on them while the engine finishes the
    #: step and plans the next (``QuantizedDraftHead.start``). The engine reads it at the end
    #: of every step: a proposer may ask for it at some steps only (``hybrid`` does, at the
    #: steps its model drafted).
    CATCHES_UP_AFTER_STEP: ClassVar[bool] = False

    @classmethod
    def check_config(cls, spec_config: Any) -> None:
        """Refuse a speculative config this method cannot work with, before any model loads
        (a draft model's missing file): raise :class:`specdec.ConfigError` with a one-line
        message that starts with the key at fault (``"model: ..."``); the caller puts where
        the config came from in front (``--speculative-config.model: ...``). ``spec_config``
        is the whole :class:`specdec.config.SpeculativeConfig`, this method's ``Config`` in
        ``method_config``. The default accepts everything."""

    def setup(self, context: Any) -> None:
        """Called once, after construction and before the first request, with a
        :class:`specdec.ProposerContext`: the target's ``model_config``, ``tokenizer``, the
        :class:`specdec.TargetModel` handle ``target``, and ``create_cache_layers`` for decoder
        layers of the proposer's own over the paged KV cache. Raise a
        :class:`specdec.SpecdecError` (one line) when the proposer cannot work with this target
        (a wrong hidden size, missing weights): the engine refuses the config with it."""

    def hidden_state_layers(self) -> Optional[Sequence[int]]:
        """For a proposer with ``NEEDS_HIDDEN_STATES``: the target's layers whose states it reads,
        side by side in each row of ``hidden_states`` (``[n, len(layers) * H]``, in this order),
        as EAGLE-3 fuses a low, a middle and a high layer's. Layer ``i`` is the residual stream
        entering decoder layer ``i`` (0: the embeddings; vLLM's EAGLE-3 reads 2, L // 2 and
        L - 3), and ``num_layers`` is the last layer's output before the final norm. None (the
        default) is ``(num_layers,)``: ``[n, H]``. Called once, after :meth:`setup`; the
        engine refuses layers outside ``0 .. num_layers`` or more than 8 of them."""
        return None

    def propose(self, batch: ProposalBatch) -> Drafts:
        """Return drafts for every request of ``batch``, at most ``max_draft_len`` each."""
        raise NotImplementedError

    def on_request_start(self, request: ProposalRequest) -> None:
        """Called once when a request is admitted, with its prompt as ``token_ids``."""

    def on_step(self, batch: ProposalBatch, accepted: list[np.ndarray]) -> None:
        """Called after every step; ``accepted[b]`` holds the tokens request ``b`` appended."""

    def catch_up(self, batch: ProposalBatch) -> None:
        """For a proposer with ``CATCHES_UP_AFTER_STEP``: called at the end of a step, after
        :meth:`on_step`, with the requests it proposed for at that step and that go on, each
        with ``token_ids`` as they now are, the ``hidden_states`` and ``hidden_positions`` the
        step decided, and a ``block_table`` that covers the position of its last token
        (``max_draft_len`` is the method's ``k``: how many the next step may ask is not known
        yet). Those states do not come again: the request's next proposal brings only what
        later steps decide (nothing, when it is the next step). A request whose block could
        not be had, or that the drafting controller had left out, gets its states with its
        next proposal as usual. Whatever the work, a request's next :meth:`propose` must
        return what it would have returned had the states come with it."""

    def on_request_finish(self, request_id: str) -> None:
        """Called once when a request ends (finished, stopped or cancelled)."""
