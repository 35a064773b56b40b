"""The ``topp`` verify strategy (the seed system's default, after FastDeploy's speculate_verify).

Not lossless: it keeps drafts the target merely finds plausible, so the output can differ from
what the target would have sampled on its own.
"""

from __future__ import annotations

import attrs
import numpy as np

import specdec
from specdec.sdk import (DeviceVerifyKernel, VerifyInputs, VerifyResult, assemble_output, at_positions, check_inputs,
                         draft_mask, load_triton_kernels, pad_beyond_drafts, target_distribution, top_tokens,
                         verify_on_device)

from ._fused import run_fused

_positive_int = [attrs.validators.instance_of(int), attrs.validators.ge(1)]


def topp_rule(inputs: VerifyInputs, *, max_candidate_len: int = 5, verify_window: int = 2) -> VerifyResult:
    """The rule on the host (``ToppVerify`` says what it is), with its two options. Its device
    twin is :func:`topp_on_device` (the ``STRATEGY == 3`` branch of the fused verify kernel)."""
    drafts, sampling = inputs.drafts, inputs.sampling
    target_tokens, sampled, probs = target_distribution(inputs.logits, sampling, sampling.uniforms[..., 1])
    accepted = np.zeros(drafts.batch_size, dtype=np.int64)
    if drafts.width > 0:
        accepted = walk(_steps(inputs, sampled, probs, max_candidate_len, verify_window), drafts.lengths)
    return VerifyResult(
        accepted_lengths=accepted,
        output_tokens=assemble_output(drafts.token_ids, accepted, at_positions(target_tokens, accepted)),
        target_tokens=pad_beyond_drafts(target_tokens, drafts.lengths),
    )


def topp_on_device(inputs: VerifyInputs, *, max_candidate_len: int = 5, verify_window: int = 2) -> VerifyResult:
    """The rule on the device, from ``inputs.device_logits``: ``topp_verify`` of the fused
    verify kernel (``kernels/triton/verify.py``). Its host twin is :func:`topp_rule`."""
    return run_fused(load_triton_kernels().verify.topp_verify, inputs, max_candidate_len=max_candidate_len,
                     verify_window=verify_window)


def _steps(inputs: VerifyInputs, sampled: np.ndarray, probs, max_candidates: int, window: int) -> np.ndarray:
    """``[B, k]`` int64: how many drafts the walk accepts when it reaches each position (0 stops it)."""
    drafts = inputs.drafts
    width = drafts.width
    valid = draft_mask(drafts)

    # The candidates are the best tokens of the nucleus: as many as top-k/top-p left with
    # some probability (one, the argmax, at temperature 0), at most max_candidates.
    candidate_count = np.ones((drafts.batch_size, width), dtype=np.int64)
    if probs is not None:
        candidate_count[sampled] = np.minimum(np.count_nonzero(probs[:, :width], axis=-1), max_candidates)
    use_window = max_candidates >= 2
    ranked = top_tokens(inputs.logits[:, :width], max(int(candidate_count.max()), 2 if use_window else 1))

    count = min(max_candidates, ranked.shape[-1])
    is_candidate = np.arange(count) < candidate_count[..., None]
    in_set = np.any((drafts.token_ids[..., None] == ranked[..., :count]) & is_candidate, axis=-1) & valid
    steps = np.where(in_set, 1, 0)
    if use_window and ranked.shape[-1] >= 2:
        top1 = (drafts.token_ids == ranked[..., 0]) & valid
        second = (drafts.token_ids == ranked[..., 1]) & valid
        steps = np.where(~in_set & second & top1_window(top1, window), window + 1, steps)
    return steps


def top1_window(top1: np.ndarray, window: int) -> np.ndarray:
    """``[B, k]`` bool: the ``window`` positions after ``i`` all exist and are all top-1 matches."""
    batch, width = top1.shape
    ok = np.zeros((batch, width), dtype=bool)
    if width > window:
        counts = np.concatenate([np.zeros((batch, 1), dtype=np.int64), np.cumsum(top1, axis=1)], axis=1)
        # counts[:, j] = matches among positions < j; the window of i is i+1 .. i+window.
        ok[:, : width - window] = counts[:, window + 1 :] - counts[:, 1 : width - window + 1] == window
    return ok


def walk(steps: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Accepted lengths from a step table: start at 0, move ``steps[b, pos]`` until it is 0.

    One iteration per draft position, each vectorised over the batch.
    """
    batch, width = steps.shape
    rows = np.arange(batch)
    position = np.zeros(batch, dtype=np.int64)
    for _ in range(width):
        step = np.where(position < lengths, steps[rows, np.minimum(position, width - 1)], 0)
        if not step.any():
            break
        position += step
    return position


class ToppVerify(specdec.VerifyStrategy):
    """Accept drafts that lie in the target's top-p candidate set.

    At each draft position the candidates are the tokens of the target's nucleus (the request's
    temperature, top-k and top-p applied), at most ``max_candidate_len`` of them, best first.
    Walking the drafts in order:

    1. a draft among its position's candidates is accepted;
    2. otherwise, a draft that is the target's second most likely token is accepted together
       with the next ``verify_window`` drafts when each of those is its position's most likely
       token (needs ``max_candidate_len >= 2``); the walk then goes on after them;
    3. otherwise the walk stops.

    The emitted token at the stop position is the target's own choice there: a sample from the
    processed distribution (argmax at temperature 0, where the candidate set is the argmax
    alone and only rule 2 can accept anything else).
    """

    NAME = "topp"
    LOSSLESS = False
    DEVICE_KERNEL = DeviceVerifyKernel(launch=topp_on_device, reference=topp_rule)

    @attrs.frozen(kw_only=True)
    class Config:
        """Options of ``topp``; flat keys of the speculative config."""

        #: The most candidates a position offers (the nucleus is cut to this many tokens).
        max_candidate_len: int = attrs.field(default=5, validator=_positive_int)
        #: How many following drafts must equal the target's top-1 for a top-2 draft to pass.
        verify_window: int = attrs.field(default=2, validator=_positive_int)

    def __init__(self, config=None, spec_config=None):
        super().__init__(config if config is not None else self.Config(), spec_config)

    def verify(self, inputs: VerifyInputs) -> VerifyResult:
        check_inputs(inputs)
        options = attrs.asdict(self.config)  # max_candidate_len, verify_window
        if inputs.device_logits is not None:  # the engine runs the Triton kernels: one fused launch
            return verify_on_device(self, inputs, **options)
        return topp_rule(inputs, **options)


@specdec.hookimpl
def specdec_register_verify_strategies(register):
    register(ToppVerify)
