"""A third-party verify strategy with a fused device kernel of its own, dispatched by
``specdec.sdk.verify_on_device`` through the ``DeviceVerifyKernel`` it declares.

``near_argmax`` (written here as a plugin author would, against ``specdec`` and ``specdec.sdk``
only) accepts a draft while its logit is within ``margin`` of the row's largest, and emits the
argmax where the drafts stop. Its device half is a small Triton kernel, run in Triton's
interpreter on paddle CPU tensors; its host half is numpy.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import attrs
import numpy as np
import pytest

paddle = pytest.importorskip("paddle")
pytest.importorskip("triton")

import specdec  # noqa: E402
from specdec.sdk import (DRAFT_PAD, BatchSampling, DeviceVerifyKernel, Drafts, KernelUnavailable,  # noqa: E402
                         PluginError, VerifyInputs, VerifyResult, accepted_prefix, assemble_output, at_positions,
                         greedy_tokens, load_triton_kernels, pad_beyond_drafts, prefix_match_result, verify_on_device)

try:
    load_triton_kernels()
except KernelUnavailable as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"Triton kernels unavailable: {exc}", allow_module_level=True)

import triton  # noqa: E402  (after load_triton_kernels, which prepares paddle for it on a GPU)
import triton.language as tl  # noqa: E402

from specdec.plugins.verify.greedy import GreedyVerify  # noqa: E402


@triton.jit
def _near_argmax_kernel(logits_ptr, draft_ptr, length_ptr, accepted_ptr, output_ptr, target_ptr, V, margin,
                        K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """One request (``program_id(0)``): rows ``0 .. length`` in order, the whole vocabulary in one block."""
    b = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, K_PAD)
    offs = tl.arange(0, BLOCK_V)
    length = tl.load(length_ptr + b)
    drafts = tl.load(draft_ptr + b * K + idx, mask=idx < K, other=-1)
    accepted = tl.full((), 0, tl.int64)
    stopped = tl.full((), 0, tl.int32)
    next_token = tl.full((), -1, tl.int64)
    targets = tl.full([K_PAD], -1, tl.int64)
    for j in range(0, K + 1):
        if j <= length:
            x = tl.load(logits_ptr + (b * (K + 1) + j) * V + offs, mask=offs < V, other=float("-inf"))
            best = tl.max(x, 0)
            argmax = tl.min(tl.where(x == best, offs, V), 0).to(tl.int64)
            targets = tl.where(idx == j, argmax, targets)
            draft = tl.load(draft_ptr + b * K + j, mask=j < length, other=0)
            x_draft = tl.max(tl.where(offs == draft, x, float("-inf")), 0)
            live = stopped == 0
            take = live & (j < length) & (x_draft >= best - margin)
            accepted += tl.where(take, 1, 0).to(tl.int64)
            stop_here = live & (take == 0)
            next_token = tl.where(stop_here, argmax, next_token)
            stopped = tl.where(stop_here, 1, stopped)
    output = tl.where(idx < accepted, drafts, tl.where(idx == accepted, next_token, -1))
    tl.store(output_ptr + b * (K + 1) + idx, output, mask=idx < K + 1)
    tl.store(target_ptr + b * (K + 1) + idx, targets, mask=idx < K + 1)
    tl.store(accepted_ptr + b, accepted)


#: Every launch of the kernel, so that a test can tell it ran.
LAUNCHES: list[tuple[int, ...]] = []


def near_argmax_on_device(inputs: VerifyInputs, *, margin: float) -> VerifyResult:
    """The rule on the device, from ``inputs.device_logits``. Host twin: :func:`near_argmax_rule`."""
    runtime = load_triton_kernels().runtime
    logits = inputs.device_logits
    batch, rows, vocab = (int(n) for n in logits.shape)
    draft_ids = runtime.from_numpy(np.ascontiguousarray(inputs.drafts.token_ids, dtype=np.int64), like=logits)
    lengths = runtime.from_numpy(np.ascontiguousarray(inputs.drafts.lengths, dtype=np.int64), like=logits)
    accepted = runtime.empty(logits, [batch], "int64")
    output = runtime.empty(logits, [batch, rows], "int64")
    targets = runtime.empty(logits, [batch, rows], "int64")
    arg = runtime.kernel_arg
    _near_argmax_kernel[(batch,)](arg(logits), arg(draft_ids), arg(lengths), arg(accepted), arg(output), arg(targets),
                                  vocab, float(margin), K=rows - 1, K_PAD=triton.next_power_of_2(rows),
                                  BLOCK_V=triton.next_power_of_2(vocab))
    LAUNCHES.append((batch, rows, vocab))
    return VerifyResult(runtime.to_numpy(accepted), runtime.to_numpy(output), runtime.to_numpy(targets))


def near_argmax_rule(inputs: VerifyInputs, *, margin: float) -> VerifyResult:
    """The rule on the host. Device twin: :func:`near_argmax_on_device`."""
    logits, drafts = inputs.logits, inputs.drafts
    argmax = greedy_tokens(logits)
    best = logits.max(axis=-1)[:, :-1]
    draft_logit = np.take_along_axis(logits[:, :-1], np.maximum(drafts.token_ids, 0)[..., None], axis=-1)[..., 0]
    accepted = accepted_prefix(draft_logit >= best - np.float32(margin), drafts.lengths)
    return VerifyResult(accepted, assemble_output(drafts.token_ids, accepted, at_positions(argmax, accepted)),
                        pad_beyond_drafts(argmax, drafts.lengths))


class NearArgmaxVerify(specdec.VerifyStrategy):
    """Accept drafts whose logit is within ``near_argmax_margin`` of the best; emit the argmax."""

    NAME = "near_argmax"
    DEVICE_KERNEL = DeviceVerifyKernel(launch=near_argmax_on_device, reference=near_argmax_rule)

    @attrs.frozen
    class Config:
        near_argmax_margin: float = 1.0

    def __init__(self, config=None, spec_config=None):
        super().__init__(config if config is not None else self.Config(), spec_config)

    def verify(self, inputs: VerifyInputs) -> VerifyResult:
        return verify_on_device(self, inputs, margin=self.config.near_argmax_margin)


class HostOnlyVerify(specdec.VerifyStrategy):
    """A strategy without a device kernel: ``verify_on_device`` falls back to this on host logits."""

    NAME = "host_only"
    SEEN: list = []

    def verify(self, inputs: VerifyInputs) -> VerifyResult:
        self.SEEN.append(inputs.device_logits)
        return prefix_match_result(inputs.drafts, greedy_tokens(inputs.logits))


def make_inputs(seed: int, *, batch: int = 8, width: int = 4, vocab: int = 100):
    """``(host inputs, device inputs)`` over the same logits: drafts often the argmax, else one
    of the next best few (so that the margin decides), sometimes random."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(batch, width + 1, vocab)).astype(np.float32) * 2
    ranked = np.argsort(-logits, axis=-1, kind="stable")
    lengths = rng.integers(1, width + 1, size=batch)
    draft_ids = np.full((batch, width), DRAFT_PAD, dtype=np.int64)
    for b in range(batch):
        for j in range(lengths[b]):
            pick = rng.random()
            draft_ids[b, j] = ranked[b, j, 0] if pick < 0.4 else ranked[b, j, rng.integers(1, 6)] if pick < 0.9 \
                else rng.integers(vocab)
    drafts = Drafts(draft_ids, lengths)
    sampling = BatchSampling(temperature=np.zeros(batch, np.float32), top_p=np.ones(batch, np.float32),
                             top_k=np.zeros(batch, np.int64), uniforms=rng.random((batch, width + 1, 2)))
    return (VerifyInputs(logits, drafts, sampling),
            VerifyInputs(None, drafts, sampling, device_logits=paddle.to_tensor(logits)))


def fields(result: VerifyResult) -> tuple:
    return result.accepted_lengths, result.output_tokens, result.target_tokens


def assert_same(got: VerifyResult, expected: VerifyResult):
    for name, g, e in zip(("accepted_lengths", "output_tokens", "target_tokens"), fields(got), fields(expected)):
        np.testing.assert_array_equal(g, e, err_msg=name)


@pytest.mark.parametrize("margin, seed", [(0.5, 2), (1.5, 0)])
def test_a_third_party_kernel_is_dispatched_through_what_it_declared(margin, seed):
    host, device = make_inputs(seed)
    strategy = NearArgmaxVerify(NearArgmaxVerify.Config(near_argmax_margin=margin))
    launches = len(LAUNCHES)
    got = strategy.verify(device)
    assert len(LAUNCHES) == launches + 1  # the strategy's own kernel ran
    assert_same(got, near_argmax_rule(host, margin=margin))
    # The batch is one where the margin matters: half or twice of it keeps other drafts.
    for other in (margin / 2, margin * 2):
        assert not np.array_equal(near_argmax_rule(host, margin=other).accepted_lengths, got.accepted_lengths)
    # Not a built-in's path: drafts within the margin that are not the argmax are kept.
    assert got.accepted_lengths.sum() > GreedyVerify().verify(host).accepted_lengths.sum()


def test_margin_zero_is_greedy():
    host, device = make_inputs(9)
    assert_same(NearArgmaxVerify(NearArgmaxVerify.Config(near_argmax_margin=0.0)).verify(device),
                GreedyVerify().verify(host))


def test_host_logits_run_the_numpy_twin():
    host, _ = make_inputs(1)
    launches = len(LAUNCHES)
    got = verify_on_device(NearArgmaxVerify, host, margin=0.8)
    assert len(LAUNCHES) == launches
    assert_same(got, near_argmax_rule(host, margin=0.8))


def test_a_strategy_without_a_kernel_verifies_on_host_logits():
    host, device = make_inputs(2)
    HostOnlyVerify.SEEN.clear()
    got = verify_on_device(HostOnlyVerify(), device)
    assert HostOnlyVerify.SEEN == [None]  # its verify saw host logits only
    assert_same(got, GreedyVerify().verify(host))


def test_the_deprecated_name_form_finds_the_registered_strategy():
    host, device = make_inputs(3)
    with pytest.warns(DeprecationWarning, match="deprecated"):
        got = verify_on_device("greedy", device)
    assert_same(got, GreedyVerify().verify(host))
    with pytest.warns(DeprecationWarning), pytest.raises(PluginError, match="did you mean 'greedy'"):
        verify_on_device("greedyy", device)


def test_what_is_not_a_strategy_or_a_kernel_is_refused():
    _, device = make_inputs(4)
    with pytest.raises(TypeError, match="is not a specdec.VerifyStrategy"):
        verify_on_device(object(), device)
    with pytest.raises(TypeError):
        DeviceVerifyKernel(launch=near_argmax_on_device, reference="near_argmax_rule")
