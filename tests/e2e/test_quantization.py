"""Weight-only quantization on the real model: the logits stay close to the float path's,
speculation never changes the quantized model's own greedy output, and computing on the GGUF
blocks as stored keeps less memory resident than the float16 path.

Tolerances (measured on the default SmolLM2-135M Q4_1 file, 52 positions of a chat prompt,
against the float32 path over the same dequantized weights; logits have a standard deviation
of about 7.8 there): ``gguf`` max |error| 2.16, RMS 0.28, top-1 agreement 100%; ``wint8`` max
2.90, RMS 0.47, top-1 100%. The error is that of quantizing each row's activations to int8 per 32,
as llama.cpp does for these formats (docs/models.md, Accuracy).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import specdec
from specdec import SamplingParams
from specdec.attention import AttentionMetadata
from specdec.workloads import code_edit_prompts

pytestmark = pytest.mark.slow

#: quantization -> (largest |logit error|, RMS error, least top-1 agreement) against float32.
TOLERANCES = {"gguf": (4.5, 0.75, 0.9), "wint8": (4.5, 0.75, 0.9)}
QUESTION = "What is the capital of Germany? Answer in one word, then explain the history of the city in detail."

PROMPTS = tuple(code_edit_prompts(3))
SAMPLING = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
#: Every method, each verifying every draft (adaptive_draft_length off), greedy-verified and
#: with the default rejection sampling.
METHODS = {
    "ngram": {"method": "ngram", "adaptive_draft_length": False},
    "suffix": {"method": "suffix", "adaptive_draft_length": False},
    "mtp": {"method": "mtp", "num_model_steps": 2, "num_speculative_tokens": 2, "adaptive_draft_length": False},
    "hybrid": {"method": "mtp", "mtp_strategy": "with_ngram", "num_model_steps": 1, "num_speculative_tokens": 4,
               "adaptive_draft_length": False},
    "ngram+greedy": {"method": "ngram", "verify_strategy": "greedy", "adaptive_draft_length": False},
}

_ENGINES: dict[str, specdec.LLM] = {}


def engine(quantization: str) -> specdec.LLM:
    """One engine per quantization for the whole module (float32 weights for ``none``)."""
    if quantization not in _ENGINES:
        options = {"dtype": "float32"} if quantization == "none" else {}
        _ENGINES[quantization] = specdec.LLM(quantization=quantization, progress=False, **options)
    return _ENGINES[quantization]


@pytest.fixture(scope="module", autouse=True)
def _release_engines(llm):
    # ``gguf`` is the default (``quantization: auto`` on the CPU kernels with a GGUF file): the
    # session's engine (tests/conftest.py) is that engine, loaded once.
    assert llm.engine.quantization == "gguf"
    _ENGINES["gguf"] = llm
    yield
    _ENGINES.clear()


def all_logits(llm: specdec.LLM, ids) -> np.ndarray:
    """Logits at every position of ``ids``, one prefill in blocks of the engine's own pool."""
    eng = llm.engine
    ids = np.asarray(ids, dtype=np.int64)
    blocks = [eng.kv.pool.allocate() for _ in range(-(-len(ids) // eng.block_size))]
    try:
        meta = AttentionMetadata.build([len(ids)], [0], [blocks], eng.block_size)
        return np.asarray(eng.model.forward(ids, meta, np.arange(len(ids), dtype=np.int64)))
    finally:
        for block in blocks:
            eng.kv.pool.release(block)


@pytest.mark.parametrize("quantization", list(TOLERANCES))
def test_quantized_logits_are_close_to_the_float_path(quantization):
    reference_llm = engine("none")
    ids = reference_llm.encode_prompt(QUESTION, use_chat_template=True)
    reference = all_logits(reference_llm, ids)
    llm = engine(quantization)
    assert llm.engine.quantization == quantization
    got = all_logits(llm, ids)
    error = np.abs(got - reference)
    worst, rms, agreement = TOLERANCES[quantization]
    top1 = float(np.mean(got.argmax(-1) == reference.argmax(-1)))
    message = (f"{quantization}: max {error.max():.2f}, RMS {np.sqrt((error ** 2).mean()):.3f}, top-1 {top1:.2f} "
               f"(logit std {reference.std():.1f})")
    assert error.max() < worst and np.sqrt((error ** 2).mean()) < rms and top1 >= agreement, message
    # Quantization does change the logits: a test that compared the float path with itself
    # would pass the line above too.
    assert np.sqrt((error ** 2).mean()) > 0.01, message


#: ``gguf`` is not repeated here: it is the default engine's quantization, on which every method
#: is already checked against plain greedy decoding, alone and batched (tests/e2e/test_lossless.py:
#: ngram with each verify strategy; test_suffix.py, test_mtp.py, test_hybrid.py; and through the
#: server with default settings, tests/server/test_default_lossless.py).
@pytest.mark.parametrize("quantization", ["wint8", "wint4"])
def test_speculation_keeps_the_quantized_greedy_output(quantization):
    llm = engine(quantization)
    assert llm.engine.quantization == quantization
    eng = llm.engine
    saved = eng.scheduler.max_num_seqs
    try:
        for batch in (1, len(PROMPTS)):
            eng.scheduler.max_num_seqs = batch
            llm.set_speculative_config(None)
            reference = [o.token_ids for o in llm.generate(list(PROMPTS), SAMPLING, use_chat_template=True)]
            for label, spec in METHODS.items():
                llm.set_speculative_config(spec)
                outputs = llm.generate(list(PROMPTS), SAMPLING, use_chat_template=True)
                assert [o.token_ids for o in outputs] == reference, f"{quantization}, {label}, batch {batch}"
                drafted = sum(o.metrics.num_draft_tokens for o in outputs)
                assert drafted > 0, f"{quantization}, {label}: nothing was drafted"
    finally:
        eng.scheduler.max_num_seqs = saved
        llm.set_speculative_config(None)


#: VmHWM (this process's peak resident set) rather than ru_maxrss, which Linux carries over
#: from the pytest process that forked this one.
def test_a_forward_pass_is_one_native_call_the_loop_s_floats_bit_for_bit():
    """docs/models.md: the embedding, the first layer's q/k/v, every layer (the cpu attention
    backend's calls inside) and the LM head in one call (``specdec_q_forward``). Layer by layer
    (as with ``hidden_layers``, or another attention backend) it is 3 + 2 x layers calls; both
    give the same floats, the KV cache the same rows, the prompt's and a decode step's alike,
    with logits of every row or of some."""
    llm = engine("gguf")
    eng, model = llm.engine, llm.engine.model
    layers = model.config.num_layers
    calls = []

    class Counting:
        def __init__(self, ops):
            self._ops = ops

        def __getattr__(self, name):
            op = getattr(self._ops, name)

            def counted(*args):
                calls.append(name)
                return op(*args)
            return counted

    ids = np.asarray(llm.encode_prompt(QUESTION, use_chat_template=True), dtype=np.int64)
    prompt, rows = ids[:-3], ids[-3:]

    def run(**options):
        """Logits and hidden states of the prompt's prefill (its last row's logits), then of 3
        rows over it (logits of two rows, then of all three)."""
        blocks = [eng.kv.pool.allocate() for _ in range(-(-len(ids) // eng.block_size))]
        try:
            results = []
            for chunk, context, logit_rows in ((prompt, 0, [len(prompt) - 1]), (rows, len(prompt), [0, 2]),
                                               (rows, len(prompt), [0, 1, 2])):
                meta = AttentionMetadata.build([len(chunk)], [context], [blocks], eng.block_size)
                logits, hidden = model.forward(chunk, meta, np.asarray(logit_rows, dtype=np.int64),
                                               return_hidden=True, **options)
                results += [np.asarray(logits), np.asarray(hidden)]
            return results
        finally:
            for block in blocks:
                eng.kv.pool.release(block)

    weights, attention = model.weights, model.attention
    saved = weights.ops, attention.ops
    weights.ops, attention.ops = Counting(weights.ops), Counting(attention.ops)
    try:
        fused = run()
        fused_calls, calls[:] = list(calls), []
        by_layer = run(hidden_layers=(layers,))
    finally:
        weights.ops, attention.ops = saved
    assert fused_calls == ["specdec_q_forward"] * 3
    assert len(calls) == 3 * (3 + 2 * layers) == 189, sorted(set(calls))
    assert calls.count("specdec_q_layer_tail_qkv") == 3 * (layers - 1)
    assert calls.count("specdec_paged_attention") == 3 * layers
    for got, want in zip(fused, by_layer):
        np.testing.assert_array_equal(got, want)

    # A backend that subclasses the cpu one with a forward of its own gets that forward called.
    seen = []

    class OwnForward(type(attention)):
        def forward(self, layer, qkv, meta):
            seen.append(layer)
            return super().forward(layer, qkv, meta)

    attention.__class__ = OwnForward
    try:
        np.testing.assert_array_equal(run()[2], fused[2])
    finally:
        attention.__class__ = OwnForward.__bases__[0]
    assert seen == list(range(layers)) * 3


_RSS_SCRIPT = """
import json, sys
import specdec
llm = specdec.LLM(quantization=sys.argv[1], progress=False)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"quantization": llm.engine.quantization, "weight_dtype": llm.engine.weight_dtype,
                  "peak_mb": int(status["VmHWM"].split()[0]) / 1024, "current_mb": int(status["VmRSS"].split()[0]) / 1024}))
"""


def _resident(quantization: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, quantization], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_gguf_blocks_keep_less_memory_resident_than_float16():
    """Each load in a fresh process; peak and current resident set sizes from the kernel."""
    gguf, float16 = _resident("gguf"), _resident("none")
    assert gguf["quantization"] == "gguf" and float16["quantization"] == "none"
    assert float16["weight_dtype"] == "float16"
    summary = f"gguf {gguf}, float16 {float16}"
    assert gguf["peak_mb"] < float16["peak_mb"] and gguf["current_mb"] < float16["current_mb"], summary
    # The float16 weights alone are ~270 MB, the file's blocks ~100 MB: a clear gap, not noise.
    assert float16["current_mb"] - gguf["current_mb"] > 100, summary


def test_quantization_errors_are_one_line():
    from specdec.errors import SpecdecError

    with pytest.raises(SpecdecError, match="quantization: wint8 needs the CPU kernels"):
        specdec.LLM(quantization="wint8", kernels="paddle", progress=False)
