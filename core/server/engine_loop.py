"""The engine loop: one background thread owns the engine and runs continuous batching.

The engine is not thread-safe, and a forward pass takes tens of milliseconds, so HTTP handlers
never touch it. They hand work to this thread through a thread-safe command queue, which the
thread drains between steps (new requests join the running batch at the next step; aborts take
effect before it). After each step the thread pushes every request's progress (a text delta, or
the final result) into that request's own asyncio queue with ``loop.call_soon_threadsafe``, so
the event loop only ever waits on queues, never on the model.

The loop is bounded: at most ``max_pending`` requests may be in it at once (queued, waiting for
a batch slot, or running); :meth:`EngineLoop.submit` raises :class:`QueueFull` beyond that, and
the server answers 503.

Plugin code runs on the engine thread, so the thread guards itself against it: anything a step
raises, ``SystemExit`` and ``KeyboardInterrupt`` included, fails the requests in the engine and
the thread goes on with the next ones; a step that runs past ``step_timeout`` (a plugin that
hangs) fails the requests in flight at once (see :mod:`specdec.server.watchdog`). While the
loop cannot serve, :attr:`EngineLoop.problem` says why (``/health`` answers 503 with it).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Optional, Sequence

import attrs

from ..errors import RequestError, SpecdecError
from ..metrics import SpecMetrics
from ..sampling import SamplingParams
from .token_sources import SourceTracker, joined
from .watchdog import DEFAULT_STEP_TIMEOUT, StepWatchdog

if TYPE_CHECKING:
    from ..engine.handoff import HandoffState

logger = logging.getLogger("specdec.server")

#: What a client is told when the engine failed on its request; the log has the exception.
ENGINE_ERROR_MESSAGE = "the engine failed while running this request; the server log has the details"


class QueueFull(SpecdecError):
    """The loop already holds ``max_pending`` requests."""


class RequestRejected(SpecdecError):
    """The engine refused the request (a prompt that does not fit the context, say).

    ``param`` and ``code`` are those of the engine's :class:`~specdec.errors.RequestError`
    (None for another refusal)."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.param = param
        self.code = code


class EngineStopped(SpecdecError):
    """The engine loop is not running (the server is shutting down, or the engine failed)."""


# -- what a request's queue receives ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admitted:
    """The engine accepted the request; ``num_prompt_tokens`` as it counted them."""

    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Rejected:
    """The engine refused the request; ``message`` is one line for the client, ``param`` the
    field it is about and ``code`` the OpenAI error code, when the engine named them."""

    message: str
    param: Optional[str] = None
    code: Optional[str] = None


@dataclass(frozen=True, slots=True)
class Delta:
    """New text of a running request, and how many tokens it has generated so far;
    ``logprobs``: the :class:`~specdec.engine.logprobs.TokenLogprob` of each token generated
    since the last event, when the request asked for them. ``token_sources``: the text's tokens
    and how each came, for a request submitted with ``token_sources=True`` (see
    :mod:`~specdec.server.token_sources`), else None."""

    text: str
    num_generated: int
    logprobs: tuple = ()
    token_sources: Optional[list[dict]] = None


@dataclass(frozen=True, slots=True)
class Finished:
    """The end of a request: the text not yet sent, and the final counts.

    ``finish_reason`` is ``stop`` (EOS or a stop string), ``length`` (max_tokens or the end of
    the context), ``abort`` (cancelled, or the server shut down), ``handoff`` (submitted with
    ``handoff=True`` and handed over after its first token: ``handoff`` holds the
    :class:`~specdec.engine.handoff.HandoffState` for another engine loop's
    :meth:`EngineLoop.submit_imported`), or ``error``: the engine failed while running the
    request, and ``error`` says so in one line for the client (the details, exception
    included, go to the server log only).
    """

    text: str
    num_generated: int
    num_prompt_tokens: int
    finish_reason: str
    metrics: SpecMetrics
    error: Optional[str] = None
    handoff: Optional["HandoffState"] = None
    #: As :attr:`Delta.logprobs`: the tokens' since the last event (all of them from :meth:`RequestStream.final`).
    logprobs: tuple = ()
    #: As :attr:`Delta.token_sources`, for ``text`` (for every token, in :meth:`RequestStream.final`).
    token_sources: Optional[list[dict]] = None


Event = Admitted | Rejected | Delta | Finished


@dataclass(frozen=True, slots=True)
class LoopSnapshot:
    """The engine's state after the last step, readable from any thread."""

    num_kv_blocks: int
    num_free_kv_blocks: int
    num_requests: int  #: requests in the engine (running or waiting for a batch slot)
    num_pending: int  #: requests submitted and not finished (the 503 bound counts these)
    max_pending: int
    running: bool  #: the loop thread is alive


# -- the handler's side ----------------------------------------------------------------------


class RequestStream:
    """A submitted request, as the HTTP handler sees it: an async stream of its events.

    Await :meth:`admitted` first (it raises :class:`RequestRejected` when the engine refused
    the request), then iterate: :class:`Delta` events, and one :class:`Finished` last.
    :meth:`abort` cancels the request; it is safe to call at any time, and a no-op once finished.
    """

    def __init__(self, request_id: str, engine_loop: "EngineLoop"):
        self.request_id = request_id
        self.num_prompt_tokens = 0
        self.finished = False
        self._engine_loop = engine_loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()

    async def admitted(self) -> int:
        """Wait until the engine has taken the request; return its prompt token count."""
        event = await self._queue.get()
        if isinstance(event, Rejected):
            self.finished = True
            raise RequestRejected(event.message, event.param, event.code)
        if isinstance(event, Finished):  # stopped before it started (shutdown)
            self.finished = True
            raise EngineStopped(event.error or "the server is shutting down")
        assert isinstance(event, Admitted), event
        self.num_prompt_tokens = event.num_prompt_tokens
        return event.num_prompt_tokens

    async def __aiter__(self) -> AsyncIterator[Delta | Finished]:
        while not self.finished:
            event = await self._queue.get()
            if isinstance(event, Finished):
                self.finished = True
            yield event

    async def final(self) -> Finished:
        """Wait for the end; return the whole text (its logprobs and token sources) in one
        :class:`Finished`."""
        parts, logprobs, sources = [], [], []
        while True:
            event = await self._queue.get()
            parts.append(event.text)
            logprobs.extend(event.logprobs)
            sources.append(event.token_sources)
            if isinstance(event, Finished):
                self.finished = True
                return Finished("".join(parts), event.num_generated, event.num_prompt_tokens,
                                event.finish_reason, event.metrics, event.error, event.handoff, tuple(logprobs),
                                joined(sources))

    def abort(self) -> None:
        """Cancel the request and free its KV cache (nothing happens once it has finished)."""
        if not self.finished:
            self.finished = True
            self._engine_loop.abort(self.request_id)

    def _deliver(self, event: Event) -> None:  # on the event loop, from call_soon_threadsafe
        self._queue.put_nowait(event)


# -- the engine thread's side ----------------------------------------------------------------


@dataclass(slots=True)
class _Tracked:
    """What the engine thread knows about one submitted request."""

    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    submitted_at: float
    handoff: bool = False
    capture_hidden: bool = False
    tenant: Optional[str] = None  # who sent it: the engine's add_request(tenant=...)
    row_processors: list = field(default_factory=list)  # the engine's add_request(row_processors=...)
    imported: Optional["HandoffState"] = None  # submit_imported's state
    request: object = None  # the engine's Request once added
    emitted_chars: int = 0
    emitted_logprobs: int = 0  # entries of request.logprobs already sent
    num_generated: int = 0
    first_token_at: float = 0.0
    spec_seen: SpecMetrics = field(default_factory=SpecMetrics)
    told_end: bool = False  # the client already got its Finished (from the step watchdog)
    sources: Optional[SourceTracker] = None  # submit(token_sources=True)

    def token_sources(self, text: str, final: bool = False) -> Optional[list[dict]]:
        """The entries of ``text``, the request's next piece of text (None unless asked for)."""
        if self.sources is None:
            return None
        try:
            self.sources.update(self.request.generated_ids, self.request.token_sources)
            return self.sources.entries(self.emitted_chars, text, final)
        except Exception:  # noqa: BLE001 - a tokenizer failure: the text goes on, without its sources
            logger.exception("token sources of request %s failed; it goes on without them", self.stream.request_id)
            self.sources = None
            return None

    def send(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.stream._deliver, event)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass


class EngineLoop:
    """Runs ``engine`` in a background thread; HTTP handlers submit requests to it.

    :param engine: a :class:`specdec.engine.Engine`; from :meth:`start` on only the loop's
        thread touches it.
    :param max_pending: the most requests submitted and not yet finished; :meth:`submit`
        raises :class:`QueueFull` beyond it. May be changed while running.
    :param metrics: a :class:`specdec.server.metrics.ServerMetrics` to record into, or None.
    :param step_timeout: seconds one engine step may run; past it the requests in flight fail,
        new ones are refused and :attr:`problem` says so, until the step returns. None: no
        watchdog.
    """

    def __init__(self, engine, *, max_pending: int = 128, metrics=None,
                 step_timeout: Optional[float] = DEFAULT_STEP_TIMEOUT):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.engine = engine
        self.max_pending = max_pending
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # touched by the engine thread only
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._lost: Optional[str] = None  # why the engine cannot go on (engine_lost, the thread died)
        self._stalled: Optional[str] = None  # why the step in progress counts as stalled
        self._watchdog = StepWatchdog(step_timeout, self._step_stalled) if step_timeout else None
        self._snapshot = self._take_snapshot()

    # -- any thread ------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        """The engine's tokenizer (safe to use from other threads: encoding holds no state)."""
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits (what a grammar's token mask covers)."""
        return self.engine.model_config.vocab_size

    @property
    def num_speculative_tokens(self) -> int:
        """The engine's k: the most drafts per request and step."""
        return self.engine.spec.num_speculative_tokens or 0

    @property
    def method(self) -> str:
        """The engine's speculative method (``naive``: none)."""
        return self.engine.spec.method

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._lost is None

    @property
    def problem(self) -> Optional[str]:
        """Why the loop cannot serve requests now, in one line; None while it can.

        The engine was lost (:meth:`engine_lost`), the engine thread died, a step has run past
        the step timeout (until it returns), or the loop is not running (not yet started, or
        stopped)."""
        if self._lost is not None:
            return self._lost
        if self._stalled is not None:
            return self._stalled
        if not self.running:
            return "the engine loop is not running"
        return None

    def engine_lost(self, message: str) -> None:
        """The engine cannot go on (a tensor-parallel rank died or hung). Called from another
        thread while the engine thread may be blocked for good, so it touches no engine state:
        new requests are refused, every request in flight (and every queued one) ends now with
        finish reason ``error`` and ``message``, and :attr:`running` turns false (``/health``
        answers 503). The caller then ends the process."""
        self._lost = message
        self._stopping = True
        self._drop_queued(message)
        for tracked in list(self._tracked.values()):
            tracked.told_end = True
            tracked.send(_error_end(tracked, message))

    @property
    def num_pending(self) -> int:
        """Requests submitted and not yet finished."""
        return self._pending

    def snapshot(self) -> LoopSnapshot:
        """The state after the last step (KV blocks, request counts)."""
        return self._snapshot

    def start(self) -> None:
        """Start the engine thread, and the step watchdog (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specdec-engine-loop", daemon=True)
            self._thread.start()
            if self._watchdog is not None:
                self._watchdog.start()

    def refuse_new(self) -> None:
        """From now on :meth:`submit` raises :class:`EngineStopped` (the server is draining)."""
        self._stopping = True

    def stop(self, timeout: float = 30.0) -> None:
        """Abort every request, end the thread and wait for it (idempotent)."""
        self._stopping = True
        self._commands.put(("stop", None))
        if self._thread is not None:
            if self._stalled is not None:  # its clients are told already; it may never return
                timeout = min(timeout, 1.0)
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine loop did not stop within %.0f s", timeout)
            else:  # a submit that raced with stopping: its request was queued after the last drain
                self._drop_queued("the server is shutting down")

    def abort(self, request_id: str) -> None:
        """Cancel a request (it finishes with reason ``abort`` and frees its KV cache)."""
        self._commands.put(("abort", request_id))

    # -- the event loop ----------------------------------------------------------------------

    def check_request(self, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        """The engine's checks of a request (the prompt's length and ids, the sampling values
        against the vocabulary, the stop-string limits, the context), run by the caller, so
        that nothing oversized reaches the engine thread; raises :class:`RequestRejected`.

        The engine thread checks again when it adds the request (cheap, once the sizes are
        known to be bounded). The length comes first: it costs nothing, where converting a
        list of millions of ids costs a tenth of a second of the GIL."""
        max_model_len = self.engine.max_model_len
        if len(prompt_token_ids) >= max_model_len:
            raise RequestRejected(f"prompt: {len(prompt_token_ids)} tokens do not fit the context of "
                                  f"{max_model_len} tokens", "prompt", "context_length_exceeded")
        try:
            self.engine.checked_prompt(prompt_token_ids)
            self.engine.check_sampling(sampling, len(prompt_token_ids))
        except RequestError as exc:
            raise RequestRejected(_one_line(exc), exc.param, exc.code) from None

    def submit(self, prompt_token_ids: Sequence[int], sampling: SamplingParams,
               request_id: Optional[str] = None, *, handoff: bool = False,
               capture_hidden: bool = False, tenant: Optional[str] = None,
               row_processors: Sequence = (), token_sources: bool = False) -> RequestStream:
        """Queue a request; call from the event loop. Returns its :class:`RequestStream`.

        ``handoff`` and ``capture_hidden`` go to the engine's ``add_request``: the request
        then ends after its first token with a :class:`Finished` of finish reason ``handoff``
        whose ``handoff`` holds the state to continue elsewhere (unless that token ended it).
        ``tenant`` (who sent it) and ``row_processors`` (a grammar's, built off this thread)
        go to ``add_request`` too. ``token_sources``: its events carry ``token_sources`` (the
        API's ``include_token_sources``).

        Raises :class:`QueueFull` when ``max_pending`` requests are already in the loop, and
        :class:`EngineStopped` when the loop is not running.
        """
        tracked = self._track(request_id, prompt_token_ids, sampling)
        tracked.handoff, tracked.capture_hidden, tracked.tenant = handoff, capture_hidden, tenant
        tracked.row_processors = list(row_processors)
        if token_sources:
            tracked.sources = SourceTracker(self.engine.tokenizer)
        self._commands.put(("add", tracked))
        return tracked.stream

    def submit_imported(self, state: "HandoffState", request_id: Optional[str] = None, *,
                        tenant: Optional[str] = None, row_processors: Sequence = (),
                        token_sources: bool = False) -> RequestStream:
        """Continue a request another engine handed off (``submit(..., handoff=True)`` there,
        see the engine's ``import_request``); call from the event loop. The same bounds and
        events as :meth:`submit`: :class:`Admitted`, then :class:`Delta` events (the first
        holds the text of the handed-off tokens too) and :class:`Finished`; a state this
        engine cannot take (another KV layout, a prompt that does not fit) is
        :class:`Rejected` (:meth:`RequestStream.admitted` raises :class:`RequestRejected`).
        ``tenant``, ``row_processors`` (whose state already follows the handed-off tokens) and
        ``token_sources`` as for :meth:`submit`; the handed-off tokens count as ``decode``.
        """
        tracked = self._track(request_id, state.prompt_token_ids, state.sampling)
        tracked.imported, tracked.tenant = state, tenant
        tracked.row_processors = list(row_processors)
        if token_sources:
            tracked.sources = SourceTracker(self.engine.tokenizer)
        self._commands.put(("add", tracked))
        return tracked.stream

    def _track(self, request_id: Optional[str], prompt_token_ids: Sequence[int], sampling: SamplingParams) -> _Tracked:
        """Count a new request against ``max_pending`` (or refuse it) and track it."""
        if self._stopping or not self.running or self._stalled is not None:
            raise EngineStopped("the server is shutting down" if self._stopping else self.problem)
        with self._pending_lock:
            if self._pending >= self.max_pending:
                raise QueueFull(f"the server is at capacity ({self.max_pending} requests in flight); retry later")
            self._pending += 1
        stream = RequestStream(request_id or uuid.uuid4().hex, self)
        return _Tracked(stream, asyncio.get_running_loop(), prompt_token_ids, sampling, time.perf_counter())

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if not self._drain(block=not engine.has_unfinished()):
                    break
                self._publish()
                if not engine.has_unfinished():
                    continue
                self._step()
                self._publish()
        except BaseException as exc:  # noqa: BLE001 - a bug in this loop itself: say so, fail what is left
            self._lost = f"the engine thread died ({_one_line(exc)}); restart the server"
            logger.critical("%s", self._lost, exc_info=exc)
        finally:
            if self._watchdog is not None:
                self._watchdog.stop()
            if self._lost is not None:
                self._fail_all(self._lost)
            else:
                self._fail_all("the server is shutting down", error=False)
            self._snapshot = self._take_snapshot(running=False)

    def _step(self) -> None:
        """One engine step, watched. Whatever it raises fails the requests in the engine (not
        only one request's failure, which the engine handles itself) and the loop goes on:
        ``BaseException`` too, since plugin code runs here and ``sys.exit()`` in it must not
        end this thread. A step the watchdog declared stalled fails them once it returns."""
        failed = False
        if self._watchdog is not None:
            self._watchdog.begin()
        try:
            self.engine.step()
        except BaseException as exc:  # noqa: BLE001 - see the docstring
            logger.error("engine step failed", exc_info=exc)
            failed = True
        if self._watchdog is not None and self._watchdog.end():
            logger.warning("the stalled engine step returned; the server takes requests again")
            self._fail_all(self._stalled)  # what the clients were told by _step_stalled
            self._stalled = None
        elif failed:
            self._fail_all(ENGINE_ERROR_MESSAGE)

    def _step_stalled(self, seconds: float) -> None:
        """The step watchdog's call (its thread) while a step has run for ``seconds``, past
        the timeout: the engine thread is still inside the step, so only the clients are told
        (the requests in flight end with finish reason ``error``, the queued ones are
        refused); the engine thread ends the requests in the engine once the step returns."""
        timeout = self._watchdog.timeout
        self._stalled = (f"the engine stalled: a step has run for more than the step timeout of {timeout:g} s "
                         "(--step-timeout); the requests in flight were ended")
        logger.error("an engine step has run for %.1f s, more than the step timeout of %g s: failing the "
                     "requests in flight; /health answers 503 until the step returns", seconds, timeout)
        self._drop_queued(self._stalled)
        for tracked in list(self._tracked.values()):
            tracked.told_end = True
            tracked.send(_error_end(tracked, self._stalled))

    def _drain(self, block: bool) -> bool:
        """Apply queued commands (blocking for the first one when idle); False on ``stop``."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, payload = command
            if kind == "stop":
                return False
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                self._abort(payload)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, tracked: _Tracked) -> None:
        request_id = tracked.stream.request_id
        try:
            request = self._add_to_engine(tracked, request_id)
        except RequestError as exc:  # the app answers 400 (and counts it)
            self._release()
            tracked.send(Rejected(_one_line(exc), exc.param, exc.code))
            return
        except BaseException as exc:  # noqa: BLE001 - whatever the engine refuses, the loop goes on
            if not isinstance(exc, SpecdecError):
                logger.exception("add_request failed")
            self._release()
            tracked.send(Rejected(_one_line(exc) if isinstance(exc, SpecdecError) else
                                  "the request could not be added (see the server log)"))
            return
        tracked.request = request
        self._tracked[request_id] = tracked
        if tracked.imported is not None:
            # Its first token was counted (and timed) where it was generated.
            tracked.num_generated, tracked.first_token_at = request.num_generated, tracked.submitted_at
        tracked.send(Admitted(request.num_prompt_tokens))
        if self.metrics is not None:
            self.metrics.request_admitted(request.num_prompt_tokens)

    def _add_to_engine(self, tracked: _Tracked, request_id: str):
        if tracked.imported is not None:
            return self.engine.import_request(tracked.imported, request_id=request_id, tenant=tracked.tenant,
                                              row_processors=tracked.row_processors)
        if tracked.handoff:
            return self.engine.add_request(tracked.prompt_token_ids, tracked.sampling, request_id=request_id,
                                           handoff=True, capture_hidden=tracked.capture_hidden, tenant=tracked.tenant,
                                           row_processors=tracked.row_processors)
        return self.engine.add_request(tracked.prompt_token_ids, tracked.sampling, request_id=request_id,
                                       tenant=tracked.tenant, row_processors=tracked.row_processors)

    def _abort(self, request_id: str) -> None:
        if request_id not in self._tracked:
            return
        try:
            self.engine.abort_request(request_id)  # finished with reason "abort"; _publish reports it
        except BaseException as exc:  # noqa: BLE001 - a proposer's on_request_finish, say
            logger.error("aborting request %s failed", request_id, exc_info=exc)
            self._fail_all(ENGINE_ERROR_MESSAGE)

    def _release(self) -> None:
        with self._pending_lock:
            self._pending -= 1

    def _publish(self) -> None:
        """Send each request its new text (and the end, when it finished); record metrics."""
        now = time.perf_counter()
        done = []
        for request_id, tracked in self._tracked.items():
            request = tracked.request
            self._record_progress(tracked, request, now)
            if request.finished:
                text = request.text[tracked.emitted_chars:]
                error = ENGINE_ERROR_MESSAGE if request.finish_reason == "error" else None
                handoff = request.handoff_state if request.finish_reason == "handoff" else None
                self._release()  # before the client hears of the end: its next request may come at once
                tracked.send(Finished(text, request.num_generated, request.num_prompt_tokens,
                                      request.finish_reason, _copy(request.metrics), error, handoff,
                                      _new_logprobs(tracked, request), tracked.token_sources(text, final=True)))
                self._record_finish(tracked, request, now)
                done.append(request_id)
                continue
            visible = len(request.text) - _stop_holdback(tracked.sampling.stop)
            if visible > tracked.emitted_chars:
                text = request.text[tracked.emitted_chars:visible]
                sources = tracked.token_sources(text)
                tracked.emitted_chars = visible
                tracked.send(Delta(text, request.num_generated, _new_logprobs(tracked, request), sources))
        for request_id in done:
            del self._tracked[request_id]
        self._snapshot = self._take_snapshot()

    def _record_progress(self, tracked: _Tracked, request, now: float) -> None:
        generated = request.num_generated
        if generated == tracked.num_generated:
            return
        if tracked.num_generated == 0:
            tracked.first_token_at = now
        if self.metrics is not None:
            if tracked.num_generated == 0:
                self.metrics.first_token(now - tracked.submitted_at)
            self.metrics.tokens_generated(generated - tracked.num_generated)
            self.metrics.speculation(request.metrics, tracked.spec_seen)
        tracked.num_generated = generated
        tracked.spec_seen = _copy(request.metrics)

    def _record_finish(self, tracked: _Tracked, request, now: float) -> None:
        if self.metrics is None:
            return
        per_token = None
        if request.num_generated > 1 and tracked.first_token_at:
            per_token = (now - tracked.first_token_at) / (request.num_generated - 1)
        self.metrics.request_finished(request.finish_reason, now - tracked.submitted_at, per_token)

    def _drop_queued(self, message: str) -> None:
        """End the requests submitted but not yet added (``abort``); the other commands (an
        abort, a stop) stay queued."""
        kept = []
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._release()
                payload.send(Finished("", 0, 0, "abort", SpecMetrics(), message))
            else:
                kept.append((kind, payload))
        for command in kept:
            self._commands.put(command)

    def _fail_all(self, message: str, error: bool = True) -> None:
        """Abort every request in the engine, and tell each client (queued commands too)."""
        self._drop_queued(message)
        for request_id, tracked in self._tracked.items():
            try:
                self.engine.abort_request(request_id)
            except BaseException:  # noqa: BLE001 - the engine (or a plugin) is already broken
                logger.exception("abort_request(%s) failed", request_id)
        error_message = message if error else None
        for request_id, tracked in list(self._tracked.items()):
            request = tracked.request
            if error:
                request.finish_reason = "error"
            self._release()
            if not tracked.told_end:
                tracked.send(Finished(request.text[tracked.emitted_chars:], request.num_generated,
                                      request.num_prompt_tokens, request.finish_reason or "abort",
                                      _copy(request.metrics), error_message))
            self._record_finish(tracked, request, time.perf_counter())
            del self._tracked[request_id]
        self._snapshot = self._take_snapshot()

    def _take_snapshot(self, running: bool = True) -> LoopSnapshot:
        return LoopSnapshot(
            num_kv_blocks=self.engine.num_kv_blocks,
            num_free_kv_blocks=self.engine.num_free_kv_blocks,
            num_requests=len(self._tracked),
            num_pending=self._pending,
            max_pending=self.max_pending,
            running=running,
        )


def _new_logprobs(tracked: _Tracked, request) -> tuple:
    """The request's logprob entries not sent yet (none when it did not ask for them)."""
    entries = getattr(request, "logprobs", None)  # an engine's Request has them; a stand-in may not
    if not entries:
        return ()
    new = tuple(entries[tracked.emitted_logprobs:])
    tracked.emitted_logprobs = len(entries)
    return new


def _error_end(tracked: _Tracked, message: str) -> Finished:
    """The end of a request that fails now, told from a thread other than the engine's (which
    may be stuck): the text not yet sent and the counts so far, finish reason ``error``."""
    request = tracked.request
    text = request.text[tracked.emitted_chars:] if request is not None else ""
    return Finished(text, tracked.num_generated, len(tracked.prompt_token_ids), "error",
                    _copy(request.metrics) if request is not None else SpecMetrics(), message)


def _stop_holdback(stops: Sequence[str]) -> int:
    """How many trailing characters to hold back: a stop string may be starting there, and the
    engine trims the text back to where the stop string begins once it is complete."""
    return max((len(s) for s in stops), default=1) - 1


def _one_line(exc: BaseException) -> str:
    message = " ".join(str(exc).split())
    return message if isinstance(exc, SpecdecError) else f"{type(exc).__name__}: {message}"


def _copy(metrics: SpecMetrics) -> SpecMetrics:
    return attrs.evolve(metrics, accepted_per_position=list(metrics.accepted_per_position))
