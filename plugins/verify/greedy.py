"""The ``greedy`` verify strategy: accept drafts while they equal the target's argmax."""

from __future__ import annotations

import specdec
from specdec.sdk import (DeviceVerifyKernel, VerifyInputs, VerifyResult, check_inputs,
                         load_triton_kernels, prefix_match_result, verify_on_device)

from ._fused import run_fused


def greedy_rule(inputs: VerifyInputs) -> VerifyResult:
    """The rule on the host: accept while ``draft == argmax``, emit the argmax where the drafts
    stop. Its device twin is :func:`greedy_on_device`."""
    return prefix_match_result(inputs.drafts, inputs.argmax())


def greedy_on_device(inputs: VerifyInputs) -> VerifyResult:
    """The rule on the device, from ``inputs.device_logits``: ``greedy_verify`` of the fused
    verify kernel (``kernels/triton/verify.py``). Its host twin is :func:`greedy_rule`."""
    return run_fused(load_triton_kernels().verify.greedy_verify, inputs)


class GreedyVerify(specdec.VerifyStrategy):
    """Accept while ``draft == argmax``; emit the argmax where the drafts stop.

    Ignores temperature, top-k and top-p: the tokens are exactly those of plain greedy
    decoding, whatever the drafts were. So it is not ``LOSSLESS`` (which means equal to
    sampling from the target at any temperature), only greedy-equivalent.
    """

    NAME = "greedy"
    DEVICE_KERNEL = DeviceVerifyKernel(launch=greedy_on_device, reference=greedy_rule)

    def verify(self, inputs: VerifyInputs) -> VerifyResult:
        check_inputs(inputs)
        if inputs.device_logits is not None:  # the engine runs the Triton kernels: one fused launch
            return verify_on_device(self, inputs)
        return greedy_rule(inputs)


@specdec.hookimpl
def specdec_register_verify_strategies(register):
    register(GreedyVerify)
