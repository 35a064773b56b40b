"""The ``reject_all`` accept policy: keep no draft (plain decoding at the cost of speculation)."""

from __future__ import annotations

import numpy as np

import specdec
from specdec.sdk import Drafts, VerifyResult, assemble_output


class RejectAll(specdec.AcceptPolicy):
    """Keep no draft; emit the target's own token at the first position.

    Useful to measure the cost of speculation: every step emits exactly one token.
    """

    NAME = "reject_all"

    def apply(self, result: VerifyResult, drafts: Drafts) -> VerifyResult:
        accepted = np.zeros(drafts.batch_size, dtype=np.int64)
        return VerifyResult(
            accepted_lengths=accepted,
            output_tokens=assemble_output(drafts.token_ids, accepted, result.target_tokens[:, 0]),
            target_tokens=result.target_tokens,
        )


@specdec.hookimpl
def specdec_register_accept_policies(register):
    register(RejectAll)
