"""How the built-in verify strategies run their device kernels.

Each rule's device half is a launcher of the shared fused verify kernel
(``kernels/triton/verify.py``, reached through :func:`specdec.sdk.load_triton_kernels` so that
Triton is imported only when a kernel runs). The launchers take arrays; :func:`run_fused`
hands them a :class:`~specdec.sdk.VerifyInputs` and wraps what they return as a
:class:`~specdec.sdk.VerifyResult`, the shape of a ``DeviceVerifyKernel.launch``.
"""

from __future__ import annotations

from specdec.sdk import VerifyInputs, VerifyResult


def run_fused(launcher, inputs: VerifyInputs, **options) -> VerifyResult:
    """``launcher`` (one of the fused kernel's, e.g. ``greedy_verify``) on ``inputs``, from
    ``inputs.device_logits``; ``options`` go to the launcher as they are."""
    drafts, sampling = inputs.drafts, inputs.sampling
    accepted, output, target = launcher(
        inputs.device_logits, drafts.token_ids, drafts.lengths, sampling.temperature, sampling.top_k, sampling.top_p,
        sampling.uniforms, drafts.probs, **options)
    return VerifyResult(accepted_lengths=accepted, output_tokens=output, target_tokens=target)
