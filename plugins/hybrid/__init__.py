"""``hybrid``: model drafts extended by lookup (FastDeploy's ``method: mtp`` with
``mtp_strategy: with_ngram``; docs/methods.md#hybrid)."""

from __future__ import annotations

import specdec

from .proposer import HybridConfig, HybridProposer

__all__ = ["HybridConfig", "HybridProposer"]


@specdec.hookimpl
def specdec_register_proposers(register):
    register(HybridProposer)
