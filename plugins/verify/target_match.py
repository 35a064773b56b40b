"""The ``target_match`` verify strategy: accept drafts while they equal the target's own sample."""

from __future__ import annotations

import specdec
from specdec.sdk import (VerifyInputs, VerifyResult, check_inputs, prefix_match_result, target_choice,
                         verify_on_device)


class TargetMatchVerify(specdec.VerifyStrategy):
    """Sample the target's token at every position, accept while ``draft == sample``.

    The samples use ``uniforms[..., 1]`` only, so equal uniforms give equal results. Every
    emitted token is the target's own sample after the tokens before it: the output follows
    the target distribution exactly as long as the drafts do not depend on those uniforms
    (deterministic drafts, or drafts sampled with their own randomness).
    """

    NAME = "target_match"
    LOSSLESS = True

    def verify(self, inputs: VerifyInputs) -> VerifyResult:
        check_inputs(inputs)
        if inputs.device_logits is not None:  # the engine runs the Triton kernels: one fused launch
            return verify_on_device(self.NAME, inputs)
        target_tokens = target_choice(inputs.logits, inputs.sampling, inputs.sampling.uniforms[..., 1])
        return prefix_match_result(inputs.drafts, target_tokens)


@specdec.hookimpl
def specdec_register_verify_strategies(register):
    register(TargetMatchVerify)
