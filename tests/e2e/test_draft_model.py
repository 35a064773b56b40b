"""The ``draft_model`` method on the real default model, drafted for by the same model on other
kernels (int4 per channel against the file's Q4_1 blocks: the two agree on most tokens, not
all, so drafts are both accepted and rejected): greedy output equal to naive's alone and in
batches of 3 and 16, with prefix sharing and preemption; seeded sampling that repeats; the
lookup of hybrid after it; bad configurations as one-line errors naming the key."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import specdec
from specdec import ConfigError, SamplingParams, SpecdecError
from specdec.model.resolve import resolve_model_path
from specdec.model.tokenizer import Tokenizer, gguf_field, tokenizer_difference
from specdec.sdk import AttentionMetadata
from specdec.workloads import code_edit_prompts

pytestmark = pytest.mark.slow

PROMPTS = tuple(code_edit_prompts(16))
SAMPLING = SamplingParams(max_tokens=32, ignore_eos=True)
#: The default model drafting for itself through int4 kernels; every draft verified.
DRAFT = {"method": "draft_model", "model": "smollm2-135m-instruct", "quantization": "wint4",
         "num_speculative_tokens": 4, "adaptive_draft_length": False}


def assert_equal_to_naive(model_session, prompts, outputs, label):
    naive = model_session.run(None, prompts, SAMPLING, max_num_seqs=len(prompts))
    for prompt, got, want in zip(prompts, outputs, naive):
        message = model_session.describe_divergence(prompt, want.token_ids, got.token_ids, label=label)
        assert message is None, message


@pytest.mark.parametrize("batch, adaptive", [(1, False), (3, True), (16, False)])
def test_draft_model_is_lossless_at_temperature_zero(model_session, batch, adaptive):
    prompts = PROMPTS[:max(batch, 2)]
    spec = {**DRAFT, "adaptive_draft_length": adaptive}
    outputs = model_session.run(spec, prompts, SAMPLING, max_num_seqs=batch, cache=False)
    assert model_session.llm.engine.spec.method == "draft_model"
    assert_equal_to_naive(model_session, prompts, outputs, f"draft_model, batch {batch}")
    if adaptive:  # drafting for itself costs as much as it saves: the controller may stop it
        return
    drafted = sum(o.metrics.num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    # Both paths of the draft's cache ran: accepted drafts (rows kept) and rejected ones (rows
    # written again), several drafts deep.
    assert 0 < accepted < drafted, (accepted, drafted)
    assert sum(o.metrics.accepted_per_position[2] for o in outputs
               if len(o.metrics.accepted_per_position) > 2) > 0


def test_a_shared_prefix_is_not_run_again_where_the_draft_filled_it(model_session):
    """A second run of the same prompts hits the prefix cache; the draft runs only the rows it
    did not write itself (block by block, by the tokens before them), and the tokens stay
    naive's."""
    prompts = PROMPTS[:2]
    llm = model_session.llm
    model_session.run(DRAFT, PROMPTS[8:9], SAMPLING, cache=False)  # loads the draft (resets the prefix cache)
    draft = llm.engine.proposer.draft
    rows: list[int] = []
    real = draft.forward

    def counting(token_ids, meta, logit_rows):
        rows.append(len(token_ids))
        return real(token_ids, meta, logit_rows)

    draft.forward = counting
    try:  # the same proposer twice (a new one would load the draft again, emptying the prefix cache)
        first = llm.generate(list(prompts), SAMPLING, use_chat_template=True)
        cold = sum(rows)
        rows.clear()
        second = llm.generate(list(prompts), SAMPLING, use_chat_template=True)
        warm = sum(rows)
    finally:
        del draft.forward
    prompt_tokens = sum(len(model_session.prompt_ids(p)) for p in prompts)
    # Cold, the prompts share only the chat template's system block with what ran before.
    assert cold >= prompt_tokens - 64 and warm < cold - prompt_tokens // 2, (cold, warm, prompt_tokens)
    assert_equal_to_naive(model_session, prompts, first, "draft_model, cold")
    assert_equal_to_naive(model_session, prompts, second, "draft_model, prefix cached")


def test_preempted_requests_keep_naive_tokens():
    """A pool too small for the batch: requests are preempted and recomputed, the draft's rows
    with them; the tokens equal a roomy pool's plain decoding."""
    # Each request needs about 11 blocks alone; at 40 blocks for six, whether one is preempted
    # came down to the drafts' acceptance (none was, after a change of attention's rounding).
    llm = specdec.LLM(num_kv_blocks=24, block_size=16, progress=False)
    prompts = [code[:400] for code in PROMPTS[:6]]
    sampling = SamplingParams(max_tokens=32, ignore_eos=True)
    llm.set_speculative_config(DRAFT)
    engine = llm.engine
    requests = [engine.add_request(llm.encode_prompt(p, use_chat_template=True), sampling, prompt=p) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert sum(r.num_preemptions for r in requests) > 0, "the pool was meant to run out"
    llm.set_speculative_config(None)
    alone = [llm.generate([p], sampling, use_chat_template=True)[0].token_ids for p in prompts]  # each fits the pool alone
    assert [r.generated_ids.tolist() for r in requests] == alone
    assert engine.num_free_kv_blocks == engine.num_kv_blocks


def test_seeded_sampling_repeats_and_drafts_are_accepted(model_session):
    sampling = SamplingParams(max_tokens=32, temperature=0.8, seed=11)
    runs = [model_session.run(DRAFT, PROMPTS[:2], sampling, cache=False) for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert sum(o.metrics.num_accepted_tokens for o in runs[0]) > 0


def test_hybrid_continues_a_draft_model_with_a_lookup(model_session):
    spec = {"method": "hybrid", "draft_model_method": "draft_model", "model": "smollm2-135m-instruct",
            "quantization": "wint4", "num_model_steps": 2, "num_speculative_tokens": 6,
            "draft_lookup_first": 0, "adaptive_draft_length": False}
    prompts = PROMPTS[:3]
    outputs = model_session.run(spec, prompts, SAMPLING, max_num_seqs=3, cache=False)
    assert_equal_to_naive(model_session, prompts, outputs, "hybrid over draft_model")
    # Positions past num_model_steps were drafted by the lookup, and some were accepted.
    assert sum(o.metrics.accepted_per_position[2] for o in outputs
               if len(o.metrics.accepted_per_position) > 2) > 0


def _gguf_with_two_tokens_swapped(path) -> None:
    """A GGUF file holding the default model's tokenizer with ids 1000 and 1001 swapped (and no
    weights: the check runs before any is read)."""
    reader = gguf.GGUFReader(resolve_model_path("smollm2-135m-instruct"))

    def get(key):
        return gguf_field(reader, key)
    tokens = list(get("tokenizer.ggml.tokens"))
    tokens[1000], tokens[1001] = tokens[1001], tokens[1000]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(get("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(get("tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_types(list(get("tokenizer.ggml.token_type")))
    writer.add_token_merges(list(get("tokenizer.ggml.merges")))
    writer.add_bos_token_id(get("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(get("tokenizer.ggml.eos_token_id"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_bad_draft_models_are_one_line_errors_naming_the_key(model_session, tmp_path):
    llm = model_session.llm
    other = tmp_path / "other-vocab.gguf"
    _gguf_with_two_tokens_swapped(other)
    target = Tokenizer.from_gguf(str(resolve_model_path("smollm2-135m-instruct")))
    assert tokenizer_difference(target, target) is None
    not_gguf = tmp_path / "draft.gguf"
    not_gguf.write_text("not a model")
    cases = [
        ({"model": str(tmp_path / "missing.gguf")}, "model: '", "is not a GGUF file, a checkpoint"),
        ({"model": str(not_gguf)}, "model: '", "does not start with the GGUF magic bytes"),
        ({"model": str(other)}, "model: the draft model ",
         "does not tokenize as the target smollm2-135m-instruct does: vocabularies differ"),
        ({"model": None}, "model: draft_model needs the draft model", ""),
        ({"model": "smollm2-135m-instruct", "num_speculative_tokens": 0},
         "num_speculative_tokens: must be between 1 and 32, got 0", ""),
        ({"model": "smollm2-135m-instruct", "num_speculative_tokens": 33},
         "num_speculative_tokens: must be between 1 and 32, got 33", ""),
    ]
    for keys, start, part in cases:
        with pytest.raises(SpecdecError) as caught:
            llm.set_speculative_config({"method": "draft_model", **keys})
        message = str(caught.value)
        source, _, rest = message.partition(".")  # where the config came from, then the key
        assert source in ("--speculative-config", "speculative_config"), message
        assert "\n" not in message and rest.startswith(start) and part in rest, message
        assert isinstance(caught.value, ConfigError), message


def test_the_draft_cache_follows_the_target_blocks(model_session):
    """The draft model's cache has one layer per draft layer over the engine's block ids."""
    model_session.run(DRAFT, PROMPTS[:1], SAMPLING, cache=False)
    engine = model_session.llm.engine
    draft = engine.proposer.draft
    assert draft.vocab_size == engine.model_config.vocab_size
    assert draft.config.num_layers == engine.model_config.num_layers
    assert engine.proposer._filled and max(engine.proposer._filled) < engine.num_kv_blocks
    pool = engine.kv.pool
    block = pool.allocate()
    try:
        logits = draft.forward(np.array([1, 2, 3], dtype=np.int64),
                               AttentionMetadata.build([3], [0], [[block]], engine.block_size),
                               np.array([2], dtype=np.int64))
    finally:
        pool.release(block)
    assert logits.shape == (1, engine.model_config.vocab_size) and np.isfinite(logits).all()


def test_switching_the_draft_off_and_on_mid_request_changes_no_token(model_session, monkeypatch):
    """The controller leaves every request out for 5 steps in 10 whatever it measures: each
    proposal after a gap runs the tokens the draft missed, and the tokens stay naive's."""
    from specdec.engine.controller import DraftController

    real = DraftController.proposing
    steps = iter(range(10 ** 9))

    def proposing(self, request_ids, always, max_draft_lens, unseen_tokens=None, without_proposer=None):
        real(self, request_ids, always, max_draft_lens, unseen_tokens, without_proposer)
        return np.full(len(request_ids), (next(steps) // 5) % 2 == 0)

    monkeypatch.setattr(DraftController, "proposing", proposing)
    # nor does it leave a request out of an "on" step for a first draft not worth its row
    monkeypatch.setattr(DraftController, "_first_draft_bar", lambda self, base_rows, base_tokens: -1.0)
    prompts = PROMPTS[:3]
    outputs = model_session.run({**DRAFT, "adaptive_draft_length": True}, prompts, SAMPLING, max_num_seqs=3,
                                cache=False)
    assert_equal_to_naive(model_session, prompts, outputs, "draft_model switched off and on")
    for output in outputs:
        assert 0 < output.metrics.num_proposer_off_steps < output.metrics.num_steps
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 0
