"""``suffix``: suffix decoding (SuffixDecoding, Oliaro et al. 2024; FastDeploy's ``method: suffix``).

Drafts from a suffix tree over the request's own tokens and one over the responses of earlier
requests; the longer the context's match, the longer the draft may grow. Our own
implementation (no arctic-inference dependency); the semantics are in docs/methods.md.
"""

from __future__ import annotations

import specdec

from .proposer import SuffixConfig, SuffixProposer
from .tree import Draft, Matcher, SuffixTree, best_node_draft

__all__ = ["Draft", "Matcher", "SuffixConfig", "SuffixProposer", "SuffixTree", "best_node_draft"]


@specdec.hookimpl
def specdec_register_proposers(register):
    register(SuffixProposer)
