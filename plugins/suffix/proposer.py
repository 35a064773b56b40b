"""The suffix decoding proposer: a suffix tree per request plus one over earlier responses."""

from __future__ import annotations

from collections import deque
from typing import Hashable, Optional

import attrs
import numpy as np

import specdec
from specdec.sdk import KernelUnavailable, above, in_range, one_of

from .tree import Draft, Matcher, SuffixTree, best_node_draft

#: The sequence id of the one sequence (prompt + generated tokens) of a per-request tree.
_OWN = 0
#: Drafts are labelled with their match length (``Drafts.classes``) up to this; longer
#: matches share the label (they are accepted alike, and each label needs its own history).
MAX_DRAFT_CLASS = 8


@attrs.define(frozen=True, kw_only=True)
class SuffixConfig:
    """Flat keys of ``--speculative-config`` for ``method: suffix`` (FastDeploy's names
    and defaults; docs/methods.md explains each).

    :ivar suffix_decoding_max_tree_depth: suffixes are stored and matched up to this many tokens.
    :ivar suffix_decoding_max_cached_requests: finished requests whose responses the global tree
        keeps (oldest evicted first; across all tenants' trees in ``tenant`` scope); -1 keeps
        all (unbounded memory), 0 turns the global tree off. vLLM's default, 10000.
    :ivar suffix_decoding_cache_scope: ``global``: one tree of every request's responses;
        ``tenant``: one per tenant (the API key a request came with, ``ProposalRequest.tenant``),
        so that one tenant's responses never become another's drafts.
    :ivar suffix_decoding_max_spec_factor: a match of ``m`` tokens drafts at most
        ``floor(factor * m)`` tokens.
    :ivar suffix_decoding_min_token_prob: drafting stops before a token whose path probability
        falls below this.
    """

    suffix_decoding_max_tree_depth: int = attrs.field(default=64, validator=in_range(1))
    suffix_decoding_max_cached_requests: int = attrs.field(default=10000, validator=in_range(-1))
    suffix_decoding_max_spec_factor: float = attrs.field(default=1.0, validator=above(0))
    suffix_decoding_min_token_prob: float = attrs.field(default=0.1, validator=in_range(0, 1))
    suffix_decoding_cache_scope: str = attrs.field(default="global", validator=one_of("global", "tenant"))


class RequestState:
    """What the proposer keeps per running request: its own tree (one sequence: prompt and
    generated tokens), whose global tree it drafts from (``cache_key``: the tenant's in
    ``tenant`` scope) and where its context's suffixes end in that tree."""

    __slots__ = ("tree", "num_prompt_tokens", "cache_key", "matcher")

    def __init__(self, depth: int, num_prompt_tokens: int, cache_key: Hashable):
        self.tree = SuffixTree(depth)
        self.tree.extend(_OWN, ())
        self.num_prompt_tokens = num_prompt_tokens
        self.cache_key = cache_key
        self.matcher: Optional[Matcher] = None  # made when its global tree has something to match

    @property
    def tokens(self) -> list:
        """The request's tokens so far (prompt, then generated): the tree's own list."""
        return self.tree.sequence(_OWN)

    def append(self, tokens: list) -> None:
        """The request grew by ``tokens``: extend its tree and its matches in the global tree
        (a stale match is left for :meth:`SuffixProposer.speculate` to redo)."""
        self.tree.extend(_OWN, tokens)
        matcher = self.matcher
        if matcher is not None and not matcher.stale:
            for token in tokens:
                matcher.push(token)


def _compiled_requests(depth: int, trees: dict, cache_key):
    """The compiled trees' running requests (``compiled.py``), or ``None`` without a compiler."""
    from .compiled import CompiledRequests

    try:
        return CompiledRequests(depth, trees, cache_key)
    except KernelUnavailable:
        return None


class SuffixProposer(specdec.Proposer):
    """``suffix``: draft from suffix trees over the request itself and over earlier responses.

    The trees are compiled (``suffix_trees.cc``: one native call a step for the whole batch)
    where a C++ compiler is found; otherwise, or with ``native=False``, they are the Python
    trees of ``tree.py``, their reference twin: the same drafts either way.

    The lifecycle keeps the trees in step: ``on_request_start`` builds the request's tree from
    its tokens, ``on_step`` appends what each request accepted, ``on_request_finish`` moves the
    response into the global tree and frees the request's tree. ``propose`` catches up from
    ``token_ids`` whenever the engine skipped a call (or never started the request).

    The global tree is bounded: it keeps the last ``suffix_decoding_max_cached_requests``
    responses. In ``tenant`` scope there is one such tree per tenant (requests without a
    tenant share one), bounded together, and a tree that eviction empties is dropped.
    """

    NAME = "suffix"
    DEMO_CONFIG = {"num_speculative_tokens": 5}
    Config = SuffixConfig

    def __init__(self, config: SuffixConfig | None = None, spec_config=None, *, native: bool = True):
        super().__init__(config or SuffixConfig(), spec_config)
        cfg = self.config
        self.depth = cfg.suffix_decoding_max_tree_depth
        self.max_cached = cfg.suffix_decoding_max_cached_requests
        self.max_spec_factor = cfg.suffix_decoding_max_spec_factor
        self.min_token_prob = cfg.suffix_decoding_min_token_prob
        self.per_tenant = cfg.suffix_decoding_cache_scope == "tenant"
        #: The responses of finished requests, keyed by request id, per cache key (the tenant
        #: in ``tenant`` scope, else None); empty when the global tree is off.
        self.response_trees: dict[Hashable, SuffixTree] = {}
        #: The running requests' compiled trees, or None: the Python ones (``requests``).
        self.native = _compiled_requests(self.depth, self.response_trees, self.cache_key) if native else None
        if self.native is not None:
            from .compiled import CompiledSuffixTree

            self._new_tree = CompiledSuffixTree
        else:
            self._new_tree = SuffixTree
        if self.max_cached != 0 and not self.per_tenant:
            self.response_trees[None] = self._new_tree(self.depth)
        self._cached_ids: deque = deque()  # (cache key, request id) in the trees, oldest first
        #: request id -> its state (own tree, global matches), while the request runs (Python trees).
        self.requests: dict[str, RequestState] = {}

    @property
    def global_tree(self) -> Optional[SuffixTree]:
        """The tree of responses of ``global`` scope (in ``tenant`` scope: of the requests
        without a tenant); None when off or empty in ``tenant`` scope."""
        return self.response_trees.get(None)

    def cache_key(self, tenant: Optional[str]) -> Hashable:
        """Which global tree a request of ``tenant`` drafts from and feeds."""
        return tenant if self.per_tenant else None

    # -- drafting --------------------------------------------------------------------------------

    def propose(self, batch: specdec.ProposalBatch) -> specdec.Drafts:
        """Each request's best draft, labelled with the length of the match it came from
        (capped at :data:`MAX_DRAFT_CLASS`) for the adaptive draft length."""
        if self.native is not None:
            token_ids, lengths, matched = self.native.propose(batch.requests, self.max_spec_factor,
                                                              self.min_token_prob)
            return specdec.Drafts(token_ids=token_ids, lengths=lengths, classes=np.minimum(matched, MAX_DRAFT_CLASS))
        drafts, classes = [], []
        for request in batch.requests:
            if request.max_draft_len <= 0:
                drafts.append(())
                classes.append(0)
                continue
            state = self._sync(request.request_id, request.token_ids, request.num_prompt_tokens, request.tenant)
            draft = self.speculate(state, request.max_draft_len, own_only=request.reproducible)
            drafts.append(draft.token_ids)
            classes.append(min(draft.match_len, MAX_DRAFT_CLASS) if draft.token_ids else 0)
        return specdec.Drafts.from_lists(drafts, classes=classes)

    def speculate(self, state: RequestState, max_tokens: int, own_only: bool = False) -> Draft:
        """The best draft over both trees and all match lengths; ties go to the request's own
        tree, then to the longer match. ``own_only``: from the request's own tree alone (a
        seeded sampled request, whose drafts must not depend on other requests' responses)."""
        own = best_node_draft(state.tree.suffix_nodes(), max_tokens, self.max_spec_factor, self.min_token_prob)
        tree = None if own_only else self.response_trees.get(state.cache_key)
        if tree is None or not len(tree):
            return own
        matcher = state.matcher
        if matcher is None or matcher.tree is not tree:  # the first, or a new tree of its tenant
            matcher = state.matcher = Matcher(tree)
            matcher.reset(state.tokens)
        elif matcher.stale:
            matcher.reset(state.tokens)
        cached = matcher.best_draft(max_tokens, self.max_spec_factor, self.min_token_prob, beat=own.score)
        return cached if cached.score > own.score else own

    # -- keeping the trees in step ---------------------------------------------------------------

    def on_request_start(self, request: specdec.ProposalRequest) -> None:
        if self.native is not None:
            self.native.extend([request])
            return
        self._sync(request.request_id, request.token_ids, request.num_prompt_tokens, request.tenant)

    def on_step(self, batch: specdec.ProposalBatch, accepted: list[np.ndarray]) -> None:
        if self.native is not None:
            rows = [i for i, tokens in enumerate(accepted) if len(tokens)]
            self.native.extend([batch.requests[i] for i in rows], [accepted[i] for i in rows])
            return
        for request, tokens in zip(batch.requests, accepted):
            if len(tokens):
                # request.token_ids is the context the step proposed for, before ``tokens``.
                state = self._sync(request.request_id, request.token_ids, request.num_prompt_tokens, request.tenant)
                state.append(tokens.tolist())

    def on_request_finish(self, request_id: str) -> None:
        if self.native is not None:
            finished = self.native.finish(request_id)
            if finished is not None and self.max_cached != 0:
                key, response = finished
                if response:
                    self._cache(key, request_id, response)
            return
        state = self.requests.pop(request_id, None)
        if state is None or self.max_cached == 0:
            return
        response = state.tokens[state.num_prompt_tokens:]
        if response:
            self._cache(state.cache_key, request_id, response)

    def _sync(self, request_id: str, token_ids: np.ndarray, num_prompt_tokens: int,
              tenant: Optional[str] = None) -> RequestState:
        """The request's state, built or caught up so that it holds exactly ``token_ids``."""
        state = self.requests.get(request_id)
        have = len(state.tokens) if state is not None else -1
        if have > len(token_ids):  # not this request's history any more: start over
            state, have = None, -1
        if state is None:
            state = self.requests[request_id] = RequestState(self.depth, num_prompt_tokens, self.cache_key(tenant))
            have = 0
        if have < len(token_ids):
            state.append(token_ids[have:].tolist())
        return state

    def cache_response(self, request_id: str, response: list, tenant: Optional[str] = None) -> None:
        """Add a finished response to the global tree (``tenant``'s in ``tenant`` scope),
        evicting the oldest beyond the limit (``on_request_finish`` does this; call it to warm
        the cache with known answers). Does nothing when the global tree is off."""
        if self.max_cached != 0:
            self._cache(self.cache_key(tenant), request_id, response)

    def _cache(self, key: Hashable, request_id: str, response: list) -> None:
        tree = self.response_trees.get(key)
        if tree is None:
            tree = self.response_trees[key] = self._new_tree(self.depth)
        if request_id in tree:
            tree.remove(request_id)
            self._cached_ids.remove((key, request_id))
        tree.extend(request_id, response)
        self._cached_ids.append((key, request_id))
        while 0 < self.max_cached < len(self._cached_ids):
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        key, request_id = self._cached_ids.popleft()
        tree = self.response_trees[key]
        tree.remove(request_id)
        if self.per_tenant and not len(tree):  # tenants come and go: keep no empty tree
            del self.response_trees[key]
