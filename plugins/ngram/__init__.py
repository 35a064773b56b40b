"""``ngram``: prompt/output lookup drafting (FastDeploy's ``method: ngram``).

Find the longest suffix of the context (``max_ngram_size`` tokens down to ``min_ngram_size``)
that occurred earlier in the prompt or the generated tokens, and draft the tokens that followed
its most recent earlier occurrence.
"""

from __future__ import annotations

import specdec

from .proposer import NgramConfig, NgramProposer, find_ngram_draft, find_ngram_match

__all__ = ["NgramConfig", "NgramProposer", "find_ngram_draft", "find_ngram_match"]


@specdec.hookimpl
def specdec_register_proposers(register):
    register(NgramProposer)
