"""The ``accept_all`` accept policy: keep every draft (measures the upper bound of a proposer)."""

from __future__ import annotations

import numpy as np

import specdec
from specdec.sdk import Drafts, VerifyResult, assemble_output, at_positions


class AcceptAll(specdec.AcceptPolicy):
    """Keep all ``lengths[b]`` drafts, then the target's own token after the last one.

    The output no longer follows the target: use it for testing and benchmarks only.
    """

    NAME = "accept_all"

    def apply(self, result: VerifyResult, drafts: Drafts) -> VerifyResult:
        accepted = drafts.lengths.astype(np.int64)
        next_tokens = at_positions(result.target_tokens, accepted)
        return VerifyResult(
            accepted_lengths=accepted,
            output_tokens=assemble_output(drafts.token_ids, accepted, next_tokens),
            target_tokens=result.target_tokens,
        )


@specdec.hookimpl
def specdec_register_accept_policies(register):
    register(AcceptAll)
