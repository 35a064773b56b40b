"""``draft_model``: a smaller model of the target's tokenizer drafts the tokens (vLLM's and the
seed system's ``method: draft_model``; docs/methods.md#draft_model)."""

from __future__ import annotations

import specdec

from .proposer import DraftModelConfig, DraftModelProposer

__all__ = ["DraftModelConfig", "DraftModelProposer"]


@specdec.hookimpl
def specdec_register_proposers(register):
    register(DraftModelProposer)
