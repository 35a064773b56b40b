"""The ngram lookup proposer."""

from __future__ import annotations

import attrs
import numpy as np

import specdec
from specdec.sdk import KernelUnavailable, in_range


@attrs.define(frozen=True, kw_only=True)
class NgramConfig:
    """Flat keys of ``--speculative-config`` for ``method: ngram``.

    :ivar max_ngram_size: the longest context suffix to look up (tried first).
    :ivar min_ngram_size: the shortest suffix still worth a lookup.
    Defaults measured on the code-edit benchmark (docs/methods.md).
    """

    max_ngram_size: int = attrs.field(default=6, validator=in_range(1, 64))
    min_ngram_size: int = attrs.field(default=1, validator=in_range(1, 64))

    def __attrs_post_init__(self):
        if self.min_ngram_size > self.max_ngram_size:
            raise ValueError(
                f"min_ngram_size ({self.min_ngram_size}) must not exceed max_ngram_size ({self.max_ngram_size})"
            )


def find_ngram_draft(tokens: np.ndarray, max_len: int, max_ngram: int, min_ngram: int) -> np.ndarray:
    """Draft up to ``max_len`` tokens for ``tokens`` by suffix lookup.

    For n from ``max_ngram`` down to ``min_ngram``: find the earlier positions where the last n
    tokens occurred (an occurrence must be followed by at least one token), take the most recent
    one, and return the tokens that followed it. Returns an empty array when nothing matches.
    """
    return find_ngram_match(tokens, max_len, max_ngram, min_ngram)[0]


def find_ngram_match(tokens: np.ndarray, max_len: int, max_ngram: int, min_ngram: int) -> tuple[np.ndarray, int]:
    """:func:`find_ngram_draft`, and the length n of the suffix it matched (0: none)."""
    length = len(tokens)
    if max_len <= 0 or length < 2:
        return tokens[:0], 0
    history = tokens[:-1]  # an occurrence ending at j (j <= length - 2) has a follower at j + 1
    # matches[j] stays True while tokens[j - t] == tokens[length - 1 - t] for t = 0 .. n - 1.
    matches = history == tokens[-1]
    best_end, best_n = -1, 0
    longest = min(max_ngram, length - 1)
    for n in range(1, longest + 1):
        if n > 1:
            matches[n - 1:] &= history[: length - n] == tokens[length - n]
            matches[: n - 1] = False
        if not matches.any():
            break
        if n >= min_ngram:
            best_end, best_n = int(np.flatnonzero(matches)[-1]), n
    if best_end < 0:
        return tokens[:0], 0
    return tokens[best_end + 1: best_end + 1 + max_len], best_n


#: Bits per token in an n-gram key: every token id fits, so keys are exact (no collisions).
_TOKEN_BITS = 32


class NgramIndex:
    """For one request: where each n-gram (``min_n <= n <= max_n``) of its tokens last ended,
    among the positions that have a follower. Kept up to date incrementally, so a lookup costs
    a few dict probes however long the context is.

    An n-gram's key is the integer ``t[j] | t[j-1] << 32 | t[j-2] << 64 ...`` (exact: two
    n-grams share a key only when they are equal), one table per n. Two sets of tables: the
    positions indexed by the first :meth:`extend` (the prompt), which never change again, and
    the later ones (the output), which every step adds to. Later positions are more recent, so
    a lookup tries the output tables first. Keeping the small, busy tables apart from the large
    prompt ones keeps the per-step inserts in cache: at batch 256 with 4k-token prompts that
    halves the proposer's time.
    """

    __slots__ = ("tokens", "min_n", "max_n", "shifts", "prompt_tables", "output_tables")

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.shifts = [_TOKEN_BITS * max(n - 1, 0) for n in range(max_n + 1)]
        self.tokens: list[int] = []
        self.prompt_tables: list[dict[int, int]] | None = None
        self.output_tables: list[dict[int, int]] = [{} for _ in range(max_n + 1)]

    def extend(self, token_ids: np.ndarray) -> None:
        """Catch up with ``token_ids`` (the request's tokens so far; they only ever grow)."""
        tokens = self.tokens
        old, new = len(tokens), len(token_ids)
        if new <= old:
            return
        tokens.extend(token_ids[old:].tolist())
        if self.prompt_tables is None:
            self.prompt_tables = tables = [{} for _ in range(self.max_n + 1)]
        else:
            tables = self.output_tables
        min_n, max_n, shifts = self.min_n, self.max_n, self.shifts
        # An n-gram ending at j is indexed once position j + 1 exists; later ends overwrite
        # earlier ones, so each table keeps the most recent occurrence.
        for j in range(max(old - 1, 0), new - 1):
            key = tokens[j]
            if min_n == 1:
                tables[1][key] = j
            for n in range(2, min(max_n, j + 1) + 1):
                key |= tokens[j - n + 1] << shifts[n]
                if n >= min_n:
                    tables[n][key] = j

    def draft(self, max_len: int) -> tuple[list[int], int]:
        """The tokens that followed the most recent earlier occurrence of the longest matching
        suffix (``max_n`` down to ``min_n`` tokens), and that suffix's length; ``([], 0)``
        when nothing matches."""
        tokens = self.tokens
        length = len(tokens)
        longest = min(self.max_n, length - 1)
        if max_len <= 0 or longest < self.min_n or self.prompt_tables is None:
            return [], 0
        shifts = self.shifts
        key = tokens[-1]
        keys = [0, key]
        for n in range(2, longest + 1):
            key |= tokens[length - n] << shifts[n]
            keys.append(key)
        output, prompt = self.output_tables, self.prompt_tables
        for n in range(longest, self.min_n - 1, -1):
            end = output[n].get(keys[n])
            if end is None:
                end = prompt[n].get(keys[n])
            if end is not None:
                return tokens[end + 1: end + 1 + max_len], n
        return [], 0


def _compiled_indexes(config: NgramConfig):
    """The compiled indexes (``compiled.py``), or ``None`` without a compiler."""
    from .compiled import CompiledNgramIndexes

    try:
        return CompiledNgramIndexes(config.min_ngram_size, config.max_ngram_size)
    except KernelUnavailable:
        return None


class NgramProposer(specdec.Proposer):
    """Drafts from a per-request n-gram index: the compiled one when the C++ compiler is there
    (one call per step for the whole batch), else :class:`NgramIndex`. Both give the drafts
    of :func:`find_ngram_draft`, the reference twin."""

    NAME = "ngram"
    DEMO_CONFIG = {"num_speculative_tokens": 5}
    Config = NgramConfig

    def __init__(self, config: NgramConfig | None = None, spec_config=None):
        super().__init__(config or NgramConfig(), spec_config)
        self._compiled = _compiled_indexes(self.config)
        self._indexes: dict[str, NgramIndex] = {}

    def _index(self, request_id: str) -> NgramIndex:
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = NgramIndex(self.config.min_ngram_size, self.config.max_ngram_size)
        return index

    def on_request_start(self, request: specdec.ProposalRequest) -> None:
        # Index the prompt now (during the request's prefill), not in its first decode step.
        if self._compiled is not None:
            self._compiled.draft_batch([attrs.evolve(request, max_draft_len=0)])
        else:
            self._index(request.request_id).extend(request.token_ids)

    def propose(self, batch: specdec.ProposalBatch) -> specdec.Drafts:
        """Drafts labelled with the length of the suffix they matched (``Drafts.classes``): a
        longer match is far likelier to be accepted, and the adaptive draft length learns by
        how much."""
        requests = batch.requests
        if self._compiled is not None:
            token_ids, lengths, matched = self._compiled.draft_batch(requests)
            return specdec.Drafts(token_ids=token_ids, lengths=lengths, classes=matched)
        drafts, matched = [], []
        for request in requests:
            index = self._index(request.request_id)
            index.extend(request.token_ids)
            draft, n = index.draft(request.max_draft_len)
            drafts.append(draft)
            matched.append(n)
        return specdec.Drafts.from_lists(drafts, classes=matched)

    def on_request_finish(self, request_id: str) -> None:
        if self._compiled is not None:
            self._compiled.finish(request_id)
        self._indexes.pop(request_id, None)
