"""The ``rejection`` verify strategy: speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

Lossless at any temperature, top-k and top-p: every emitted token is distributed exactly as
the target's processed distribution after the tokens before it.
"""

from __future__ import annotations

import numpy as np

import specdec
from specdec.sdk import (DeviceVerifyKernel, Drafts, VerifyInputs, VerifyResult, accepted_prefix, assemble_output,
                         at_positions, check_inputs, load_triton_kernels, pad_beyond_drafts, recovered_tokens,
                         target_distribution, verify_on_device)

from ._fused import run_fused


def accept_drafts(p_draft: np.ndarray, q_draft: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``[S, k]`` bool: ``u < p(d) / q(d)``, written without dividing by ``q``."""
    return u * q_draft < p_draft


def rejection_rule(inputs: VerifyInputs, accept=accept_drafts) -> VerifyResult:
    """The rule on the host (``RejectionVerify`` says what it is); ``accept`` is the per-draft
    test, replaceable so that a control can bias it. Its device twin is
    :func:`rejection_on_device`."""
    drafts, sampling = inputs.drafts, inputs.sampling
    if sampling.all_greedy:  # the argmax alone: no [B, k+1, V] array needs building
        target_tokens, sampled, probs = inputs.argmax(), np.zeros(drafts.batch_size, dtype=bool), None
    else:
        target_tokens, sampled, probs = target_distribution(inputs.logits, sampling, sampling.uniforms[..., 1])
    # Greedy requests: p is one-hot on the argmax, so the draft passes iff it is the argmax
    # and the residual is the argmax itself.
    accepted = accepted_prefix(drafts.token_ids == target_tokens[:, :-1], drafts.lengths)
    next_tokens = at_positions(target_tokens, accepted)
    if probs is not None:
        sampled_drafts = drafts if sampled.all() else drafts.select(np.flatnonzero(sampled))
        accepted[sampled], next_tokens[sampled] = _sample_requests(
            probs, sampled_drafts, sampling.uniforms[sampled], target_tokens[sampled], accept)
    return VerifyResult(
        accepted_lengths=accepted,
        output_tokens=assemble_output(drafts.token_ids, accepted, next_tokens),
        target_tokens=pad_beyond_drafts(target_tokens, drafts.lengths),
    )


def _sample_requests(p: np.ndarray, drafts: Drafts, uniforms: np.ndarray, target_tokens: np.ndarray,
                     accept) -> tuple[np.ndarray, np.ndarray]:
    """Rejection sampling for requests with temperature > 0.

    :param p: ``[S, k+1, V]`` processed target distributions.
    :param drafts: those requests' drafts.
    :param uniforms: ``[S, k+1, 2]``.
    :param target_tokens: ``[S, k+1]`` samples from ``p`` with ``uniforms[..., 1]``: the bonus
        token where every draft is accepted.
    :param accept: the per-draft test (:func:`accept_drafts`).
    :returns: ``(accepted [S], next_tokens [S])``.
    """
    width = drafts.width
    draft_ids = np.maximum(drafts.token_ids, 0)[..., None]  # padding -> any valid index
    p_draft = np.take_along_axis(p[:, :width], draft_ids, axis=-1)[..., 0]
    q = drafts.probs
    q_draft = np.ones_like(p_draft) if q is None else np.take_along_axis(q, draft_ids, axis=-1)[..., 0]
    accepted = accepted_prefix(accept(p_draft, q_draft, uniforms[:, :width, 0]), drafts.lengths)

    next_tokens = at_positions(target_tokens, accepted)
    rejected = np.flatnonzero(accepted < drafts.lengths)
    if len(rejected):
        stop = accepted[rejected]
        next_tokens[rejected] = recovered_tokens(
            p[rejected, stop], None if q is None else q[rejected, stop], drafts.token_ids[rejected, stop],
            uniforms[rejected, stop, 1])
    return accepted, next_tokens


def rejection_on_device(inputs: VerifyInputs) -> VerifyResult:
    """The rule on the device, from ``inputs.device_logits``: ``rejection_verify`` of the fused
    verify kernel (``kernels/triton/verify.py``). Its host twin is :func:`rejection_rule`."""
    return run_fused(load_triton_kernels().verify.rejection_verify, inputs)


class RejectionVerify(specdec.VerifyStrategy):
    """Accept draft ``d`` at position ``j`` with probability ``min(1, p(d) / q(d))``.

    ``p`` is the target's processed distribution (temperature, top-k, top-p) and ``q`` the
    distribution the draft was sampled from: ``drafts.probs`` when the proposer gives it, else
    one-hot on the draft (a deterministic proposer). At the first rejection the emitted token
    is sampled from ``norm(max(0, p - q))``; when every draft is accepted it is sampled from
    ``p`` after the last one. ``uniforms[..., 0]`` decide acceptance, ``uniforms[..., 1]``
    sample tokens.

    Greedy requests (temperature 0, ``p`` one-hot) reduce exactly to ``greedy``; they take an
    argmax-only path that never computes a softmax.
    """

    NAME = "rejection"
    LOSSLESS = True
    DEVICE_KERNEL = DeviceVerifyKernel(launch=rejection_on_device, reference=rejection_rule)
    #: The per-draft test of the host path (a subclass may replace it, as a statistical control
    #: does; the device kernel keeps the plain one).
    accept = staticmethod(accept_drafts)

    def verify(self, inputs: VerifyInputs) -> VerifyResult:
        check_inputs(inputs)
        if inputs.device_logits is not None:  # the engine runs the Triton kernels: one fused launch
            return verify_on_device(self, inputs)
        return rejection_rule(inputs, self.accept)


@specdec.hookimpl
def specdec_register_verify_strategies(register):
    register(RejectionVerify)
