"""GPU checks: skipped without CUDA (CI has none); run them on a machine with a GPU."""

from __future__ import annotations

import pytest

paddle = pytest.importorskip("paddle")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0),
                       reason="needs a CUDA build of paddle and a GPU"),
]


def test_greedy_ngram_equals_naive_on_gpu():
    import specdec

    llm = specdec.LLM(progress=False)
    sampling = specdec.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompt = "def fibonacci(n):"
    plain = llm.generate(prompt, sampling)[0]
    llm.set_speculative_config({"method": "ngram", "verify_strategy": "greedy"})
    fast = llm.generate(prompt, sampling)[0]
    assert fast.token_ids == plain.token_ids
