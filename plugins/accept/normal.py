"""The ``normal`` accept policy: keep what the verify strategy decided."""

from __future__ import annotations

import specdec
from specdec.sdk import Drafts, VerifyResult


class NormalAccept(specdec.AcceptPolicy):
    """Return the verify result unchanged (the default)."""

    NAME = "normal"

    def apply(self, result: VerifyResult, drafts: Drafts) -> VerifyResult:
        return result


@specdec.hookimpl
def specdec_register_accept_policies(register):
    register(NormalAccept)
