"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, reference counts, and the
prefix cache that lets requests with a common prompt prefix share its blocks.

The attention backend owns the cache memory; this module only decides which block holds
which positions of which request. Request ``r`` keeps position ``p`` in block
``r.block_table[p // block_size]`` at offset ``p % block_size``.

Prefix sharing works on full blocks of the prompt. A block's key is a SHA-256 chain over the
token ids of every block up to and including it, so equal keys mean equal prefixes. Once a
request has computed a full prompt block, the block is registered under its key; a later
request whose prompt starts with the same blocks takes them (reference count + 1) and starts
its prefill after them. While one request is still computing a prefix block, a request that
needs the same block waits for it (see :meth:`KVCacheManager.start`) rather than computing it
a second time. A block whose count drops to 0 joins the free list but keeps its key
and contents until the pool hands it out again (least recently freed first), so a prefix
stays reusable after the requests that built it have finished.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Optional

import numpy as np


class BlockPool:
    """``num_blocks`` blocks, each free (count 0) or held by one or more requests."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = np.zeros(num_blocks, dtype=np.int64)
        # Free blocks in the order they are handed out: least recently freed first.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        #: Prefix blocks reused instead of computed, since the pool was built.
        self.num_reused_blocks = 0

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached prefix blocks among them: they can be handed out)."""
        return len(self._free)

    def allocate(self) -> Optional[int]:
        """Take a free block (forgetting any prefix it cached); ``None`` when none is free."""
        if not self._free:
            return None
        block, _ = self._free.popitem(last=False)
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
        self.ref_counts[block] = 1
        return block

    def release(self, block: int) -> None:
        """Drop one reference; the block is free when none is left."""
        count = self.ref_counts[block] - 1
        if count < 0:
            raise RuntimeError(f"KV block {block} released more often than taken")
        self.ref_counts[block] = count
        if count == 0:
            self._free[block] = None

    def take_cached(self, key: bytes) -> Optional[int]:
        """Take a reference to the block cached under ``key``, if there is one."""
        block = self._block_of.get(key)
        if block is None:
            return None
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1
        self.num_reused_blocks += 1
        return block

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the blocks stay where they are)."""
        self._key_of.clear()
        self._block_of.clear()

    def is_cached(self, key: bytes) -> bool:
        return key in self._block_of

    def register(self, block: int, key: bytes) -> None:
        """Remember that ``block`` holds the full prefix block ``key`` (first one wins)."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key


def block_keys(token_ids: np.ndarray, block_size: int, num_blocks: int) -> list[bytes]:
    """Chained keys of the first ``num_blocks`` full blocks of ``token_ids``."""
    keys, parent = [], b""
    data = np.ascontiguousarray(token_ids[: num_blocks * block_size], dtype=np.int64)
    for i in range(num_blocks):
        parent = hashlib.sha256(parent + data[i * block_size: (i + 1) * block_size].tobytes()).digest()
        keys.append(parent)
    return keys


class KVCacheManager:
    """Block tables of the running requests over one :class:`BlockPool`.

    A request holds ``block_table`` (block ids in position order) and ``prefix_keys`` (the keys
    of its shareable prompt blocks); ``num_registered`` counts the prompt blocks already
    offered to the prefix cache.
    """

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        # Prefix keys a running request is computing now -> that request.
        self._claims: dict[bytes, object] = {}

    def blocks_needed(self, request, num_positions: int) -> int:
        """How many more blocks ``request`` needs to hold ``num_positions`` positions."""
        return max(0, -(-num_positions // self.block_size) - len(request.block_table))

    def _prefix_keys(self, request) -> list[bytes]:
        """The keys of ``request``'s shareable prompt blocks, computed once per request."""
        if request.prefix_keys is None:
            shareable = (request.num_prompt_tokens - 1) // self.block_size
            request.prefix_keys = block_keys(request.tokens, self.block_size, shareable)
        return request.prefix_keys

    def must_wait(self, request) -> bool:
        """True when another running request is computing the first prompt block of
        ``request`` that is not cached yet: admitting it now would compute that block twice."""
        if not self.pool.enable_prefix_caching:
            return False
        for key in self._prefix_keys(request):
            if self.pool.is_cached(key):
                continue
            return key in self._claims
        return False

    def start(self, request) -> int:
        """Attach the cached prefix of ``request``'s prompt; return how many positions it
        covers (the prefill starts there). The last prompt token is never taken from the
        cache: the first step must feed it to get the logits of the first output token."""
        request.block_table = []
        request.num_registered = 0
        if not self.pool.enable_prefix_caching:
            request.prefix_keys = []
            return 0
        for key in self._prefix_keys(request):
            block = self.pool.take_cached(key)
            if block is None:
                break
            request.block_table.append(block)
        request.num_registered = len(request.block_table)
        for key in request.prefix_keys[request.num_registered:]:
            self._claims.setdefault(key, request)
        return len(request.block_table) * self.block_size

    def grow(self, request, num_positions: int) -> bool:
        """Give ``request`` blocks for ``num_positions`` positions; False (and nothing taken)
        when the pool has too few free blocks."""
        needed = self.blocks_needed(request, num_positions)
        if needed > self.pool.num_free:
            return False
        for _ in range(needed):
            request.block_table.append(self.pool.allocate())
        return True

    def register_computed(self, request, upto: Optional[int] = None) -> None:
        """Offer the prompt blocks ``request`` has fully computed to the prefix cache; with
        ``upto``, only those below that position (the rest wait for a later call)."""
        computed = request.context_len if upto is None else min(request.context_len, upto)
        done = min(computed // self.block_size, len(request.prefix_keys))
        for i in range(request.num_registered, done):
            key = request.prefix_keys[i]
            self.pool.register(request.block_table[i], key)
            if self._claims.get(key) is request:
                del self._claims[key]
        request.num_registered = max(request.num_registered, done)

    def adopt(self, request, num_positions: int, upto: Optional[int] = None) -> None:
        """Count positions ``0 .. num_positions - 1`` of ``request`` as computed: their keys and
        values were written into its blocks from elsewhere (a request imported from another
        engine; call once they are written). Its full prompt blocks join the prefix cache as
        if it had computed them, so later requests with the same prompt prefix share them (a
        block already cached under the same key stays the shared one); with ``upto``, only
        those below that position, as :meth:`register_computed`."""
        if not self.pool.enable_prefix_caching:
            request.prefix_keys = []
        self._prefix_keys(request)
        request.context_len = num_positions
        self.register_computed(request, upto)

    def free(self, request) -> None:
        """Return every block of ``request`` (tail first, so that shared prefix blocks are the
        last to be handed out again)."""
        for key in (request.prefix_keys or [])[request.num_registered:]:
            if self._claims.get(key) is request:
                del self._claims[key]
        for block in reversed(request.block_table):
            self.pool.release(block)
        request.block_table = []
        request.num_registered = 0
