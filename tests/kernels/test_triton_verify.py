"""Each built-in verify strategy's device kernel against its host rule: the two halves of the
``DeviceVerifyKernel`` it declares (``launch``, a launcher of ``kernels/triton/verify.py``, and
``reference``, the strategy's own numpy rule).

Every case draws a random batch (fixed seed): logits with a peaked token per row (so that
sampled requests accept drafts too), drafts that are often the argmax or the second-best token
(acceptance, and ``topp``'s window rule) and otherwise random, draft lengths from 0 to ``k``,
and per-request temperature / top-k / top-p. The kernel runs in Triton's interpreter on paddle
CPU tensors and must return exactly the host rule's ``VerifyResult``: accepted lengths,
output tokens and target tokens.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import subprocess
import sys
import textwrap

import attrs
import numpy as np
import pytest

paddle = pytest.importorskip("paddle")
pytest.importorskip("triton")

from specdec.kernels.cpu import KernelUnavailable  # noqa: E402
from specdec.kernels.triton import load_triton  # noqa: E402

try:
    load_triton()
except KernelUnavailable as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"Triton kernels unavailable: {exc}", allow_module_level=True)

from specdec.kernels.triton import verify as triton_verify  # noqa: E402
from specdec.plugins.verify.greedy import GreedyVerify  # noqa: E402
from specdec.plugins.verify.rejection import RejectionVerify  # noqa: E402
from specdec.plugins.verify.target_match import TargetMatchVerify  # noqa: E402
from specdec.plugins.verify.topp import ToppVerify  # noqa: E402
from specdec.sdk import (DRAFT_PAD, BatchSampling, Drafts, PluginError, VerifyInputs, processed_probs,  # noqa: E402
                         verify_on_device)

STRATEGIES = {
    "greedy": GreedyVerify,
    "target_match": TargetMatchVerify,
    "rejection": RejectionVerify,
    "topp": ToppVerify,
}


def make_case(seed: int, *, batch: int = 5, width: int = 3, vocab: int = 211, mix: str = "mixed",
              filters: bool = True, draft_probs: bool = False):
    """A random verify batch as numpy arrays (the kernel's arguments, ``logits`` still numpy).

    :param mix: ``"greedy"`` (every temperature 0), ``"sampled"`` (all > 0) or ``"mixed"``.
    :param filters: when true, each request draws top-k (including 1 and >= V) and top-p
        settings, some of them off; when false every request has top-k 0 and top-p 1.
    :param draft_probs: also draw ``[B, k, V]`` draft distributions near the target's.
    """
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(batch, width + 1, vocab)).astype(np.float32) * 1.5
    peaks = rng.integers(vocab, size=(batch, width + 1))
    np.put_along_axis(logits, peaks[..., None], rng.uniform(2.0, 7.0, size=(batch, width + 1, 1)).astype(np.float32)
                      + np.take_along_axis(logits, peaks[..., None], axis=-1), axis=-1)

    lengths = rng.integers(0, width + 1, size=batch)
    if batch >= 2:
        lengths[0], lengths[1] = width, 0  # always a full and an empty request
    ranked = np.argsort(-logits, axis=-1, kind="stable")
    draft_ids = np.full((batch, width), DRAFT_PAD, dtype=np.int64)
    for b in range(batch):
        for j in range(lengths[b]):
            pick = rng.random()
            draft_ids[b, j] = ranked[b, j, 0] if pick < 0.6 else ranked[b, j, 1] if pick < 0.75 else rng.integers(vocab)

    sampled = {"greedy": np.zeros(batch, bool), "sampled": np.ones(batch, bool),
               "mixed": rng.random(batch) < 0.6}[mix]
    if mix == "mixed" and batch >= 2:
        sampled[:2] = [True, False]
    temperature = np.where(sampled, rng.uniform(0.3, 1.5, size=batch), 0.0).astype(np.float32)
    if filters:
        top_k = rng.choice([0, 1, 3, 10, 40, vocab, vocab + 7], size=batch).astype(np.int64)
        top_p = rng.choice([1.0, 0.3, 0.6, 0.8, 0.95, 0.999], size=batch).astype(np.float32)
    else:
        top_k = np.zeros(batch, dtype=np.int64)
        top_p = np.ones(batch, dtype=np.float32)
    uniforms = rng.random((batch, width + 1, 2))

    q = None
    if draft_probs and width > 0:
        noisy = logits[:, :width] + rng.normal(size=(batch, width, vocab)).astype(np.float32) * 0.5
        e = np.exp(noisy - noisy.max(axis=-1, keepdims=True))
        q = (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
    return dict(logits=logits, draft_ids=draft_ids, draft_lengths=lengths, temperature=temperature, top_k=top_k,
                top_p=top_p, uniforms=uniforms, draft_probs=q)


def inputs_of(case: dict, on_device: bool = False) -> VerifyInputs:
    """``case`` as verify inputs: host logits, or (``on_device``) device logits only."""
    drafts = Drafts(case["draft_ids"], case["draft_lengths"], case["draft_probs"])
    sampling = BatchSampling(temperature=case["temperature"], top_p=case["top_p"], top_k=case["top_k"],
                             uniforms=case["uniforms"])
    if on_device:
        return VerifyInputs(None, drafts, sampling, device_logits=paddle.to_tensor(case["logits"]))
    return VerifyInputs(case["logits"], drafts, sampling)


def fields(result) -> tuple:
    return result.accepted_lengths, result.output_tokens, result.target_tokens


def numpy_result(strategy: str, case: dict, **options):
    """``(accepted, output, target)`` of the strategy's host rule (its kernel's numpy twin) on ``case``."""
    return fields(STRATEGIES[strategy].DEVICE_KERNEL.reference(inputs_of(case), **options))


def kernel_result(strategy: str, case: dict, **options):
    """The same from the strategy's device kernel, on device logits (paddle CPU tensors here)."""
    return fields(STRATEGIES[strategy].DEVICE_KERNEL.launch(inputs_of(case, on_device=True), **options))


def assert_same(got, expected, case):
    names = ("accepted_lengths", "output_tokens", "target_tokens")
    for name, g, e in zip(names, got, expected):
        assert g.dtype == np.int64, name
        np.testing.assert_array_equal(g, e, err_msg=f"{name} (lengths {case['draft_lengths']}, "
                                                    f"temperature {case['temperature']}, top_k {case['top_k']}, "
                                                    f"top_p {case['top_p']})")


CASES = [("greedy", False)] + [(mix, filters) for mix in ("sampled", "mixed") for filters in (False, True)]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("mix, filters", CASES, ids=[f"{m}-{'filters' if f else 'plain'}" for m, f in CASES])
def test_matches_numpy_strategy(strategy, mix, filters):
    # The first seed (from a fixed start) whose batch both accepts and rejects drafts somewhere.
    for seed in range(1000 * list(STRATEGIES).index(strategy) + 100 * CASES.index((mix, filters)), 100_000):
        case = make_case(seed, batch=6, width=4, mix=mix, filters=filters)
        expected = numpy_result(strategy, case)
        if 0 < expected[0].sum() < case["draft_lengths"].sum():
            break
    assert_same(kernel_result(strategy, case), expected, case)


@pytest.mark.parametrize("mix, filters", [("sampled", False), ("sampled", True), ("mixed", True)])
def test_rejection_with_draft_probs(mix, filters):
    case = make_case(7 + filters, batch=6, width=4, mix=mix, filters=filters, draft_probs=True)
    assert_same(kernel_result("rejection", case), numpy_result("rejection", case), case)


def test_rejection_draft_probs_as_tensor():
    case = make_case(21, batch=4, width=2, vocab=97, mix="sampled", draft_probs=True)
    expected = numpy_result("rejection", case)
    args = dict(case, logits=paddle.to_tensor(case["logits"]), draft_probs=paddle.to_tensor(case["draft_probs"]))
    assert_same(triton_verify.rejection_verify(**args), expected, case)


def test_rejection_empty_residual_falls_back_to_p():
    """``q == p`` and drafts outside the top-k: every draft has ``p(d) = 0`` and is rejected,
    and ``max(0, p - q)`` has no mass, so the emitted token is sampled from ``p``."""
    case = make_case(33, batch=4, width=3, vocab=64, mix="sampled", filters=False)
    case["top_k"][:] = 3
    p = processed_probs(case["logits"], case["temperature"], case["top_k"], case["top_p"])
    case["draft_probs"] = np.ascontiguousarray(p[:, :3])
    for b in range(4):
        for j in range(case["draft_lengths"][b]):
            case["draft_ids"][b, j] = int(np.flatnonzero(p[b, j] == 0)[j])
    expected = numpy_result("rejection", case)
    assert not expected[0].any()
    assert_same(kernel_result("rejection", case), expected, case)


@pytest.mark.parametrize("max_candidate_len, verify_window", [(3, 1), (1, 2), (8, 3)])
def test_topp_config(max_candidate_len, verify_window):
    case = make_case(50 + max_candidate_len, batch=6, width=4, mix="mixed")
    options = dict(max_candidate_len=max_candidate_len, verify_window=verify_window)
    expected = numpy_result("topp", case, **options)
    assert_same(kernel_result("topp", case, **options), expected, case)
    assert_same(fields(ToppVerify(ToppVerify.Config(**options)).verify(inputs_of(case))), expected, case)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_no_drafts(strategy):
    """``k = 0``: only the target token at row 0."""
    case = make_case(70, batch=3, width=0, vocab=50, mix="mixed", draft_probs=strategy == "rejection")
    expected = numpy_result(strategy, case)
    got = kernel_result(strategy, case)
    assert_same(got, expected, case)
    assert got[1].shape == (3, 1) and not got[0].any()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_vocabulary_in_several_chunks(strategy, monkeypatch):
    """A vocabulary of several chunks (and a partial last one): the argmax, cuts, sums and the
    CDF scan carry across chunks, as they do on a GPU with a large vocabulary."""
    monkeypatch.setattr(triton_verify, "_BLOCK_V_INTERPRETER", 64)
    case = make_case(90 + len(strategy), batch=4, width=3, vocab=300, mix="mixed",
                     draft_probs=strategy == "rejection")
    assert_same(kernel_result(strategy, case), numpy_result(strategy, case), case)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_twin_is_the_strategys_host_path(strategy):
    """Without device logits a strategy verifies with its kernel's twin: one host rule each."""
    case = make_case(123, batch=6, width=4, mix="mixed", draft_probs=True)
    assert_same(fields(STRATEGIES[strategy]().verify(inputs_of(case))), numpy_result(strategy, case), case)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_strategies_verify_from_device_logits(strategy):
    """With ``device_logits`` (``kernels: triton``) the strategies verify through their declared
    kernel (``specdec.sdk.verify_on_device``) and return what their host path returns."""
    case = make_case(140 + len(strategy), batch=4, width=3, mix="mixed", draft_probs=strategy == "rejection")
    config = ToppVerify.Config(max_candidate_len=3, verify_window=1) if strategy == "topp" else None
    strategy_obj = STRATEGIES[strategy](config) if config is not None else STRATEGIES[strategy]()
    got = fields(strategy_obj.verify(inputs_of(case, on_device=True)))
    options = attrs.asdict(config) if config is not None else {}
    assert_same(got, numpy_result(strategy, case, **options), case)
    assert_same(fields(verify_on_device(strategy_obj, inputs_of(case), **options)), got, case)


def test_the_old_name_forms_still_work_with_a_warning():
    """``verify_on_device("topp", ...)`` (the strategy registered under that name) and the
    kernel library's ``fused_verify("topp", ...)``: deprecated, same results for one release."""
    case = make_case(77, batch=4, width=3, mix="mixed")
    expected = numpy_result("topp", case, max_candidate_len=3, verify_window=1)
    with pytest.warns(DeprecationWarning, match="verify_on_device"):
        got = verify_on_device("topp", inputs_of(case, on_device=True), max_candidate_len=3, verify_window=1)
    assert_same(fields(got), expected, case)
    with pytest.warns(DeprecationWarning, match="fused_verify"):
        got = triton_verify.fused_verify("topp", **dict(case, logits=paddle.to_tensor(case["logits"])),
                                         max_candidate_len=3, verify_window=1)
    assert_same(got, expected, case)
    with pytest.warns(DeprecationWarning), pytest.raises(PluginError, match="unknown verify strategy 'typical'"):
        verify_on_device("typical", inputs_of(case, on_device=True))
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="unknown verify strategy"):
        triton_verify.fused_verify("typical", **case)


def test_bad_options_and_shapes():
    case = make_case(2, batch=2, width=2, vocab=16)
    args = dict(case, logits=paddle.to_tensor(case["logits"]))
    with pytest.raises(ValueError, match="max_candidate_len"):
        triton_verify.topp_verify(**args, max_candidate_len=0)
    with pytest.raises(ValueError, match="uniforms"):
        triton_verify.greedy_verify(**dict(args, uniforms=case["uniforms"][:, :2]))
    with pytest.raises(ValueError, match="draft_ids"):
        triton_verify.greedy_verify(**dict(args, draft_ids=case["draft_ids"][:, :1]))


_COMPILE = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from specdec.kernels.triton import verify

    signature = {"logits_ptr": "*fp32", "draft_ptr": "*i64", "length_ptr": "*i64", "temp_ptr": "*fp32",
                 "top_k_ptr": "*i64", "top_p_ptr": "*fp32", "uniform_ptr": "*fp64", "q_ptr": "*fp32",
                 "accepted_ptr": "*i64", "output_ptr": "*i64", "target_ptr": "*i64",
                 "V": "i32", "max_candidates": "i32", "window": "i32"}
    for strategy, has_q in ((0, False), (2, True), (3, False)):
        constants = dict(K=4, STRATEGY=strategy, HAS_Q=has_q, BLOCK_V=verify._BLOCK_V_GPU, N_CHUNKS=48, K_PAD=8,
                         PIVOTS=verify._PIVOTS)
        source = ASTSource(fn=verify._fused_verify_kernel,
                           signature=dict(signature, **{name: "constexpr" for name in constants}),
                           constexprs=constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": verify._NUM_WARPS})
        assert compiled.asm["cubin"], strategy
    print("compiled")
""")


def test_compiles_for_a_gpu():
    """The kernel compiles for sm_90 (ptx and cubin; no GPU needed): the interpreter accepts
    some code that the compiler rejects (mismatched types across branches, for one)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]
