"""``naive``: the speculative step path with no drafts.

Every step verifies zero drafts and emits one target token, so its output is plain decoding
through exactly the code speculative methods use: the baseline every speedup is measured
against, and the reference the lossless tests compare with.
"""

from __future__ import annotations

import specdec


class NaiveProposer(specdec.Proposer):
    NAME = "naive"
    DRAFTS_NOTHING = True

    def propose(self, batch: specdec.ProposalBatch) -> specdec.Drafts:
        return specdec.Drafts.empty(len(batch))


@specdec.hookimpl
def specdec_register_proposers(register):
    register(NaiveProposer)
