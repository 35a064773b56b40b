"""The ``greedy`` verify strategy: accept drafts while they equal the target's argmax."""

from __future__ import annotations

import specdec
from specdec.probs import greedy_tokens
from specdec.verify import VerifyInputs, VerifyResult

from .common import check_inputs, prefix_match_result


class GreedyVerify(specdec.VerifyStrategy):
    """Accept while ``draft == argmax``; emit the argmax where the drafts stop.

    Ignores temperature, top-k and top-p: the tokens are exactly those of plain greedy
    decoding, whatever the drafts were.
    """

    NAME = "greedy"
    LOSSLESS = True

    def verify(self, inputs: VerifyInputs) -> VerifyResult:
        check_inputs(inputs)
        return prefix_match_result(inputs.drafts, greedy_tokens(inputs.logits))


@specdec.hookimpl
def specdec_register_verify_strategies(register):
    register(GreedyVerify)
