"""The model-based proposer contract on the real default model: ``setup(context)`` with the
target handle, ``NEEDS_HIDDEN_STATES`` (hidden states and their positions with every
proposal), and cache layers of the proposer's own over the paged KV cache.

The proposers here are test instruments: they record what they receive and draft by a simple
lookup (so that some drafts are accepted and some rejected), and they check the contract's
promises against the target itself."""

from __future__ import annotations

import numpy as np
import pytest

import specdec
from specdec import SamplingParams
from specdec.plugin_manager import load_plugins
from specdec.workloads import code_edit_prompts

pytestmark = pytest.mark.slow

PROMPTS = tuple(code_edit_prompts(3))
SAMPLING = SamplingParams(max_tokens=40, ignore_eos=True)


def lookup_draft(token_ids: np.ndarray, max_draft_len: int) -> list[int]:
    """What followed the previous occurrence of the last token (right or wrong: both happen)."""
    if max_draft_len <= 0 or len(token_ids) < 2:
        return []
    hits = np.flatnonzero(token_ids[:-1] == token_ids[-1])
    if len(hits) == 0:
        return []
    start = int(hits[-1]) + 1
    return token_ids[start: start + max_draft_len].tolist()


class HiddenRecorder(specdec.Proposer):
    """Records every proposal's hidden states, positions and block table."""

    NAME = "test_hidden_recorder"
    NEEDS_HIDDEN_STATES = True

    def setup(self, context: specdec.ProposerContext) -> None:
        self.context = context
        self.seen: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray, int, int]]] = {}

    def propose(self, batch: specdec.ProposalBatch) -> specdec.Drafts:
        for request in batch.requests:
            self.seen.setdefault(request.request_id, []).append(
                (np.asarray(request.hidden_positions).copy(), np.asarray(request.hidden_states).copy(),
                 np.array(request.block_table), len(request.token_ids), request.max_draft_len))
            assert not request.block_table.flags.writeable
        return specdec.Drafts.from_lists([lookup_draft(r.token_ids, r.max_draft_len) for r in batch.requests])


class PagedRows(specdec.Proposer):
    """Writes one row per hidden state into a cache layer of its own and checks what attention
    over that layer returns against a fresh full recomputation."""

    NAME = "test_paged_rows"
    NEEDS_HIDDEN_STATES = True

    def setup(self, context: specdec.ProposerContext) -> None:
        c = context.model_config
        self.context = context
        self.layers = context.create_cache_layers(1)
        self.width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        rng = np.random.default_rng(0)
        self.projection = rng.standard_normal((c.hidden_size, self.width)).astype(np.float32) / np.sqrt(c.hidden_size)
        #: qkv row of each position, keyed by the tokens up to it (rows depend on those only).
        self.rows: dict[bytes, np.ndarray] = {}
        self.checked_rows = 0
        self.worst_error = 0.0

    def _qkv(self, hidden: np.ndarray) -> np.ndarray:
        c = self.context.model_config
        qkv = np.tanh(hidden @ self.projection)
        qkv[:, : c.num_heads * c.head_dim] *= c.head_dim ** -0.5
        return qkv.astype(np.float32)

    def propose(self, batch: specdec.ProposalBatch) -> specdec.Drafts:
        import paddle

        for request in batch.requests:
            positions = np.asarray(request.hidden_positions)
            if len(positions) == 0:
                continue
            qkv = self._qkv(np.asarray(request.hidden_states))
            for p, row in zip(positions, qkv):
                self.rows[request.token_ids[: p + 1].tobytes()] = row
            start = int(positions[0])
            meta = specdec.AttentionMetadata.build([len(positions)], [start], [request.block_table],
                                                   self.context.block_size)
            self.layers.prepare(meta)
            got = np.asarray(self.layers.forward(0, paddle.to_tensor(qkv), meta))
            want = self._recompute(request.token_ids, int(positions[-1]))[start:]
            error = float(np.max(np.abs(got - want) / (1 + np.abs(want))))
            self.worst_error = max(self.worst_error, error)
            self.checked_rows += len(positions)
        return specdec.Drafts.from_lists([lookup_draft(r.token_ids, r.max_draft_len) for r in batch.requests])

    def _recompute(self, token_ids: np.ndarray, last: int) -> np.ndarray:
        """Attention of positions 0..last from the recorded rows, in a fresh backend."""
        import paddle

        qkv = np.stack([self.rows[token_ids[: p + 1].tobytes()] for p in range(last + 1)])
        c, block = self.context.model_config, self.context.block_size
        fresh = type(self.layers)(self.layers.config, None)
        fresh.setup(num_layers=1, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                    dtype=self.layers.dtype, rope_cos=self.layers.rope_cos, rope_sin=self.layers.rope_sin)
        blocks = -(-(last + 1) // block)
        fresh.init_cache(blocks, block)
        meta = specdec.AttentionMetadata.build([last + 1], [0], [np.arange(blocks)], block)
        fresh.prepare(meta)
        return np.asarray(fresh.forward(0, paddle.to_tensor(qkv), meta))


class LayerRecorder(HiddenRecorder):
    """Records the states of three layers (EAGLE-3's way): the embeddings (layer 0's input), a
    middle layer's input and the last layer's output; ``LAYERS`` may be set to others."""

    NAME = "test_layer_recorder"
    LAYERS = None

    def hidden_state_layers(self):
        num_layers = self.context.model_config.num_layers
        return self.LAYERS if self.LAYERS is not None else (0, num_layers // 2, num_layers)


@pytest.fixture
def with_test_proposers(model_session, monkeypatch):
    """The session's engine with the two test proposers registered in a plugin set of its own
    (the process-wide one stays as it is); naive again afterwards."""
    plugins = load_plugins()
    for cls in (HiddenRecorder, PagedRows, LayerRecorder):
        plugins.proposers.register(cls, "tests/e2e/test_model_based_contract.py")
    monkeypatch.setattr(model_session.llm.engine, "plugins", plugins)
    yield model_session
    model_session.llm.set_speculative_config(None)


def test_hidden_states_cover_every_position_once_and_are_the_targets(with_test_proposers):
    session = with_test_proposers
    llm, engine = session.llm, session.llm.engine
    naive = session.run(None, PROMPTS, SAMPLING, max_num_seqs=3)
    llm.reset_prefix_cache()
    outputs = session.run({"method": "test_hidden_recorder", "adaptive_draft_length": False}, PROMPTS, SAMPLING, max_num_seqs=3, cache=False)
    recorder = engine.proposer
    target, config = recorder.context.target, recorder.context.model_config

    assert [o.token_ids for o in outputs] == [o.token_ids for o in naive]  # lossless, as ever
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0
    assert sum(o.metrics.num_draft_tokens - o.metrics.num_accepted_tokens for o in outputs) > 0  # rejections too
    starts = []
    for prompt, output in zip(PROMPTS, outputs):
        seen = recorder.seen[output.request_id]
        tokens = np.array(session.prompt_ids(prompt) + output.token_ids)
        positions = np.concatenate([s[0] for s in seen])
        states = np.concatenate([s[1] for s in seen])
        # Every computed position exactly once, in order, and only those whose next token is
        # decided (never a rejected draft's row, never the unfed last token). The prompts share
        # the chat template's first blocks: the first request computes them, the others reuse
        # them from the prefix cache and get states from the first position they compute.
        start = int(positions[0])
        starts.append(start)
        assert start % engine.block_size == 0 and start < output.num_prompt_tokens
        assert positions.tolist() == list(range(start, start + len(positions)))
        assert positions[-1] >= output.num_prompt_tokens + output.num_generated_tokens - 10
        for hidden_positions, _, table, num_tokens, max_draft_len in seen:
            assert len(hidden_positions) == 0 or hidden_positions[-1] <= num_tokens - 2
            assert len(table) * engine.block_size >= num_tokens + max_draft_len
        assert states.shape == (len(positions), config.hidden_size) and states.dtype == np.float32
        # They are the target's own: its logits at each generated position pick the token that
        # followed (greedy decoding).
        generated = positions >= output.num_prompt_tokens - 1
        logits = np.asarray(target.logits(states[generated]))
        assert logits.shape == (int(generated.sum()), config.vocab_size)
        np.testing.assert_array_equal(logits.argmax(axis=1), tokens[positions[generated] + 1])

    assert starts[0] == 0 and max(starts) > 0

    ids = np.array([1, 7, 42])
    np.testing.assert_array_equal(np.asarray(target.embed(ids)), np.asarray(target.embedding)[ids])
    import paddle

    np.testing.assert_array_equal(np.asarray(target.logits(paddle.to_tensor(states[:2]))),
                                  np.asarray(target.logits(states[:2])))  # numpy or paddle in
    assert np.asarray(target.lm_head).shape == (config.vocab_size, config.hidden_size)
    assert np.asarray(target.final_norm).shape == (config.hidden_size,)


def test_a_proposer_reads_the_layers_it_names_side_by_side(with_test_proposers):
    """``hidden_state_layers``: each row holds the named layers' states in order: the
    embeddings of its token, then a middle layer's, then the last layer's output (the default
    state, whose logits pick the next token); a layer the target lacks is a one-line error."""
    session = with_test_proposers
    llm, engine = session.llm, session.llm.engine
    sampling = SamplingParams(max_tokens=16, ignore_eos=True)
    naive = session.run(None, PROMPTS[:2], sampling, max_num_seqs=2)
    outputs = session.run({"method": "test_layer_recorder", "adaptive_draft_length": False}, PROMPTS[:2], sampling,
                          max_num_seqs=2, cache=False)
    recorder = engine.proposer
    target, H = recorder.context.target, recorder.context.model_config.hidden_size
    assert [o.token_ids for o in outputs] == [o.token_ids for o in naive]
    for prompt, output in zip(PROMPTS[:2], outputs):
        seen = recorder.seen[output.request_id]
        tokens = np.array(session.prompt_ids(prompt) + output.token_ids)
        positions = np.concatenate([s[0] for s in seen])
        states = np.concatenate([s[1] for s in seen])
        assert states.shape == (len(positions), 3 * H)
        np.testing.assert_array_equal(states[:, :H], np.asarray(target.embed(tokens[positions])))
        middle = states[:, H: 2 * H]
        assert not np.allclose(middle, states[:, :H]) and not np.allclose(middle, states[:, 2 * H:])
        generated = positions >= output.num_prompt_tokens - 1
        np.testing.assert_array_equal(np.asarray(target.logits(states[generated, 2 * H:])).argmax(axis=1),
                                      tokens[positions[generated] + 1])

    num_layers = recorder.context.model_config.num_layers
    before = llm.speculative_config
    LayerRecorder.LAYERS = (2, num_layers + 1)
    try:
        with pytest.raises(specdec.SpecdecError) as info:
            llm.set_speculative_config({"method": "test_layer_recorder"})
    finally:
        LayerRecorder.LAYERS = None
    assert str(info.value) == (f"speculative_config.method: proposer 'test_layer_recorder': hidden_state_layers() "
                               f"must give 1 to 8 layers in [0, {num_layers}] (the target's {num_layers} layers' "
                               f"inputs, {num_layers} its output), got [2, {num_layers + 1}]")
    assert llm.speculative_config is before and engine.proposer is recorder  # the engine keeps its plugins


def test_cache_layers_keep_rows_across_steps_and_share_prefixes(with_test_proposers):
    """Rows written into the proposer's layer persist across steps in the request's blocks,
    and a request that reuses a cached prompt prefix reads the rows the first one wrote."""
    session = with_test_proposers
    llm, engine = session.llm, session.llm.engine
    naive = session.run(None, PROMPTS[:2], SAMPLING, max_num_seqs=2)
    outputs = session.run({"method": "test_paged_rows", "adaptive_draft_length": False}, PROMPTS[:2], SAMPLING, max_num_seqs=2, cache=False)
    proposer = engine.proposer
    assert [o.token_ids for o in outputs] == [o.token_ids for o in naive]
    assert proposer.checked_rows >= sum(o.num_prompt_tokens for o in outputs)
    first_pass = proposer.checked_rows
    # The same prompts again: their prompt blocks come from the prefix cache, so the proposer
    # gets no hidden states for those positions, and attends over the rows written before.
    llm.generate(list(PROMPTS[:2]), SAMPLING, use_chat_template=True)
    assert 0 < proposer.checked_rows - first_pass < first_pass
    tolerance = 1e-2 if proposer.layers.dtype == "float16" else 1e-4
    assert proposer.worst_error < tolerance, proposer.worst_error
    assert engine.num_free_kv_blocks == engine.num_kv_blocks


def test_a_failing_setup_is_a_one_line_config_error(with_test_proposers, monkeypatch):
    def broken_setup(self, context):
        raise ValueError("no weights for\nthis target")

    monkeypatch.setattr(HiddenRecorder, "setup", broken_setup)
    llm = with_test_proposers.llm
    before = llm.speculative_config
    with pytest.raises(specdec.SpecdecError) as info:
        llm.set_speculative_config({"method": "test_hidden_recorder"})
    assert str(info.value) == ("speculative_config.method: proposer 'test_hidden_recorder' setup failed: "
                               "ValueError: no weights for this target")
    assert llm.speculative_config is before  # the engine keeps its previous plugins
