"""The ``target_match`` verify strategy: accept drafts while they equal the target's own sample."""

from __future__ import annotations

import specdec
from specdec.sdk import (DeviceVerifyKernel, VerifyInputs, VerifyResult, check_inputs, load_triton_kernels,
                         prefix_match_result, target_choice, verify_on_device)

from ._fused import run_fused


def target_match_rule(inputs: VerifyInputs) -> VerifyResult:
    """The rule on the host: sample the target's token at every position with
    ``uniforms[..., 1]`` (the argmax for greedy requests), accept while ``draft == sample``,
    emit the sample where the drafts stop. Its device twin is :func:`target_match_on_device`."""
    target_tokens = target_choice(inputs.logits, inputs.sampling, inputs.sampling.uniforms[..., 1])
    return prefix_match_result(inputs.drafts, target_tokens)


def target_match_on_device(inputs: VerifyInputs) -> VerifyResult:
    """The rule on the device, from ``inputs.device_logits``: ``target_match_verify`` of the
    fused verify kernel (``kernels/triton/verify.py``). Its host twin is :func:`target_match_rule`."""
    return run_fused(load_triton_kernels().verify.target_match_verify, inputs)


class TargetMatchVerify(specdec.VerifyStrategy):
    """Sample the target's token at every position, accept while ``draft == sample``.

    The samples use ``uniforms[..., 1]`` only, so equal uniforms give equal results. Every
    emitted token is the target's own sample after the tokens before it: the output follows
    the target distribution exactly as long as the drafts do not depend on those uniforms
    (deterministic drafts, or drafts sampled with their own randomness).
    """

    NAME = "target_match"
    LOSSLESS = True
    DEVICE_KERNEL = DeviceVerifyKernel(launch=target_match_on_device, reference=target_match_rule)

    def verify(self, inputs: VerifyInputs) -> VerifyResult:
        check_inputs(inputs)
        if inputs.device_logits is not None:  # the engine runs the Triton kernels: one fused launch
            return verify_on_device(self, inputs)
        return target_match_rule(inputs)


@specdec.hookimpl
def specdec_register_verify_strategies(register):
    register(TargetMatchVerify)
