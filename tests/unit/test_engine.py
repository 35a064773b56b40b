"""The engine on the real model (loaded once per session, see tests/conftest.py): stop
conditions, exact lengths, stop strings, seeds, metrics invariants, batching."""

from __future__ import annotations

import numpy as np
import pytest

from specdec import SamplingParams
from specdec.engine.adaptive import StepCostModel
from specdec.workloads import code_edit_prompts

pytestmark = pytest.mark.slow

#: A question the default model answers in a few tokens, then stops at EOS (with `quantization: gguf`, as
#: with llama.cpp on the same file, it no longer answers "What is the capital of France?" with Paris).
CAPITAL = "What is the capital of Germany?"
STORY = "Tell me a short story about a dragon who learns to bake bread."
CODE = tuple(code_edit_prompts(5))
# min_ngram_size 1 drafts at almost every step, so short sampled runs really exercise the
# verify strategies (the default, 2, may draft nothing on a free-form story). The adaptive
# draft length is off: these tests exercise the mechanics of every draft the proposer makes.
NGRAM_GREEDY = {"method": "ngram", "verify_strategy": "greedy", "min_ngram_size": 1, "adaptive_draft_length": False}
NGRAM_REJECTION = {"method": "ngram", "verify_strategy": "rejection", "min_ngram_size": 1,
                   "adaptive_draft_length": False}


# ------------------------------------------------------------------------------------------------
# Stopping


def test_eos_stops_generation_unless_ignored(model_session, llm):
    eos = llm.engine.eos_token_ids
    [stopped] = model_session.run(None, [CAPITAL], SamplingParams(max_tokens=48))
    assert stopped.finish_reason == "stop", stopped
    ids = stopped.token_ids
    assert 0 < len(ids) < 48 and stopped.num_generated_tokens == len(ids)
    assert ids[-1] in eos and not any(t in eos for t in ids[:-1])
    assert "Berlin" in stopped.text

    limit = len(ids) + 6
    [ignored] = model_session.run(None, [CAPITAL], SamplingParams(max_tokens=limit, ignore_eos=True))
    assert ignored.finish_reason == "length"
    assert len(ignored.token_ids) == limit
    assert ignored.token_ids[: len(ids)] == ids  # the same tokens, EOS included, then more


def test_eos_with_speculation_matches_plain_decoding(model_session):
    """With speculation an EOS may come inside a chunk of accepted drafts: nothing after it may
    be kept, so the output equals plain decoding's."""
    [naive] = model_session.run(None, [CAPITAL], SamplingParams(max_tokens=48))
    [spec] = model_session.run(NGRAM_GREEDY, [CAPITAL], SamplingParams(max_tokens=48))
    assert spec.finish_reason == "stop"
    assert spec.token_ids == naive.token_ids and spec.text == naive.text


@pytest.mark.parametrize("spec", [None, NGRAM_GREEDY, NGRAM_REJECTION], ids=["naive", "ngram", "ngram+rejection"])
@pytest.mark.parametrize("max_tokens", [1, 7, 20])
def test_max_tokens_is_exact(model_session, spec, max_tokens):
    [out] = model_session.run(spec, [CODE[0]], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert out.finish_reason == "length"
    assert len(out.token_ids) == out.num_generated_tokens == max_tokens
    assert out.metrics.num_emitted_tokens == max_tokens
    # and they are the first tokens of the plain greedy output
    [longest] = model_session.run(None, [CODE[0]], SamplingParams(max_tokens=20, ignore_eos=True))
    assert out.token_ids == longest.token_ids[:max_tokens]


@pytest.mark.parametrize("fields, param, code", [
    ({"top_k": 49153}, "top_k", "invalid_value"),
    ({"top_k": 2**63}, "top_k", "invalid_value"),
    ({"stop": tuple(f"s{i}" for i in range(17))}, "stop", "invalid_value"),
    ({"stop": ("x" * 257,)}, "stop", "invalid_value"),
    ({"max_tokens": 8192}, "max_tokens", "context_length_exceeded"),
], ids=["top_k-above-vocab", "top_k-2**63", "17-stops", "long-stop", "prompt+max_tokens"])
def test_requests_are_checked_against_the_engine(llm, fields, param, code):
    """What SamplingParams cannot know is checked when the request is added: a one-line
    RequestError naming the field, and nothing queued."""
    from specdec.errors import RequestError

    engine = llm.engine
    with pytest.raises(RequestError) as info:
        engine.add_request(llm.encode_prompt(CAPITAL), SamplingParams(**fields))
    assert (info.value.param, info.value.code) == (param, code), str(info.value)
    assert str(info.value).startswith(f"{param}: ") and "\n" not in str(info.value)
    assert not engine.has_unfinished()


def test_prompt_plus_max_tokens_may_fill_the_context_exactly(llm):
    engine = llm.engine
    ids = llm.encode_prompt(CAPITAL)
    request = engine.add_request(ids, SamplingParams(max_tokens=engine.max_model_len - len(ids)))
    assert engine.abort_request(request.request_id)


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": 1e-40}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": 101.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"seed": 2**64}, "seed"), ({"seed": -1}, "seed"), ({"stop": ("",)}, "stop"),
])
def test_sampling_params_check_their_fields(fields, param):
    from specdec.errors import RequestError

    with pytest.raises(RequestError) as info:
        SamplingParams(**fields)
    assert info.value.param == param and str(info.value).startswith(f"{param}: ")


def test_sampling_params_bounds_that_pass():
    assert SamplingParams(top_k=-1).top_k == 0  # -1 is "off", as 0 is
    SamplingParams(temperature=1e-3, seed=2**64 - 1, max_tokens=1)
    SamplingParams(temperature=100.0, top_p=1.0, stop=("x" * 300,))  # the engine bounds the length


def test_a_failing_plugin_ends_only_its_own_request(model_session, monkeypatch):
    """A proposer whose propose() or on_step() raises for one request, a verify strategy that
    raises for another and a model forward that raises for a third end those requests (finish
    reason ``error``, the phase named); the rest of the batch finishes with exactly its solo
    output."""
    engine = model_session.llm.engine
    spec = {"method": "ngram", "min_ngram_size": 1, "adaptive_draft_length": False}
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    # The verify strategy finds its victim by a top_p no other request has (greedy ignores it).
    victim_sampling = SamplingParams(max_tokens=24, ignore_eos=True, top_p=0.999)
    healthy = [CODE[0], CODE[1], CAPITAL]
    solo = [model_session.run(spec, [p], sampling)[0] for p in healthy]

    model_session.llm.set_speculative_config(spec)
    proposer, verifier = engine.proposer, engine.verifier
    real_propose, real_on_step, real_verify = proposer.propose, proposer.on_step, verifier.verify
    victims = {}

    def propose(batch):
        if any(r.request_id == victims["propose"] and r.num_generated_tokens >= 3 for r in batch.requests):
            raise ValueError("proposer broke")
        return real_propose(batch)

    def on_step(batch, appended):
        if any(r.request_id == victims["on_step"] and r.num_generated_tokens >= 5 for r in batch.requests):
            raise KeyError("on_step broke")
        return real_on_step(batch, appended)

    def verify(inputs):
        if np.any(np.isclose(inputs.sampling.top_p, 0.999)):
            raise OverflowError("verify broke")
        return real_verify(inputs)

    # The model "fails" on a token only one prompt holds: its prefill rows.
    marker = engine.model_config.vocab_size - 1
    real_forward = engine.model.forward

    def forward(ids, meta, rows):
        if np.any(ids == marker):
            raise MemoryError("forward broke")
        return real_forward(ids, meta, rows)

    monkeypatch.setattr(proposer, "propose", propose)
    monkeypatch.setattr(proposer, "on_step", on_step)
    monkeypatch.setattr(verifier, "verify", verify)
    monkeypatch.setattr(engine.model, "forward", forward)
    add = lambda prompt, sp: engine.add_request(model_session.prompt_ids(prompt), sp)  # noqa: E731
    forward_victim = engine.add_request(model_session.prompt_ids(CODE[1])[:-1] + [marker], sampling)
    requests = [add(healthy[0], sampling)]
    victims["propose"] = add(CODE[2], sampling).request_id
    requests.append(add(healthy[1], sampling))
    victims["on_step"] = add(CODE[3], sampling).request_id
    verify_victim = add(CODE[4], victim_sampling)
    requests.append(add(healthy[2], sampling))
    by_id = {r.request_id: r for r in [*engine.waiting]}
    outputs = engine.run(by_id.values())

    failed = {o.request_id: o for o in outputs if o.finish_reason == "error"}
    assert set(failed) == {victims["propose"], victims["on_step"], verify_victim.request_id,
                           forward_victim.request_id}, \
        [(o.request_id, o.finish_reason) for o in outputs]
    assert "proposer 'ngram' failed: ValueError: proposer broke" == failed[victims["propose"]].error
    assert failed[victims["on_step"]].error.startswith("proposer 'ngram' on_step failed: KeyError")
    assert failed[verify_victim.request_id].error == "verify strategy 'rejection' failed: OverflowError: verify broke"
    assert failed[forward_victim.request_id].error == "model forward failed: MemoryError: forward broke"
    for prompt, request, reference in zip(healthy, requests, solo):
        out = request.output()
        assert out.finish_reason == "length" and out.error is None
        message = model_session.describe_divergence(prompt, reference.token_ids, out.token_ids,
                                                    label="a healthy request beside failing ones")
        assert message is None, message
    assert sum(r.metrics.num_accepted_tokens for r in requests) > 0
    assert not engine.has_unfinished() and engine.num_free_kv_blocks == engine.num_kv_blocks


def _stop_string(text: str) -> str:
    """A short piece from the middle of ``text`` (it may span tokens), first found at > 0."""
    for start in range(len(text) // 2, len(text) - 5):
        piece = text[start: start + 5]
        if piece.strip() and text.find(piece) > 0:
            return piece
    raise AssertionError(f"no stop string candidate in {text!r}")


@pytest.mark.parametrize("spec", [None, NGRAM_GREEDY], ids=["naive", "ngram"])
def test_stop_strings_cut_the_text(model_session, spec):
    full_params = SamplingParams(max_tokens=40, ignore_eos=True)
    [full] = model_session.run(None, [CODE[1]], full_params)
    stop = _stop_string(full.text)
    cut = full.text.find(stop)
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop, "never-in-the-output-zq"))
    [out] = model_session.run(spec, [CODE[1]], params)
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut], (stop, out.text)
    assert stop not in out.text
    assert len(out.token_ids) < 40
    assert out.token_ids == full.token_ids[: len(out.token_ids)]


def test_stop_string_that_never_appears(model_session):
    [full] = model_session.run(None, [CODE[1]], SamplingParams(max_tokens=40, ignore_eos=True))
    [out] = model_session.run(None, [CODE[1]], SamplingParams(max_tokens=40, ignore_eos=True,
                                                              stop="never-in-the-output-zq"))
    assert out.finish_reason == "length" and out.text == full.text and out.token_ids == full.token_ids


# ------------------------------------------------------------------------------------------------
# Seeds


SUFFIX = {"method": "suffix", "num_speculative_tokens": 5}
HYBRID = {"method": "mtp", "mtp_strategy": "with_ngram", "num_model_steps": 2, "num_speculative_tokens": 5}


@pytest.mark.parametrize("spec", [None, NGRAM_REJECTION, SUFFIX, HYBRID],
                         ids=["naive", "ngram+rejection", "suffix", "hybrid"])
def test_seed_reproducibility(model_session, spec):
    """A seeded sampled request's tokens depend on its seed alone: not on the greedy and
    seeded requests beside it (whose acceptance ``hybrid``'s leader choice learns from), nor
    on the requests before it (whose responses ``suffix``'s global tree drafts from)."""
    def params(seed):
        return SamplingParams(max_tokens=48, temperature=0.8, seed=seed, ignore_eos=True)

    llm = model_session.llm
    llm.set_speculative_config(spec)  # one proposer for the three runs (suffix keeps its tree)
    try:
        [alone] = llm.generate([STORY], params(7), use_chat_template=True)
        greedy_mates = [SamplingParams(max_tokens=48, ignore_eos=True)] * 2
        batch = llm.generate([STORY, STORY, CODE[0], CODE[1]], [params(7), params(8), *greedy_mates], use_chat_template=True)
        [again] = llm.generate([STORY], params(7), use_chat_template=True)
    finally:
        llm.set_speculative_config(None)
    assert alone.token_ids == batch[0].token_ids, "same seed, different tokens in a batch"
    assert alone.token_ids == again.token_ids, "same seed, different tokens on a second run"
    assert batch[0].token_ids != batch[1].token_ids, "different seeds gave the same 48 tokens"
    greedy = model_session.run(None, [STORY], SamplingParams(max_tokens=48, ignore_eos=True))[0]
    assert alone.token_ids != greedy.token_ids, "temperature 0.8 decoded exactly greedily"
    if spec is not None:
        assert alone.metrics.num_drafts > 0  # the rejection path really ran


# ------------------------------------------------------------------------------------------------
# Metrics


def _check_invariants(out, *, uncut: bool, k: int | None):
    m = out.metrics
    assert m.num_emitted_tokens == out.num_generated_tokens == len(out.token_ids)
    per_position = m.accepted_per_position
    assert all(a >= b for a, b in zip(per_position, per_position[1:])), per_position
    assert sum(per_position) == m.num_accepted_tokens
    assert not per_position or per_position[0] <= m.num_drafts
    assert m.num_accepted_tokens <= m.num_draft_tokens
    assert m.num_drafts <= m.num_steps
    if k is not None:
        assert len(per_position) <= k and m.num_draft_tokens <= k * m.num_drafts
    expected_rate = m.num_accepted_tokens / m.num_draft_tokens if m.num_draft_tokens else 0.0
    assert m.acceptance_rate == pytest.approx(expected_rate, rel=1e-12)
    assert m.mean_acceptance_length == pytest.approx(out.num_generated_tokens / m.num_steps, rel=1e-12)
    if uncut:  # every step emitted its accepted drafts plus one token
        assert m.num_emitted_tokens == m.num_steps + m.num_accepted_tokens


def test_metrics_invariants_ngram(model_session):
    outputs = model_session.run(NGRAM_GREEDY, CODE[:3], SamplingParams(max_tokens=48, ignore_eos=True),
                                max_num_seqs=3)
    for out in outputs:
        _check_invariants(out, uncut=True, k=5)
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0


def test_metrics_invariants_rejection_sampling(model_session):
    [out] = model_session.run(NGRAM_REJECTION, [CODE[2]],
                              SamplingParams(max_tokens=32, temperature=0.8, seed=3, ignore_eos=True))
    _check_invariants(out, uncut=True, k=5)
    assert out.metrics.num_drafts > 0


def test_metrics_invariants_with_eos_and_naive(model_session):
    [spec] = model_session.run(NGRAM_GREEDY, [CAPITAL], SamplingParams(max_tokens=48))
    _check_invariants(spec, uncut=False, k=5)
    [naive] = model_session.run(None, [CAPITAL], SamplingParams(max_tokens=48))
    _check_invariants(naive, uncut=True, k=0)
    assert naive.metrics.num_drafts == 0 and naive.metrics.num_steps == len(naive.token_ids)
    assert naive.metrics.mean_acceptance_length == 1.0


def test_num_speculative_tokens_bounds_drafts(model_session):
    spec = {"method": "ngram", "verify_strategy": "greedy", "num_speculative_tokens": 2}
    [out] = model_session.run(spec, [CODE[0]], SamplingParams(max_tokens=20, ignore_eos=True))
    _check_invariants(out, uncut=True, k=2)
    assert out.metrics.num_drafts > 0 and len(out.metrics.accepted_per_position) <= 2
    [naive] = model_session.run(None, [CODE[0]], SamplingParams(max_tokens=20, ignore_eos=True))
    assert out.token_ids == naive.token_ids


# ------------------------------------------------------------------------------------------------
# Batching (max_num_seqs > 1, set on the session engine's config between runs)


BATCH_PROMPTS = (CODE[3], CAPITAL, CODE[4])
#: The middle request stops at EOS early, so the third joins the batch while the first runs.
BATCH_PARAMS = (SamplingParams(max_tokens=32, ignore_eos=True), SamplingParams(max_tokens=32),
                SamplingParams(max_tokens=32, ignore_eos=True))


@pytest.fixture(scope="module")
def one_at_a_time(model_session):
    return [model_session.run(None, [p], sp)[0] for p, sp in zip(BATCH_PROMPTS, BATCH_PARAMS)]


@pytest.mark.parametrize("spec, max_num_seqs", [(None, 3), (None, 2), (NGRAM_GREEDY, 3)],
                         ids=["naive-3", "naive-2", "ngram-3"])
def test_batch_equals_one_at_a_time(model_session, one_at_a_time, spec, max_num_seqs):
    batch = model_session.run(spec, BATCH_PROMPTS, list(BATCH_PARAMS), max_num_seqs=max_num_seqs)
    assert one_at_a_time[1].finish_reason == "stop" and len(one_at_a_time[1].token_ids) < 32
    for i, (prompt, single, batched) in enumerate(zip(BATCH_PROMPTS, one_at_a_time, batch)):
        message = model_session.describe_divergence(prompt, single.token_ids, batched.token_ids,
                                                    label=f"request {i} in a batch of {max_num_seqs}")
        assert message is None, message
        assert batched.finish_reason == single.finish_reason and batched.text == single.text
    if spec is not None:
        assert sum(o.metrics.num_accepted_tokens for o in batch) > 0


def test_kv_blocks_are_released(model_session, llm):
    engine = llm.engine
    model_session.run(NGRAM_GREEDY, [CAPITAL, CODE[0]], SamplingParams(max_tokens=4), max_num_seqs=2,
                      cache=False)
    assert engine.num_free_kv_blocks == engine.num_kv_blocks
    assert not engine.has_unfinished()


def test_outputs_come_back_in_prompt_order(model_session):
    prompts = [CAPITAL, "Name three colours."]
    batch = model_session.run(None, prompts, SamplingParams(max_tokens=8), max_num_seqs=2)
    assert [o.prompt for o in batch] == prompts
    assert all(o.num_prompt_tokens == len(model_session.prompt_ids(p)) for o, p in zip(batch, prompts))
    assert np.all([o.elapsed_s > 0 for o in batch])


def test_abort_a_queued_and_a_running_request(llm):
    engine = llm.engine
    ids = llm.encode_prompt(CAPITAL, use_chat_template=True)
    running = engine.add_request(ids, SamplingParams(max_tokens=50))
    engine.step()
    queued = engine.add_request(ids, SamplingParams(max_tokens=50))
    assert engine.abort_request(queued.request_id) and queued.finish_reason == "abort"
    assert engine.abort_request(running.request_id) and running.finish_reason == "abort"
    assert not engine.abort_request(running.request_id)
    assert not engine.has_unfinished() and engine.num_free_kv_blocks == engine.num_kv_blocks


def test_adaptive_bar_is_a_plain_decode_step_even_beside_prompt_rows(model_session, monkeypatch):
    """Steps that also prefill (a prompt chunk, or a prompt's last rows) measure a draft against
    a plain decode step of the same requests: the prompt rows emit no token this step, and
    counting them made every draft look cheap (a batch of 64 verified every draft while it
    prefilled). Small ``max_num_batched_tokens`` makes such mixed steps happen here."""
    from specdec.engine import controller as controller_module

    engine = model_session.llm.engine
    calls, mixed_steps = [], []
    real_choose, real_propose = controller_module.choose_draft_lengths, engine._propose

    def choose(lengths, chances, base_rows, base_tokens, fixed, per_row):
        calls.append((base_rows, base_tokens))
        return real_choose(lengths, chances, base_rows, base_tokens, fixed, per_row)

    def propose(state):
        plan = state.plan
        mixed_steps.append(bool(plan.chunks) or any(r.num_uncomputed > 1 for r in plan.decodes))
        return real_propose(state)

    monkeypatch.setattr(controller_module, "choose_draft_lengths", choose)
    monkeypatch.setattr(engine, "_propose", propose)
    monkeypatch.setattr(engine.scheduler, "max_num_batched_tokens", 48)
    spec = {"method": "ngram", "verify_strategy": "greedy", "min_ngram_size": 1}
    model_session.run(spec, CODE[:3], SamplingParams(max_tokens=24, ignore_eos=True), max_num_seqs=3, cache=False)
    assert any(mixed_steps), "no step mixed prompt rows with drafting requests"
    assert calls and all(base_rows == base_tokens for base_rows, base_tokens in calls), calls


def test_adaptive_statistics_are_kept_per_method(model_session):
    """Switching methods and back resumes what the adaptive policy learned for the method:
    otherwise a benchmark that alternates naive and ngram prompt by prompt would refit the
    step cost from naive's 1-row steps (no slope to fit) before every ngram prompt."""
    llm = model_session.llm
    engine = llm.engine
    model_session.run(NGRAM_GREEDY | {"adaptive_draft_length": True}, [CODE[1]], SamplingParams(max_tokens=24),
                      cache=False)
    learned = engine.controller
    assert learned.step_costs.costs() != StepCostModel().costs()  # it has measured steps
    model_session.run(None, [CAPITAL], SamplingParams(max_tokens=8), cache=False)
    assert engine.controller is not learned
    llm.set_speculative_config({"method": "ngram"})
    assert engine.controller is learned


def test_proposer_draft_classes_are_checked(model_session, monkeypatch):
    """A proposer's ``Drafts.classes`` must be one non-negative integer label per request:
    anything else ends the request with a message naming the proposer."""
    import specdec
    from specdec.errors import SpecdecError

    engine = model_session.llm.engine
    model_session.llm.set_speculative_config({"method": "ngram", "min_ngram_size": 1})
    real_propose = engine.proposer.propose

    def propose(batch):
        drafts = real_propose(batch)
        return specdec.Drafts(drafts.token_ids, drafts.lengths, classes=np.full(len(batch) + 1, 2))

    monkeypatch.setattr(engine.proposer, "propose", propose)
    ids = model_session.llm.encode_prompt(CODE[0], use_chat_template=True)
    request = engine.add_request(ids, SamplingParams(max_tokens=8, ignore_eos=True))
    try:
        while not request.finished:
            engine.step()
    finally:
        engine.abort_request(request.request_id)
    assert request.finish_reason == "error"
    assert request.error.startswith(f"proposer 'ngram' failed: {SpecdecError.__name__}: proposer 'ngram' returned "
                                    "draft classes that are not 1 non-negative"), request.error
    assert not engine.has_unfinished() and engine.num_free_kv_blocks == engine.num_kv_blocks


# ------------------------------------------------------------------------------------------------
# KV cache storage


def test_kv_cache_dtype_auto_is_float16_and_float32_holds_half_the_blocks(model_session, llm):
    """The default engine keeps float16 keys and values; an engine asked for float32 gets half
    the blocks from the same memory budget, and both answer the same question correctly (the
    cache's rounding is far too small to change a clear answer)."""
    import specdec

    assert llm.engine.kv_cache_dtype == "float16"
    assert {str(cache.dtype) for cache in llm.engine.attention._caches} == {"paddle.float16"}
    wide = specdec.LLM(progress=False, kv_cache_dtype="float32", kv_cache_memory_gb=0.25)
    narrow = specdec.LLM(progress=False, kv_cache_memory_gb=0.25)
    assert wide.engine.kv_cache_dtype == "float32"
    assert {str(cache.dtype) for cache in wide.engine.attention._caches} == {"paddle.float32"}
    assert narrow.engine.kv.pool.num_blocks == 2 * wide.engine.kv.pool.num_blocks
    sampling = SamplingParams(max_tokens=24, temperature=0.0)
    for engine_llm in (wide, narrow):
        [answer] = engine_llm.generate(CAPITAL, sampling, use_chat_template=True)
        assert "Berlin" in answer.text, answer.text


def test_engine_resolves_the_kv_cache_dtype():
    from specdec.engine.build import resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype("auto", "cpu", "float16") == "float16"
    assert resolve_kv_cache_dtype("auto", "cpu", "float32") == "float32"
    assert resolve_kv_cache_dtype("auto", "paddle", "float16") == "float32"
    assert resolve_kv_cache_dtype("float32", "cpu", "float16") == "float32"


def test_paddle_backend_refuses_a_float16_cache():
    from specdec.errors import SpecdecError
    from specdec.plugins.attention.paddle_backend import PaddleAttention

    with pytest.raises(SpecdecError, match="kv_cache_dtype: attention_backend 'paddle' keeps a float32 cache"):
        PaddleAttention().setup(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, dtype="float16",
                                rope_cos=np.ones((4, 8), np.float32), rope_sin=np.zeros((4, 8), np.float32))


# ------------------------------------------------------------------------------------------------
# The step path: resolved configs only, lifecycle calls in the step that admits a request


def test_engine_refuses_an_unresolved_config_before_loading_anything():
    from specdec import SpeculativeConfig
    from specdec.config import EngineConfig
    from specdec.engine import Engine
    from specdec.errors import SpecdecError

    with pytest.raises(SpecdecError, match="the engine takes a resolved speculative config"):
        Engine(EngineConfig(model="/nonexistent/model.gguf", speculative=SpeculativeConfig(method="ngram")),
               progress=False)


def test_llm_keeps_a_resolved_config_and_resolves_a_hand_built_one(llm):
    from specdec import SpeculativeConfig
    from specdec.config import build_speculative_config
    from specdec.errors import SpecdecError

    plugins, before = llm.engine.plugins, llm.speculative_config
    resolved = build_speculative_config({"method": "ngram", "num_speculative_tokens": 3}, plugins)
    try:
        llm.set_speculative_config(resolved)
        assert llm.speculative_config is resolved  # used as is, not flattened and parsed again
        llm.set_speculative_config(SpeculativeConfig(method="suffix"))
        assert llm.speculative_config.is_resolved(plugins)
        assert llm.speculative_config.num_speculative_tokens == 5
        with pytest.raises(SpecdecError, match="resolved speculative config"):
            llm.engine.set_speculative_config(SpeculativeConfig(method="ngram"))
    finally:
        llm.set_speculative_config(before)


def test_on_request_start_runs_in_the_step_that_admits_the_request(model_session, monkeypatch):
    """Once per request, in the step that admits it; a failure ends that request alone."""
    engine = model_session.llm.engine
    model_session.llm.set_speculative_config({"method": "ngram"})
    real_start = engine.proposer.on_request_start
    started = []

    def on_request_start(request):
        started.append(request.request_id)
        if request.request_id == "start-bad":
            raise RuntimeError("no index")
        real_start(request)

    monkeypatch.setattr(engine.proposer, "on_request_start", on_request_start)
    monkeypatch.setattr(engine.scheduler, "max_num_seqs", 4)  # both admitted in one step
    # Prompts without a common prefix (not even the chat template's): a request whose prefix
    # another one is computing waits to share its blocks.
    good = engine.add_request(model_session.prompt_ids(CAPITAL, chat=False),
                              SamplingParams(max_tokens=32, ignore_eos=True), request_id="start-good")
    bad = engine.add_request(model_session.prompt_ids(STORY, chat=False), SamplingParams(max_tokens=6),
                             request_id="start-bad")
    assert started == []
    finished = engine.step()
    assert started == ["start-good", "start-bad"]
    assert [r.request_id for r in finished] == ["start-bad"]  # start-good has 31+ tokens to go
    assert bad.output().error == "proposer 'ngram' on_request_start failed: RuntimeError: no index"
    [output] = engine.run([good])
    assert output.finish_reason == "length" and output.num_generated_tokens == 32
    assert started == ["start-good", "start-bad"]
    assert not engine.has_unfinished() and engine.num_free_kv_blocks == engine.num_kv_blocks


def test_a_batch_where_few_requests_draft_is_verified_without_padded_copies(model_session, monkeypatch):
    """Padding every request's logits to the longest draft would copy mostly padding. A greedy
    step verifies from the argmax of the step's own rows (``PickedRows``: no ``[B, k+1, V]``
    array is built); where the whole rows are read (here logprobs), the requests without
    drafts and those with drafts are verified apart, at their own widths. The tokens stay
    naive's either way."""
    from specdec.engine.batch import PickedRows
    from specdec.workloads import chat_prompts

    engine = model_session.llm.engine
    kinds = []
    real = engine._verify_group

    def verify_group(state):
        logits = state.logits
        if isinstance(logits, PickedRows):
            kinds.append(("picked", len(state.plan.decodes), logits.index.shape[1]))
        else:
            kinds.append(("array", len(state.plan.decodes), logits.shape[1]))
        return real(state)

    monkeypatch.setattr(engine, "_verify_group", verify_group)
    prompts = (*chat_prompts(5), *CODE[:3])
    spec = {"method": "ngram", "verify_strategy": "rejection", "num_speculative_tokens": 5, "adaptive_draft_length": False}
    for sampling in (SamplingParams(max_tokens=24, ignore_eos=True),
                     SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1)):
        kinds.clear()
        naive = model_session.run(None, prompts, sampling, max_num_seqs=8)
        outputs = model_session.run(spec, prompts, sampling, max_num_seqs=8, cache=False)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in naive]
        if sampling.logprobs is None:
            # padded steps went whole, as picked rows
            assert any(kind == "picked" and size == 8 and width > 1 for kind, size, width in kinds), kinds
        else:
            assert [e.logprob for o in outputs for e in o.logprobs] == \
                pytest.approx([e.logprob for o in naive for e in o.logprobs], abs=1e-4)
            # some steps went as two groups: the requests without drafts at width 1
            assert all(kind == "array" for kind, _, _ in kinds), kinds
            assert any(width == 1 and size < 8 for _, size, width in kinds), kinds


def test_a_model_proposer_s_catch_up_is_told_by_the_rows_it_is_handed():
    """The first proposal after a prefill hands a model proposer its whole prompt's states,
    one step after the prefill's own call (which hands nothing): that call is a catch-up, not
    the proposer's usual time, which the controller weighs drafts against."""
    from specdec.engine.engine import Engine
    from specdec.proposer import ProposalRequest

    def request(rows: int) -> ProposalRequest:
        return ProposalRequest("r", np.zeros(300, np.int64), 200, 1, hidden_positions=np.arange(rows))

    none = np.zeros(1, np.int64)
    assert Engine._hidden_catch_up([request(0)], np.array([1]), none) == (False, 0, False)  # the prefill's step
    assert Engine._hidden_catch_up([request(200)], np.array([1]), none) == (True, 200, True)  # the prompt's states
    assert Engine._hidden_catch_up([request(2), request(1)], np.array([1, 1]),
                                   np.zeros(2, np.int64)) == (False, 0, True)  # a usual step
    assert Engine._hidden_catch_up([request(2), request(9)], np.array([1, 5]),
                                   np.zeros(2, np.int64)) == (True, 9, True)  # left out 3 steps
    # rows handed at the end of the last step (Proposer.catch_up) count as handed now
    assert Engine._hidden_catch_up([request(0)], np.array([1]), np.array([2])) == (False, 0, True)
    assert Engine._hidden_catch_up([request(0)], np.array([1]), np.array([200])) == (True, 200, True)
