"""Continuous batching: which requests run in a step, with how many rows, in which KV blocks.

Each step the scheduler fills a budget of ``max_num_batched_tokens`` rows, in this order:

1. running requests that are decoding: one row for the last token plus room for their drafts;
2. running requests still prefilling a long prompt: the next chunk that fits the budget;
3. waiting requests, first come first served, while the batch has fewer than
   ``max_num_seqs`` requests and the KV pool has blocks for their first chunk (a cached
   prompt prefix is attached first, so it costs neither blocks nor rows).

A decoding request whose next positions need a block when none is free takes one from the
request admitted last (preemption by recomputation: the victim frees all its blocks and goes
back to the front of the queue with its tokens; it is prefilled again when there is room).
Because decode rows are scheduled first, a long prompt never stalls the requests that are
decoding; it is prefilled over several steps instead.
"""

from __future__ import annotations

from typing import Callable

import attrs

from .kv_cache import KVCacheManager
from .request import Request


@attrs.define(slots=True)
class ScheduledStep:
    """The requests of one step.

    :ivar decodes: requests whose uncomputed tokens all fit this step: they get logits, drafts
        (up to ``max_draft_lens[i]``) and emit tokens.
    :ivar max_draft_lens: the most drafts each of ``decodes`` may verify (rows and blocks are
        reserved for them).
    :ivar chunks: ``(request, rows)`` prefill chunks that leave part of a prompt for later.
    :ivar admitted: requests that joined the running batch in this schedule (from the waiting
        queue: new ones, and preempted ones coming back). The engine starts the new ones'
        proposer state before anything else runs.
    :ivar preempted: requests that lost their blocks during this schedule.
    :ivar exhausted: running requests that cannot grow even with the whole pool to themselves
        (the engine ends them with finish reason ``length``).
    """

    decodes: list[Request] = attrs.field(factory=list)
    max_draft_lens: list[int] = attrs.field(factory=list)
    chunks: list[tuple[Request, int]] = attrs.field(factory=list)
    admitted: list[Request] = attrs.field(factory=list)
    preempted: list[Request] = attrs.field(factory=list)
    exhausted: list[Request] = attrs.field(factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.decodes) + len(self.chunks)

    @property
    def requests(self) -> list[Request]:
        """Every request that feeds rows this step: the decodes, then the prefill chunks."""
        return [*self.decodes, *(request for request, _ in self.chunks)]

    def keeping(self, keep: Callable[[Request], bool]) -> "ScheduledStep":
        """The same step without the requests ``keep`` refuses (failed ones)."""
        kept = [i for i, request in enumerate(self.decodes) if keep(request)]
        return ScheduledStep(decodes=[self.decodes[i] for i in kept],
                             max_draft_lens=[self.max_draft_lens[i] for i in kept],
                             chunks=[(r, rows) for r, rows in self.chunks if keep(r)],
                             admitted=[r for r in self.admitted if keep(r)],
                             preempted=self.preempted, exhausted=self.exhausted)


class Scheduler:
    """Owns the waiting queue and the running batch; see the module docstring."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    def schedule(self, max_draft_len: Callable[[Request], int]) -> ScheduledStep:
        """Plan one step. ``max_draft_len(request)`` is the most drafts a request could use."""
        step = ScheduledStep()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()

        for request in list(self.running):  # 1. decoding requests
            if request.num_uncomputed != 1 or id(request) in scheduled or budget < 1:
                continue
            if request not in self.running:  # preempted by an earlier request of this loop
                continue
            room = max(0, min(max_draft_len(request), budget - 1))
            if room and not self.kv.grow(request, request.num_tokens + room):
                room = 0  # no block for the drafts: decode without them before preempting anyone
            if not self._grow_or_preempt(request, request.num_tokens + room, scheduled, step):
                continue
            step.decodes.append(request)
            step.max_draft_lens.append(room)
            scheduled.add(id(request))
            budget -= 1 + room

        for request in list(self.running):  # 2. prefills of running requests, in chunks
            if request.num_uncomputed == 1 or id(request) in scheduled or request not in self.running \
                    or budget < 1:
                continue
            # At least one more position: without it, requests that hold partial prefills
            # could wait for each other's blocks forever.
            if not self._grow_or_preempt(request, request.context_len + 1, scheduled, step):
                continue
            budget -= self._schedule_prefill(request, budget, max_draft_len, step)
            scheduled.add(id(request))

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:  # 3. admission
            request = next((r for r in self.waiting if not self.kv.must_wait(r)), None)
            if request is None:
                break
            request.context_len = self.kv.start(request)
            if not self.kv.grow(request, min(request.num_tokens, request.context_len + budget)):
                self.kv.free(request)
                request.context_len = 0
                break  # first come, first served: nobody overtakes the request that does not fit
            self.waiting.remove(request)
            self.running.append(request)
            step.admitted.append(request)
            budget -= self._schedule_prefill(request, budget, max_draft_len, step)
            scheduled.add(id(request))
        return step

    def _schedule_prefill(self, request: Request, budget: int, max_draft_len, step: ScheduledStep) -> int:
        """Schedule the next prefill chunk of ``request`` (blocks permitting); return its rows."""
        free_positions = (len(request.block_table) + self.kv.pool.num_free) * self.kv.block_size
        rows = min(request.num_uncomputed, budget, free_positions - request.context_len)
        if rows <= 0:
            return 0
        if rows == request.num_uncomputed:  # the prompt completes: it decodes its first token
            room = max(0, min(max_draft_len(request), budget - rows))
            while room and not self.kv.grow(request, request.num_tokens + room):
                room -= 1
            if self.kv.grow(request, request.num_tokens + room):
                step.decodes.append(request)
                step.max_draft_lens.append(room)
                return rows + room
            rows -= 1
        if rows <= 0 or not self.kv.grow(request, request.context_len + rows):
            return 0
        step.chunks.append((request, rows))
        return rows

    def _grow_or_preempt(self, request: Request, num_positions: int, scheduled: set, step: ScheduledStep) -> bool:
        """Blocks for ``num_positions`` positions of ``request``, preempting the newest
        unscheduled requests if needed. False when ``request`` itself had to go."""
        while not self.kv.grow(request, num_positions):
            victim = next((r for r in reversed(self.running) if id(r) not in scheduled), None)
            if victim is None:
                return False
            if victim is request and len(self.running) == 1:
                step.exhausted.append(request)
                return False
            self.preempt(victim)
            step.preempted.append(victim)
            if victim is request:
                return False
        return True

    def preempt(self, request: Request) -> None:
        """Free ``request``'s blocks and queue it first, to be prefilled again later."""
        self.kv.free(request)
        request.context_len = 0
        request.num_preemptions += 1
        self.running.remove(request)
        self.waiting.insert(0, request)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out of the batch or the queue, freeing its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
