"""The ngram lookup proposer: ``find_ngram_draft`` on hand cases, and the proposer contract."""

from __future__ import annotations

import numpy as np
import pytest

import specdec
from specdec.plugins.ngram.proposer import NgramConfig, NgramProposer, find_ngram_draft, find_ngram_match
from specdec.testing import check_proposer


def draft(tokens, max_len=5, max_ngram=4, min_ngram=1):
    result = find_ngram_draft(np.asarray(tokens, dtype=np.int64), max_len, max_ngram, min_ngram)
    assert isinstance(result, np.ndarray) and result.dtype == np.int64
    return result.tolist()


def test_longest_match_wins_over_a_more_recent_shorter_one():
    # "4 6 7" occurred at the start (followed by 10 11 ...); the 1-gram "7" occurred more
    # recently (followed by 20 21 ...). The 3-gram decides.
    tokens = [4, 6, 7, 10, 11, 8, 7, 20, 21, 4, 6, 7]
    assert draft(tokens, max_len=5, max_ngram=3) == [10, 11, 8, 7, 20]
    assert draft(tokens, max_len=5, max_ngram=4) == [10, 11, 8, 7, 20]  # no 4-gram: 3 is the longest
    # capped at 1-grams, the most recent "7" wins
    assert draft(tokens, max_len=5, max_ngram=1) == [20, 21, 4, 6, 7]


def test_most_recent_occurrence_wins():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert draft(tokens, max_len=3, max_ngram=3) == [7, 5, 1]
    assert draft(tokens, max_len=3, max_ngram=2) == [7, 5, 1]
    assert draft([5, 1, 8, 5, 2, 8, 5], max_len=2, max_ngram=1) == [2, 8]


def test_max_ngram_bound():
    # The 3-gram "1 2 3" points at 50; the more recent 2-gram "2 3" at 60.
    tokens = [1, 2, 3, 50, 9, 2, 3, 60, 1, 2, 3]
    assert draft(tokens, max_len=4, max_ngram=3) == [50, 9, 2, 3]
    assert draft(tokens, max_len=4, max_ngram=2) == [60, 1, 2, 3]


def test_min_ngram_bound():
    tokens = [1, 2, 3, 9, 5, 3]  # only the 1-gram "3" matches
    assert draft(tokens, max_len=3, max_ngram=4, min_ngram=1) == [9, 5, 3]
    assert draft(tokens, max_len=3, max_ngram=4, min_ngram=2) == []
    # a 2-gram that matches satisfies min_ngram 2
    assert draft([7, 3, 9, 5, 7, 3], max_len=3, max_ngram=4, min_ngram=2) == [9, 5, 7]


def test_continuation_shorter_than_k_at_the_end():
    assert draft([1, 2, 3, 1, 2], max_len=5, max_ngram=2) == [3, 1, 2]
    assert draft([7, 7], max_len=4, max_ngram=3) == [7]
    assert draft([8, 1, 2, 3, 4, 1, 2, 3], max_len=10, max_ngram=3) == [4, 1, 2, 3]


def test_no_match_is_empty():
    assert draft([1, 2, 3, 4]) == []
    assert draft([5]) == []
    assert draft([1, 2, 1], max_len=0) == []


def test_max_len_cuts_the_continuation():
    tokens = list(range(10)) + [0]
    assert draft(tokens, max_len=3) == [1, 2, 3]
    assert draft(tokens, max_len=1) == [1]


def test_does_not_modify_the_input():
    tokens = np.array([1, 2, 3, 1, 2], dtype=np.int64)
    tokens.flags.writeable = False  # the engine hands a read-only view
    assert find_ngram_draft(tokens, 3, 3, 1).tolist() == [3, 1, 2]


def test_config_bounds():
    with pytest.raises(ValueError, match="min_ngram_size"):
        NgramConfig(max_ngram_size=2, min_ngram_size=3)
    with pytest.raises(ValueError):
        NgramConfig(max_ngram_size=0)


def test_proposer_contract():
    check_proposer(NgramProposer)
    check_proposer(NgramProposer, NgramConfig(max_ngram_size=2, min_ngram_size=2))
    check_proposer(NgramProposer, NgramConfig(max_ngram_size=1, min_ngram_size=1))


def test_proposer_batch_respects_each_max_draft_len():
    proposer = NgramProposer(NgramConfig(max_ngram_size=3, min_ngram_size=1))
    loop = np.array([1, 2, 3, 4] * 4, dtype=np.int64)
    batch = specdec.ProposalBatch([
        specdec.ProposalRequest("a", loop, 4, 5),
        specdec.ProposalRequest("b", np.array([9, 8, 7], dtype=np.int64), 3, 5),
        specdec.ProposalRequest("c", loop, 4, 2),
    ])
    drafts = proposer.propose(batch)
    assert drafts.lengths.tolist() == [4, 0, 2]  # "a": the continuation runs out after 4
    assert drafts.to_lists() == [[1, 2, 3, 4], [], [1, 2]]
    assert drafts.token_ids.shape == (3, 4)
    assert drafts.token_ids[1].tolist() == [-1, -1, -1, -1]


def test_drafts_are_labelled_with_the_matched_suffix_length():
    """``Drafts.classes`` tells the adaptive draft length how strong each draft is."""
    proposer = NgramProposer(NgramConfig(max_ngram_size=3, min_ngram_size=1))
    batch = specdec.ProposalBatch([
        specdec.ProposalRequest("three", np.array([7, 1, 2, 3, 9, 1, 2, 3]), 8, 2),  # 1 2 3 again
        specdec.ProposalRequest("one", np.array([5, 6, 4, 8, 6]), 5, 2),  # only "6" again
        specdec.ProposalRequest("none", np.array([1, 2, 3]), 3, 2),
    ])
    drafts = proposer.propose(batch)
    assert drafts.to_lists() == [[9, 1], [4, 8], []]
    assert drafts.classes.tolist() == [3, 1, 0]
    assert find_ngram_match(np.array([7, 1, 2, 3, 9, 1, 2, 3]), 2, 3, 1)[1] == 3


def test_incremental_index_equals_the_reference_search():
    """``NgramIndex`` (what the proposer runs) against ``find_ngram_draft`` (its twin), on random
    sequences that grow by a few tokens or by a whole prompt at a time."""
    from specdec.plugins.ngram.proposer import NgramIndex

    rng = np.random.default_rng(0)
    for _ in range(200):
        length, vocab = int(rng.integers(1, 300)), int(rng.integers(2, 12))
        tokens = rng.integers(0, vocab, length)
        max_n = int(rng.integers(1, 6))
        min_n = int(rng.integers(1, max_n + 1))
        index, end = NgramIndex(min_n, max_n), 0
        while end < length:
            end = min(length, end + int(rng.integers(1, 100 if rng.random() < 0.2 else 4)))
            index.extend(tokens[:end])
            k = int(rng.integers(0, 7))
            want, matched = find_ngram_match(tokens[:end], k, max_n, min_n)
            assert index.draft(k) == (want.tolist(), matched)


def test_proposer_state_is_freed_when_a_request_finishes():
    proposer = NgramProposer(NgramConfig(max_ngram_size=3, min_ngram_size=1))
    request = specdec.ProposalRequest("a", np.array([1, 2, 3, 1, 2]), 5, 3)
    proposer.on_request_start(request)
    assert proposer.propose(specdec.ProposalBatch([request])).to_lists() == [[3, 1, 2]]
    proposer.on_request_finish("a")
    assert proposer._indexes == {}
    assert proposer._compiled is None or len(proposer._compiled) == 0


def test_compiled_index_equals_the_reference_search():
    """The compiled index (what the proposer runs where a C++ compiler exists) against
    ``find_ngram_draft``, for a batch of requests growing at different paces, with
    non-int64 and non-contiguous token arrays, long n-grams and repeated ids."""
    from specdec.plugins.ngram.compiled import CompiledNgramIndexes

    rng = np.random.default_rng(1)
    for _ in range(40):
        max_n = int(rng.integers(1, 10))
        min_n = int(rng.integers(1, max_n + 1))
        indexes = CompiledNgramIndexes(min_n, max_n)
        streams = [rng.integers(0, int(rng.integers(2, 12)), int(rng.integers(1, 400))) for _ in range(6)]
        ends = [0] * len(streams)
        while any(end < len(s) for end, s in zip(ends, streams)):
            live = [i for i, s in enumerate(streams) if ends[i] < len(s)]
            for i in live:
                ends[i] = min(len(streams[i]), ends[i] + int(rng.integers(1, 80 if rng.random() < 0.2 else 4)))
            arrays = [streams[i][: ends[i]] for i in live]
            arrays[0] = arrays[0].astype(np.int32)  # converted on the way in
            if len(arrays) > 1:
                arrays[1] = np.repeat(arrays[1], 2)[::2]  # a strided view
            max_draft_lens = rng.integers(0, 7, len(live))
            drafts, lengths, matched = indexes.draft_batch([
                specdec.ProposalRequest(f"r{i}", tokens, 0, int(k)) for i, tokens, k in zip(live, arrays, max_draft_lens)])
            for row, i in enumerate(live):
                want, n = find_ngram_match(streams[i][: ends[i]], int(max_draft_lens[row]), max_n, min_n)
                assert drafts[row, : lengths[row]].tolist() == want.tolist()
                assert matched[row] == n
                assert (drafts[row, lengths[row]:] == -1).all()
            assert drafts.shape[1] == (lengths.max() if len(live) else 0)
        indexes.close()
        assert len(indexes) == 0


def test_compiled_index_rejects_bad_sizes():
    from specdec.plugins.ngram.compiled import CompiledNgramIndexes

    with pytest.raises(ValueError, match="bad ngram sizes"):
        CompiledNgramIndexes(3, 2).draft_batch([specdec.ProposalRequest("a", np.arange(5), 5, 2)])


def test_proposer_drafts_the_same_with_either_index():
    """The proposer's two paths (compiled index, and the Python fallback used without a C++
    compiler) give the same drafts step after step, including the padded width."""
    compiled = NgramProposer(NgramConfig(max_ngram_size=3, min_ngram_size=1))
    fallback = NgramProposer(NgramConfig(max_ngram_size=3, min_ngram_size=1))
    fallback._compiled = None
    rng = np.random.default_rng(3)
    streams = {f"r{i}": list(rng.integers(0, 6, 30)) for i in range(4)}
    for proposer in (compiled, fallback):
        for request_id, tokens in streams.items():
            proposer.on_request_start(specdec.ProposalRequest(request_id, np.array(tokens), len(tokens), 0))
    for _ in range(20):
        for tokens in streams.values():
            tokens.extend(rng.integers(0, 6, int(rng.integers(1, 4))).tolist())
        batch = specdec.ProposalBatch([specdec.ProposalRequest(request_id, np.array(tokens), 30, int(rng.integers(0, 5)))
                                       for request_id, tokens in streams.items()])
        want, got = fallback.propose(batch), compiled.propose(batch)
        assert got.to_lists() == want.to_lists()
        assert got.token_ids.shape == want.token_ids.shape
    assert compiled._compiled is not None  # the compiled path really ran
