"""The scheduler on hand-built states (no model): budgets, chunking, preemption."""

from __future__ import annotations

import numpy as np

from specdec import SamplingParams
from specdec.engine.kv_cache import BlockPool, KVCacheManager
from specdec.engine.request import Request
from specdec.engine.scheduler import Scheduler


def _request(name: str, prompt_len: int, max_tokens: int = 8) -> Request:
    tokens = np.zeros(prompt_len + max_tokens + 8, dtype=np.int64)
    tokens[:prompt_len] = np.arange(prompt_len) + 1000 * len(name)
    return Request(request_id=name, prompt=None, sampling=SamplingParams(max_tokens=max_tokens), tokens=tokens,
                   num_prompt_tokens=prompt_len, num_tokens=prompt_len, rng=np.random.default_rng(0),
                   detokenizer=None)


def _scheduler(num_blocks: int, block_size: int, budget: int, max_num_seqs: int = 8) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, block_size, enable_prefix_caching=False))
    return Scheduler(kv, max_num_seqs, budget)


def test_decodes_first_then_prefill_chunks_within_the_budget():
    scheduler = _scheduler(num_blocks=64, block_size=8, budget=20)
    decoding, long = _request("d", 10), _request("l", 100)
    scheduler.waiting += [decoding, long]
    first = scheduler.schedule(lambda r: 3)
    # d's whole prompt fits (10 rows + 3 draft rows); l gets the remaining 7 rows as a chunk.
    assert first.decodes == [decoding] and first.max_draft_lens == [3]
    assert first.chunks == [(long, 7)]
    decoding.context_len, decoding.num_tokens = 10, 11  # it emitted one token
    long.context_len += 7
    second = scheduler.schedule(lambda r: 3)
    assert second.decodes == [decoding] and second.chunks == [(long, 16)]


def test_partial_prefills_that_fill_the_pool_preempt_the_newest():
    scheduler = _scheduler(num_blocks=4, block_size=8, budget=64)
    older, newer = _request("a", 40), _request("b", 40)
    for request in (older, newer):
        scheduler.running.append(request)
        request.prefix_keys = []
        assert scheduler.kv.grow(request, 16)
        request.context_len = 16
    assert scheduler.kv.pool.num_free == 0
    step = scheduler.schedule(lambda r: 0)
    assert step.preempted == [newer] and scheduler.waiting == [newer] and newer.context_len == 0
    assert step.chunks and step.chunks[0][0] is older


def test_a_decode_without_room_for_drafts_runs_without_them():
    scheduler = _scheduler(num_blocks=2, block_size=8, budget=64)
    request = _request("a", 15)
    scheduler.waiting.append(request)
    step = scheduler.schedule(lambda r: 5)  # 15 + 5 positions would need a third block
    assert step.decodes == [request] and step.max_draft_lens == [1]
    assert not step.preempted
