"""Packing a step (core/engine/batch.py): row order, positions, cache slots, which rows get
logits and how they are laid out as [B, k+1, V]. No model: the "logits" of a row are made
from its packed index, so every gather can be checked exactly."""

from __future__ import annotations

import numpy as np
import pytest

from specdec import Drafts
from specdec.engine.batch import PackedStep, SequenceRows, pack_step

BLOCK = 4


def rows(tokens, context_len, blocks) -> SequenceRows:
    return SequenceRows(np.asarray(tokens, dtype=np.int64), context_len, list(blocks))


def fake_logits(packed: PackedStep, vocab: int = 3) -> np.ndarray:
    """``[R, V]``: the logits of computed row ``r`` of the packed array are ``r * 10 + v``."""
    return packed.logit_rows[:, None] * 10.0 + np.arange(vocab)[None, :]


def test_decodes_with_uneven_drafts_then_a_prefill_chunk():
    decodes = [rows([11], 5, [7, 2, 6]), rows([21], 2, [3])]
    drafts = Drafts.from_lists([[12, 13, 14], [22]])
    chunks = [rows([31, 32, 33, 34, 35], 4, [9, 8, 5])]
    packed = pack_step(decodes, drafts, chunks, BLOCK)

    assert packed.token_ids.tolist() == [11, 12, 13, 14, 21, 22, 31, 32, 33, 34, 35]
    meta = packed.meta
    assert meta.query_lens.tolist() == [4, 2, 5]
    assert meta.context_lens.tolist() == [5, 2, 4]
    assert meta.cu_seqlens_q.tolist() == [0, 4, 6, 11]
    assert meta.positions.tolist() == [5, 6, 7, 8, 2, 3, 4, 5, 6, 7, 8]
    assert meta.batch_ids.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
    # Tables are zero-padded to the widest; request 0's positions 5..7 are in its block 1
    # (cache block 2), position 8 in its block 2 (cache block 6).
    assert meta.block_tables.tolist() == [[7, 2, 6], [3, 0, 0], [9, 8, 5]]
    assert meta.slot_mapping[:4].tolist() == [2 * BLOCK + 1, 2 * BLOCK + 2, 2 * BLOCK + 3, 6 * BLOCK + 0]
    assert meta.slot_mapping[4:6].tolist() == [3 * BLOCK + 2, 3 * BLOCK + 3]
    assert meta.slot_mapping[6:].tolist() == [8 * BLOCK + 0, 8 * BLOCK + 1, 8 * BLOCK + 2, 8 * BLOCK + 3, 5 * BLOCK]

    # Logits for each decode's last token and its drafts; none for the chunk.
    assert packed.logit_rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert not packed.is_decode_only
    verify = packed.verify_logits(fake_logits(packed))
    assert verify.shape == (2, 4, 3)
    assert verify[0, :, 0].tolist() == [0, 10, 20, 30]
    # Request 1 has one draft: positions 2 and 3 of its row repeat its last real row.
    assert verify[1, :, 0].tolist() == [40, 50, 50, 50]


def test_a_prompt_completing_this_step_gets_logits_for_its_last_token_only():
    """A request whose last prompt chunk is scheduled as a decode feeds several tokens; only
    the last of them (and its drafts) needs logits."""
    decodes = [rows([5, 6, 7, 8], 0, [1, 4]), rows([9], 3, [2])]
    drafts = Drafts.from_lists([[70, 71], [90, 91]])
    packed = pack_step(decodes, drafts, [], BLOCK)
    assert packed.token_ids.tolist() == [5, 6, 7, 8, 70, 71, 9, 90, 91]
    assert packed.logit_rows.tolist() == [3, 4, 5, 6, 7, 8]
    assert packed.padded_rows is None  # every draft row is full: a reshape, no copy
    logits = fake_logits(packed)
    verify = packed.verify_logits(logits)
    assert np.shares_memory(verify, logits)
    assert verify[:, :, 0].tolist() == [[30, 40, 50], [60, 70, 80]]
    assert not packed.is_decode_only  # three prompt rows ride along


def test_plain_decode_step_is_decode_only():
    decodes = [rows([1], 3, [0]), rows([2], 7, [1, 5])]
    packed = pack_step(decodes, Drafts.empty(2), [], BLOCK)
    assert packed.token_ids.tolist() == [1, 2]
    assert packed.logit_rows.tolist() == [0, 1]
    assert packed.is_decode_only
    assert packed.verify_logits(fake_logits(packed)).shape == (2, 1, 3)
    assert packed.meta.slot_mapping.tolist() == [3, 5 * BLOCK + 3]


def test_prefill_only_step_computes_no_logits():
    chunks = [rows([1, 2, 3], 0, [6]), rows([4, 5], 8, [1, 2, 3])]
    packed = pack_step([], Drafts.empty(0), chunks, BLOCK)
    assert packed.token_ids.tolist() == [1, 2, 3, 4, 5]
    assert packed.logit_rows.size == 0
    assert packed.verify_logits(np.zeros((0, 3))).shape == (0, 1, 3)
    assert packed.meta.slot_mapping.tolist() == [24, 25, 26, 12, 13]


def test_requests_without_drafts_next_to_ones_with_drafts():
    decodes = [rows([1], 0, [0]), rows([2], 0, [1]), rows([3], 0, [2])]
    drafts = Drafts.from_lists([[], [20, 21], []])
    packed = pack_step(decodes, drafts, [], BLOCK)
    assert packed.token_ids.tolist() == [1, 2, 20, 21, 3]
    assert packed.logit_rows.tolist() == [0, 1, 2, 3, 4]
    verify = packed.verify_logits(fake_logits(packed))
    assert verify[:, :, 0].tolist() == [[0, 0, 0], [10, 20, 30], [40, 40, 40]]


def test_random_steps_agree_with_a_per_request_walk():
    """Random mixes of decodes (one or more fed tokens, 0..k drafts) and chunks: every row's
    token, position and slot, and every verify logit, match a plain per-request loop."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        num_decodes, num_chunks = int(rng.integers(0, 5)), int(rng.integers(0, 3))
        if num_decodes + num_chunks == 0:  # the engine runs no step without a request
            continue
        width = int(rng.integers(0, 6))
        sequences, expected = [], []  # expected: (token, position, slot, wants_logit)
        draft_lists = [list(rng.integers(0, 1000, int(rng.integers(0, width + 1)))) for _ in range(num_decodes)]
        for b in range(num_decodes + num_chunks):
            context = int(rng.integers(0, 20))
            fed = int(rng.integers(1, 6))
            extra = len(draft_lists[b]) if b < num_decodes else 0
            table = list(rng.permutation(50)[: (context + fed + extra) // BLOCK + 1])
            tokens = list(rng.integers(0, 1000, fed))
            sequences.append(rows(tokens, context, table))
            for i, token in enumerate(tokens + (draft_lists[b] if b < num_decodes else [])):
                position = context + i
                slot = table[position // BLOCK] * BLOCK + position % BLOCK
                expected.append((token, position, slot, b < num_decodes and i >= fed - 1))
        drafts = Drafts.from_lists(draft_lists) if num_decodes else Drafts.empty(0)
        packed = pack_step(sequences[:num_decodes], drafts, sequences[num_decodes:], BLOCK)
        assert packed.token_ids.tolist() == [e[0] for e in expected]
        assert packed.meta.positions.tolist() == [e[1] for e in expected]
        assert packed.meta.slot_mapping.tolist() == [e[2] for e in expected]
        assert packed.logit_rows.tolist() == [r for r, e in enumerate(expected) if e[3]]
        verify = packed.verify_logits(fake_logits(packed))
        assert verify.shape == (num_decodes, drafts.width + 1, 3)
        for b, draft in enumerate(draft_lists):
            start = int(packed.meta.cu_seqlens_q[b]) + len(sequences[b].token_ids) - 1
            real = [(start + j) * 10 for j in range(len(draft) + 1)]
            assert verify[b, :, 0].tolist() == real + [real[-1]] * (drafts.width - len(draft))


def test_drafts_must_match_the_decodes():
    with pytest.raises(ValueError, match="2 decoding requests but 1 rows of drafts"):
        pack_step([rows([1], 0, [0]), rows([2], 0, [1])], Drafts.from_lists([[3]]), [], BLOCK)
