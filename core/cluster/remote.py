"""The origin's side of a request that runs on another instance.

:class:`RemoteRequestStream` looks to the HTTP handlers like the engine loop's
:class:`~specdec.server.engine_loop.RequestStream`: ``admitted()``, then ``Delta`` events and
one ``Finished``. Behind it a task dispatches the job, reads the request's event stream from
Redis in order, and watches whoever runs the request (the instance named by its claim).

When the request is lost, because that instance stopped (its registration expired), an event
went missing (Redis restarted between its write and its read), the job vanished from Redis,
or the instance was busy, then:

* if nothing of the request has reached the client yet (no text), the request is **re-run
  from the start** on another instance, as a new attempt; the old attempt is cancelled, and
  whatever it still writes is ignored (every event carries its attempt);
* otherwise it **fails** with finish reason ``error`` and a one-line message saying what
  happened and after how many tokens, because the client already holds part of an answer that
  a second run could contradict.

So a request is never run twice for the client, and never hangs: a request whose Redis stays
unreachable for ``RedisLink.give_up_after`` seconds fails too, and so does an attempt that
misses a deadline: its job not taken within :data:`DISPATCH_DEADLINE_S` seconds (an instance
that registers and never takes its jobs would otherwise *black-hole* every request routed to
it), or no event for :data:`IDLE_DEADLINE_S` seconds once it runs. Such an attempt is lost
like the others above (re-run elsewhere, else failed with a message that says so).

Jobs are signed with the cluster secret (:meth:`Job.to_json`), and a ``pd`` job carries the
hand-off ticket (:func:`.transfer.issue_ticket`) the decode instance takes the request on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from ..metrics import SpecMetrics
from ..server.engine_loop import Admitted, Delta, Finished, RequestStream
from ..server.token_sources import joined
from .messages import Job, Options, decode_event, sampling_to_dict, to_loop_event
from .redis_link import RedisLink, RedisUnavailable
from .registry import ClusterView
from .router import NoRoute, Route
from .transfer import issue_ticket

logger = logging.getLogger("specdec.cluster")

#: Attempts of one request before the origin gives up on it.
MAX_ATTEMPTS = 3
#: Seconds between two checks of a quiet request (its claim, its instance).
CHECK_S = 1.0
#: Checks in a row that find neither the request's claim nor its job before it counts as lost.
LOST_AFTER_CHECKS = 3
#: Seconds an attempt's job may wait for its instance to take it.
DISPATCH_DEADLINE_S = 60.0
#: Seconds a running attempt may go without an event.
IDLE_DEADLINE_S = 300.0


class _Lost(Exception):
    """The attempt is lost; ``instance`` (if known) should not get the request again."""

    def __init__(self, message: str, instance: Optional[str] = None):
        super().__init__(message)
        self.instance = instance


class RemoteRequestStream(RequestStream):
    """A request routed to another instance (see the module docstring).

    :param route: the first attempt's route (``run`` or ``pd``).
    :param route_again: ``route_again(exclude)`` chooses the route of a re-run (``run`` or
        ``pd``, this instance's own job list included), or raises
        :class:`~specdec.cluster.router.NoRoute`.
    :param streaming: the client reads the text as it comes. When it does not, the text is
        held here until the end, so that nothing reaches the client before the request is
        done, and a lost request can always run again.
    :param secret: the cluster secret that signs jobs and hand-off tickets, or None.
    :param dispatch_deadline: seconds (see the module docstring).
    :param idle_deadline: seconds (see the module docstring).
    :param options: what the job carries besides the prompt and sampling (tenant, grammar,
        token sources: :class:`~.messages.Options`).
    """

    def __init__(self, request_id: str, link: RedisLink, view: ClusterView, origin: str, route: Route,
                 prompt_ids, sampling, route_again: Callable[[frozenset], Route], streaming: bool = True,
                 secret: Optional[bytes] = None, dispatch_deadline: float = DISPATCH_DEADLINE_S,
                 idle_deadline: float = IDLE_DEADLINE_S, options: Options = Options()):
        super().__init__(request_id, engine_loop=None)
        self._secret = secret
        self._dispatch_deadline = dispatch_deadline
        self._idle_deadline = idle_deadline
        self._link = link
        self._view = view
        self._origin = origin
        self._route = route
        self._prompt = [int(t) for t in prompt_ids]
        self._sampling = sampling_to_dict(sampling)
        self._options = options
        self._route_again = route_again
        self._attempt = 0
        self._aborted = False
        self._admitted_sent = False
        self._num_generated = 0  # tokens the running attempt has generated, as its last event said
        self._text_sent = False
        self._streaming = streaming
        self._held: list[str] = []  # text held back from a client that does not stream
        self._held_logprobs: list = []  # and the logprob entries of its tokens
        self._held_sources: list = []  # and their token sources (when asked for)
        self._task = asyncio.ensure_future(self._follow())

    def abort(self) -> None:
        """The client is gone: cancel the attempt that runs (nothing happens once finished)."""
        if not self.finished:
            self.finished = True
            self._aborted = True

    # -- the follower --------------------------------------------------------------------

    async def _follow(self) -> None:
        excluded: set[str] = set()
        route = self._route
        try:
            while True:
                self._attempt += 1
                try:
                    await self._run_attempt(route)
                    return
                except _Lost as lost:
                    await self._cancel_attempt()
                    if lost.instance:
                        excluded.add(lost.instance)
                    if self._text_sent or self._attempt >= MAX_ATTEMPTS:
                        self._fail(str(lost))
                        return
                    logger.warning("request %s: attempt %d lost (%s); running it again", self.request_id,
                                   self._attempt, lost)
                    self._held.clear()
                    self._held_logprobs.clear()
                    self._held_sources.clear()
                    self._num_generated = 0
                    try:
                        route = self._route_again(frozenset(excluded))
                    except NoRoute as exc:
                        self._fail(f"{lost}; {exc}")
                        return
        except RedisUnavailable as exc:
            self._fail(f"{exc}; the request failed")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here must still end the request
            logger.exception("request %s: following it failed", self.request_id)
            self._fail(f"the cluster lost this request: {type(exc).__name__}")
        finally:
            if self._aborted:
                await self._cancel_attempt()

    async def _run_attempt(self, route: Route) -> None:
        """Dispatch one attempt and deliver its events until it finishes (or the client left);
        raises :class:`_Lost`."""
        link, client = self._link, self._link.client
        job = self._job(route)
        target = route.target.instance_id
        job_bytes = job.to_json(self._secret)
        await link.call(lambda: client.rpush(link.keys.jobs(target), job_bytes))
        events_key = link.keys.events(self.request_id)
        last_id, expected = b"0-0", 0
        last_check, misses = time.monotonic(), 0
        self._taken, self._last_event_at = False, time.monotonic()
        while not self._aborted:
            entries = await link.call(lambda: client.xread({events_key: last_id}, count=64, block=500))
            for _, items in entries or ():
                for entry_id, fields in items:
                    last_id = entry_id
                    data = decode_event(fields)
                    if data["attempt"] != self._attempt or data["seq"] < expected:
                        continue
                    if data["seq"] > expected:
                        raise _Lost(f"events of this request were lost (the cluster's Redis restarted?) "
                                    f"after {self._num_generated} tokens")
                    expected += 1
                    self._taken, self._last_event_at = True, time.monotonic()
                    if data["type"] == "busy":
                        raise _Lost(data["message"], data.get("instance") or target)
                    if self._deliver_event(to_loop_event(data)):
                        await link.call(lambda: client.delete(events_key), give_up_after=2.0)
                        return
                    last_check, misses = time.monotonic(), 0
            if entries or time.monotonic() - last_check < CHECK_S:
                continue
            last_check = time.monotonic()
            misses = await self._check(target, job_bytes, misses)

    async def _check(self, target: str, job_bytes: bytes, misses: int) -> int:
        """A quiet request: is it still running, queued, or lost? Returns the new miss count."""
        client = self._link.client
        quiet = time.monotonic() - self._last_event_at
        claim = await self._link.call(lambda: client.get(self._link.keys.claim(self.request_id)))
        if claim is not None:
            holder, _, attempt = claim.decode().rpartition(" ")
            if attempt == str(self._attempt):
                if self._view.is_dead(holder):
                    raise _Lost(f"instance {holder} stopped while running this request, after "
                                f"{self._num_generated} tokens", holder)
                self._taken = True
                if quiet > self._idle_deadline:
                    self._missed_deadline(f"instance {holder} sent nothing of this request for "
                                          f"{self._idle_deadline:g} s, after {self._num_generated} tokens", holder)
                return 0
        queued = await self._link.call(lambda: client.lpos(self._link.keys.jobs(target), job_bytes))
        if queued is not None:
            if self._view.is_dead(target) and await self._link.call(
                    lambda: client.lrem(self._link.keys.jobs(target), 1, job_bytes)):
                raise _Lost(f"instance {target} stopped before it took this request", target)
            if not self._taken and quiet > self._dispatch_deadline and await self._link.call(
                    lambda: client.lrem(self._link.keys.jobs(target), 1, job_bytes)):
                self._missed_deadline(f"instance {target} did not take this request within "
                                      f"{self._dispatch_deadline:g} s", target)
            return 0
        misses += 1
        if misses >= LOST_AFTER_CHECKS:
            raise _Lost(f"the cluster lost track of this request (its instance stopped, or the cluster's Redis "
                        f"restarted) after {self._num_generated} tokens", target if self._view.is_dead(target) else None)
        return misses

    def _missed_deadline(self, message: str, instance: str):
        logger.warning("request %s: attempt %d missed its deadline: %s", self.request_id, self._attempt, message)
        raise _Lost(message, instance)

    def _job(self, route: Route) -> Job:
        decode = None
        if route.kind == "pd":
            ticket = issue_ticket(self._secret, request_id=self.request_id, attempt=self._attempt,
                                  origin=self._origin, decode=route.decode.instance_id)
            decode = {"instance_id": route.decode.instance_id, "needs_hidden_states": route.decode.needs_hidden_states,
                      "ticket": ticket}
        return Job(request_id=self.request_id, attempt=self._attempt, origin=self._origin,
                   kind="prefill" if route.kind == "pd" else "run", prompt=self._prompt, sampling=self._sampling,
                   decode=decode, **self._options.to_dict())

    def _deliver_event(self, event) -> bool:
        """Pass an attempt's event on to the handler (a re-run's Admitted only once); True at
        the end of the request."""
        if isinstance(event, Admitted):
            if not self._admitted_sent:
                self._admitted_sent = True
                self._deliver(event)
            return False
        if isinstance(event, Delta):
            self._num_generated = event.num_generated
            if not self._streaming:
                self._held.append(event.text)
                self._held_logprobs.extend(event.logprobs)
                self._held_sources.append(event.token_sources)
                return False
            self._text_sent = self._text_sent or bool(event.text)
        if isinstance(event, Finished) and self._held:
            event = Finished("".join(self._held) + event.text, event.num_generated, event.num_prompt_tokens,
                             event.finish_reason, event.metrics, event.error,
                             logprobs=(*self._held_logprobs, *event.logprobs),
                             token_sources=joined([*self._held_sources, event.token_sources]))
        self._deliver(event)
        return not isinstance(event, Delta)  # Rejected or Finished end the request

    def _fail(self, message: str) -> None:
        self._deliver(Finished("", self._num_generated, len(self._prompt), "error", SpecMetrics(), message))

    async def _cancel_attempt(self) -> None:
        try:
            await self._link.call(lambda: self._link.client.set(self._link.keys.cancel(self.request_id, self._attempt),
                                                                1, ex=60), give_up_after=2.0)
        except RedisUnavailable:
            pass
