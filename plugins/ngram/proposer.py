"""The ngram lookup proposer."""

from __future__ import annotations

import attrs
import numpy as np

import specdec
from specdec.config import in_range


@attrs.define(frozen=True, kw_only=True)
class NgramConfig:
    """Flat keys of ``--speculative-config`` for ``method: ngram``.

    :ivar max_ngram_size: the longest context suffix to look up (tried first).
    :ivar min_ngram_size: the shortest suffix still worth a lookup.
    Defaults measured on the code-edit benchmark (docs/methods.md).
    """

    max_ngram_size: int = attrs.field(default=4, validator=in_range(1, 64))
    min_ngram_size: int = attrs.field(default=2, validator=in_range(1, 64))

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
    length = len(tokens)
    if max_len <= 0 or length < 2:
        return tokens[:0]
    history = tokens[:-1]  # an occurrence ending at j (j <= length - 2) has a follower at j + 1
    # matches[j] stays True while tokens[j - t] == tokens[length - 1 - t] for t = 0 .. n - 1.
    matches = history == tokens[-1]
    best_end = -1
    longest = min(max_ngram, length - 1)
    for n in range(1, longest + 1):
        if n > 1:
            matches[n - 1:] &= history[: length - n] == tokens[length - n]
            matches[: n - 1] = False
        if not matches.any():
            break
        if n >= min_ngram:
            best_end = int(np.flatnonzero(matches)[-1])
    if best_end < 0:
        return tokens[:0]
    return tokens[best_end + 1: best_end + 1 + max_len]


class NgramProposer(specdec.Proposer):
    NAME = "ngram"
    Config = NgramConfig

    def __init__(self, config: NgramConfig | None = None, spec_config=None):
        super().__init__(config or NgramConfig(), spec_config)

    def propose(self, batch: specdec.ProposalBatch) -> specdec.Drafts:
        cfg = self.config
        drafts = [
            find_ngram_draft(r.token_ids, r.max_draft_len, cfg.max_ngram_size, cfg.min_ngram_size)
            for r in batch.requests
        ]
        return specdec.Drafts.from_lists(drafts)
