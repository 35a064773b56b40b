"""The engine on the Triton kernels (``kernels: triton``), run in Triton's interpreter on the
CPU, against the ``paddle`` reference path on the real model.

``kernels: triton`` puts attention on the ``triton`` backend (RoPE + cache write and paged
attention, one launch each per layer) and verification on the fused verify kernel (the
logits stay a tensor; only accepted lengths and tokens come back). Everything else is the
reference path's paddle float32 ops, so the tokens must be the reference's.
"""

from __future__ import annotations

import pytest

import specdec
from specdec.errors import SpecdecError

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of Germany is",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
]
#: Small pools: the float32 caches of two engines stay a few MB.
ENGINE = dict(num_kv_blocks=48, max_model_len=512, progress=False)


@pytest.fixture(scope="module")
def triton_llm():
    return specdec.LLM(kernels="triton", **ENGINE)


@pytest.fixture(scope="module")
def reference_llm(paddle_llm):
    """The session's ``paddle`` path engine (tests/conftest.py)."""
    assert paddle_llm.engine.kernels == "paddle"
    return paddle_llm


def _outputs(llm, prompts, sampling, speculative=None):
    llm.set_speculative_config(speculative)
    return llm.generate(prompts, sampling)


def _tokens(llm, prompts, sampling, speculative=None):
    return [out.token_ids for out in _outputs(llm, prompts, sampling, speculative)]


def test_triton_engine_uses_the_triton_backend(triton_llm):
    engine = triton_llm.engine
    assert engine.kernels == "triton"
    assert engine.attention.NAME == "triton"
    assert engine.quantization == "none"


def test_greedy_generation_equals_the_reference(triton_llm, reference_llm):
    # 4 tokens: a prefill step, then decode steps batched (each step runs every layer's kernels
    # in Triton's interpreter, which is slow; a request alone runs in the ngram test below).
    sampling = specdec.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    expected = _tokens(reference_llm, PROMPTS, sampling)
    assert _tokens(triton_llm, PROMPTS, sampling) == expected  # batched: a prefill next to decode rows


def test_ngram_on_triton_equals_naive_reference(triton_llm, reference_llm):
    """Draft rows through the attention kernel and k > 0 through the fused verify kernel."""
    sampling = specdec.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = _tokens(reference_llm, PROMPTS[1:], sampling)
    outputs = _outputs(triton_llm, PROMPTS[1:], sampling, {"method": "ngram", "num_speculative_tokens": 3})
    assert [out.token_ids for out in outputs] == expected
    assert sum(out.metrics.num_draft_tokens for out in outputs) > 0


def test_sampling_on_triton_equals_the_reference(triton_llm, reference_llm):
    """Sampled requests: the fused kernel draws with the same per-request uniforms as numpy."""
    sampling = specdec.SamplingParams(max_tokens=4, temperature=0.8, seed=7, ignore_eos=True)
    assert _tokens(triton_llm, PROMPTS[:1], sampling) == _tokens(reference_llm, PROMPTS[:1], sampling)


def test_triton_kernels_without_a_gpu_or_the_interpreter_is_a_one_line_error(monkeypatch):
    from specdec.kernels.triton import load_triton

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    load_triton.cache_clear()
    try:
        with pytest.raises(SpecdecError, match=r"kernels: the Triton kernels need a CUDA device"):
            specdec.LLM(kernels="triton", **ENGINE)
    finally:
        load_triton.cache_clear()
