"""The ``greedy`` verify strategy: accept drafts while they equal the target's argmax."""

from __future__ import annotations

import specdec
from specdec.sdk import (VerifyInputs, VerifyResult, check_inputs, greedy_tokens, prefix_match_result,
                         verify_on_device)


class GreedyVerify(specdec.VerifyStrategy):
    """Accept while ``draft == argmax``; emit the argmax where the drafts stop.

    Ignores temperature, top-k and top-p: the tokens are exactly those of plain greedy
    decoding, whatever the drafts were. So it is not ``LOSSLESS`` (which means equal to
    sampling from the target at any temperature), only greedy-equivalent.
    """

    NAME = "greedy"

    def verify(self, inputs: VerifyInputs) -> VerifyResult:
        check_inputs(inputs)
        if inputs.device_logits is not None:  # the engine runs the Triton kernels: one fused launch
            return verify_on_device(self.NAME, inputs)
        return prefix_match_result(inputs.drafts, greedy_tokens(inputs.logits))


@specdec.hookimpl
def specdec_register_verify_strategies(register):
    register(GreedyVerify)
