"""``lastn``: draft by repeating what followed the previous occurrence of the last token.

If the context ends in token ``t`` and ``t`` occurred before, the tokens that followed that
occurrence are likely to follow again (code, lists, quoted text, repetition loops). When the
previous occurrence is so recent that its continuation runs into the end of the context, the
continuation is taken as periodic: ``x y z x`` drafts ``y z x y z ...``.
"""

from __future__ import annotations

import attrs
import numpy as np

import specdec


def _non_negative(instance, attribute, value):
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


@attrs.define(frozen=True, kw_only=True)
class LastNConfig:
    """Options of ``lastn``; they sit flat in ``--speculative-config`` next to the core keys."""

    #: How many of the most recent tokens to search for the last token (0 = the whole context).
    lastn_lookback: int = attrs.field(default=1024, validator=_non_negative)


class LastNProposer(specdec.Proposer):
    """Draft the continuation of the most recent earlier occurrence of the last token."""

    NAME = "lastn"
    Config = LastNConfig

    def __init__(self, config: LastNConfig | None = None, spec_config=None):
        super().__init__(config or LastNConfig(), spec_config)

    def propose(self, batch: specdec.ProposalBatch) -> specdec.Drafts:
        return specdec.Drafts.from_lists([self.draft(r.token_ids, r.max_draft_len) for r in batch.requests])

    def draft(self, token_ids: np.ndarray, max_draft_len: int) -> list[int]:
        """Up to ``max_draft_len`` tokens predicted to follow ``token_ids``."""
        if max_draft_len <= 0 or len(token_ids) < 2:
            return []
        lookback = self.config.lastn_lookback
        start = max(0, len(token_ids) - 1 - lookback) if lookback else 0
        hits = np.flatnonzero(token_ids[start:-1] == token_ids[-1])
        if len(hits) == 0:
            return []
        previous = start + int(hits[-1])
        period = len(token_ids) - 1 - previous
        positions = previous + 1 + np.arange(max_draft_len) % period
        return token_ids[positions].tolist()


@specdec.hookimpl
def specdec_register_proposers(register):
    register(LastNProposer)
