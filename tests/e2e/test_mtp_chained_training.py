"""``train-mtp --num-model-steps``: the training forward of substeps 2 and 3 computes what the
``mtp`` proposer computes at inference, where each substep feeds the previous one's output
state back in and attends to the rows its cache holds then."""

from __future__ import annotations

import types

import numpy as np
import pytest

from specdec.attention import AttentionMetadata
from specdec.plugins.mtp.head import MtpHead
from specdec.plugins.mtp.proposer import SHIPPED_HEADS
from specdec.plugins.mtp.train import TrainableMtp, rope_tables
from specdec.plugins.mtp.weights import load_mtp_layers
from specdec.proposer_context import TargetModel

pytestmark = pytest.mark.slow


def test_training_depths_match_the_proposers_substeps(model_session):
    import paddle

    engine = model_session.llm.engine
    config = engine.model_config
    target = TargetModel(engine.model)
    [weights] = load_mtp_layers(SHIPPED_HEADS["smollm2-135m-instruct"], config.hidden_size)
    rng = np.random.default_rng(0)
    m = 40  # the catch-up covers positions 0 .. m; substeps 2 and 3 run at m + 1 and m + 2
    tokens = rng.integers(0, config.vocab_size, m + 3).astype(np.int64)
    states = np.concatenate([np.zeros((1, config.hidden_size), np.float32),
                             rng.standard_normal((m + 2, config.hidden_size)).astype(np.float32) * 3])

    # Training: depths 1 .. 3 over the whole sequence.
    model = TrainableMtp(config, target, weights.draft_vocab, init=weights)
    cos, sin = rope_tables(config.head_dim, config.rope_theta, m + 3)
    rope = (paddle.to_tensor(cos[None, :, None, :]), paddle.to_tensor(sin[None, :, None, :]))
    with paddle.no_grad():
        depths = model.forward_depths(paddle.to_tensor(tokens[None]), paddle.to_tensor(states[None]), *rope, 3)
    trained = [np.asarray(depths[1])[0, m + 1], np.asarray(depths[2])[0, m + 2]]

    # Inference: the proposer's head over a fresh cache layer of the engine's kind.
    cache = engine._create_cache_layers(1)
    head = MtpHead(weights, types.SimpleNamespace(target=target, model_config=config), cache)
    blocks = np.arange(-(-(m + 3) // engine.block_size))[None]
    out, _ = head.forward(tokens[: m + 1], paddle.to_tensor(states[: m + 1]),
                          AttentionMetadata.build([m + 1], [0], blocks, engine.block_size))
    state = out[m:]
    inferred = []
    for position in (m + 1, m + 2):
        state, logits = head.forward(tokens[position: position + 1], state,
                                     AttentionMetadata.build([1], [position], blocks, engine.block_size), logit_rows=[0])
        inferred.append(np.asarray(logits)[0])
    engine.kv.pool.reset_prefix_cache()

    # Logits reach about 30; measured differences are under 1e-3 (a float16 cache). Attending to
    # one row too many (depth 1's at the substep's own position) moves them by 0.25 and more.
    for depth, (got, want) in enumerate(zip(trained, inferred), start=2):
        assert np.argmax(got) == np.argmax(want), depth
        assert np.max(np.abs(got - want)) < 0.02, (depth, np.max(np.abs(got - want)))
