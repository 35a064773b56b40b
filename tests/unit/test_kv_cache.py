"""The KV block pool, the prefix cache and the block tables (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.engine.kv_cache import BlockPool, KVCacheManager, block_keys


class FakeRequest:
    """Just the fields the KV manager reads and writes."""

    def __init__(self, prompt, context_len=0):
        self.tokens = np.asarray(prompt, dtype=np.int64)
        self.num_prompt_tokens = len(prompt)
        self.context_len = context_len
        self.block_table = []
        self.prefix_keys = None
        self.num_registered = 0


def test_pool_hands_out_and_takes_back_blocks():
    pool = BlockPool(3, 4)
    blocks = [pool.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and pool.num_free == 0
    assert pool.allocate() is None
    pool.release(blocks[1])
    assert pool.num_free == 1 and pool.allocate() == blocks[1]
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(blocks[0])
        pool.release(blocks[0])


def test_block_keys_chain_the_whole_prefix():
    a = block_keys(np.array([1, 2, 3, 4, 5, 6]), 2, 3)
    b = block_keys(np.array([9, 2, 3, 4, 5, 6]), 2, 3)
    assert len(a) == 3 and len(set(a)) == 3
    # Same tokens in block 2, different first block: every key differs (a chain, not per block).
    assert all(x != y for x, y in zip(a, b))
    assert block_keys(np.array([1, 2, 3, 4, 5, 6, 7]), 2, 3) == a


def test_shared_prefix_blocks_are_reused_with_reference_counts():
    pool = BlockPool(16, 4)
    kv = KVCacheManager(pool)
    prompt = list(range(100, 111))  # 11 tokens: 2 full shareable blocks ((11 - 1) // 4)
    first = FakeRequest(prompt)
    assert kv.start(first) == 0
    assert kv.grow(first, 11)
    assert len(first.block_table) == 3 and pool.num_free == 13
    first.context_len = 10
    kv.register_computed(first)

    second = FakeRequest(prompt[:9] + [7, 7])  # same first 2 blocks, different tail
    assert kv.start(second) == 8
    assert second.block_table == first.block_table[:2]
    assert pool.ref_counts[first.block_table[0]] == 2 and pool.num_reused_blocks == 2
    assert kv.grow(second, 11) and pool.num_free == 12

    kv.free(first)
    assert pool.ref_counts[second.block_table[0]] == 1 and pool.num_free == 13
    kv.free(second)
    assert pool.num_free == 16


def test_freed_prefix_stays_cached_until_its_block_is_reused():
    pool = BlockPool(4, 4)
    kv = KVCacheManager(pool)
    prompt = list(range(9))  # 2 shareable blocks
    first = FakeRequest(prompt)
    kv.start(first)
    kv.grow(first, 9)
    first.context_len = 8
    kv.register_computed(first)
    kv.free(first)
    assert pool.num_free == 4
    again = FakeRequest(prompt)
    assert kv.start(again) == 8  # found although its first owner is gone
    kv.free(again)
    # Hand out every block: the cached ones are evicted and their keys forgotten.
    taken = [pool.allocate() for _ in range(4)]
    assert None not in taken
    for block in taken:
        pool.release(block)
    assert kv.start(FakeRequest(prompt)) == 0


def test_a_request_waits_for_a_prefix_another_one_is_computing():
    pool = BlockPool(16, 4)
    kv = KVCacheManager(pool)
    prompt = list(range(20))
    first, second = FakeRequest(prompt), FakeRequest(prompt)
    assert not kv.must_wait(first)
    kv.start(first)
    kv.grow(first, 20)
    assert kv.must_wait(second)  # first claimed the prefix blocks
    first.context_len = 19
    kv.register_computed(first)
    assert not kv.must_wait(second)
    assert kv.start(second) == 16
    # A request freed before finishing its prefix releases its claims.
    third = FakeRequest(list(range(50, 70)))
    kv.start(third)
    assert kv.must_wait(FakeRequest(list(range(50, 70))))
    kv.free(third)
    assert not kv.must_wait(FakeRequest(list(range(50, 70))))


def test_grow_takes_nothing_when_the_pool_is_short():
    pool = BlockPool(3, 4)
    kv = KVCacheManager(pool)
    request = FakeRequest([1, 2, 3])
    kv.start(request)
    assert not kv.grow(request, 13)  # needs 4 blocks
    assert request.block_table == [] and pool.num_free == 3
    assert kv.grow(request, 12) and pool.num_free == 0


def _computed_prefix(pool: BlockPool):
    """A manager over ``pool`` holding one 9-token request with its 2 full blocks computed."""
    kv = KVCacheManager(pool)
    first = FakeRequest(list(range(9)))
    kv.start(first)
    kv.grow(first, 9)
    first.context_len = 8
    kv.register_computed(first)
    return kv, first


def test_no_prefix_caching_shares_nothing():
    kv, _ = _computed_prefix(BlockPool(8, 4, enable_prefix_caching=False))
    assert kv.start(FakeRequest(list(range(9)))) == 0


def test_reset_prefix_cache_forgets_every_prefix():
    pool = BlockPool(8, 4)
    kv, first = _computed_prefix(pool)
    kv.free(first)
    pool.reset_prefix_cache()
    assert kv.start(FakeRequest(list(range(9)))) == 0


def test_freeing_a_request_that_never_started_is_a_no_op():
    pool = BlockPool(4, 4)
    KVCacheManager(pool).free(FakeRequest([1, 2, 3]))  # prefix_keys still None: never admitted
    assert pool.num_free == 4
