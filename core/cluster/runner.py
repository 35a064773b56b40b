"""The executing side: run the jobs other instances send here, and stream their events back.

:class:`JobRunner` takes jobs from this instance's list in Redis, runs each on the local engine
loop and writes its events to the request's stream (:class:`EventWriter`). While a job runs, a
watcher renews the request's claim every second and aborts the job when its origin gave up on
this attempt (``cancel`` key) or died (the client is gone with it).

A ``prefill`` job runs the prompt and first token only; the request then moves with its KV
blocks to the decode instance the job names (:mod:`.transfer`), which continues the same event
stream (:meth:`JobRunner.accept_handoff`). A hand-off that fails tells the origin ``busy``:
nothing has reached the client yet, so the origin dispatches the request again.

A job's options (:class:`~.messages.Options`) apply where its tokens are generated: its tenant
goes to the engine with it, and its grammar is compiled here (off the engine thread, within
the compiler's time bound, the claim renewed meanwhile) into the row processors that mask its
logits, on the prefill instance (which samples the first token) and on the decode instance,
whose fresh matcher first consumes the tokens generated before the hand-off, so that it
continues where the prefill instance's left off.

A job runs once: the runner takes its run id with ``SET NX`` first, and drops a job whose run
id was taken already (a dispatch retried after its reply was lost, or a replayed job), which
would otherwise write a second run into the first one's event stream. With a cluster secret,
a job that is not signed with it is dropped too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from ..errors import RequestError
from ..server.engine_loop import (Admitted, EngineLoop, EngineStopped, Finished, QueueFull, Rejected,
                                  RequestRejected, RequestStream)
from ..server.structured import Grammar, Structured
from ..structured.grammar import GrammarCompiler
from .messages import Job, Options, busy_event, encode_event, sampling_from_dict
from .redis_link import RedisLink, RedisUnavailable
from .registry import ClusterView
from .records import BadRecord
from .transfer import TransferError, send_handoff

logger = logging.getLogger("specdec.cluster")

#: Seconds a claim lives without renewal.
CLAIM_TTL_S = 10
#: Seconds between two renewals of a running job's claim (and checks of its origin).
WATCH_S = 1.0


class EventWriter:
    """Writes one attempt's events to the request's stream, numbering them from ``seq``."""

    def __init__(self, link: RedisLink, request_id: str, attempt: int, seq: int = 0):
        self.link = link
        self.key = link.keys.events(request_id)
        self.attempt = attempt
        self.seq = seq

    async def write(self, event) -> None:
        await self._add(encode_event(event, self.attempt, self.seq))

    async def busy(self, message: str, instance: str) -> None:
        await self._add(busy_event(self.attempt, self.seq, message, instance))

    async def _add(self, fields: dict) -> None:
        async def add():
            async with self.link.client.pipeline(transaction=False) as pipe:
                pipe.xadd(self.key, fields)
                pipe.expire(self.key, self.link.records_ttl_s)
                await pipe.execute()

        await self.link.call(add)
        self.seq += 1


class JobRunner:
    """Runs this instance's jobs (see the module docstring).

    :param instance_id: this instance.
    :param view: the cluster view, to tell an origin's death and find decode instances.
    :param secret: the cluster secret (jobs and hand-offs are signed with it), or None.
    :param on_transfer: ``on_transfer(stats)`` after each hand-off sent (metrics).
    :param transfer_tls: the client SSL context hand-offs are sent with, or None.
    :param grammars: compiles the grammars of jobs (the server's, so that client requests and
        jobs share its cache and its bound on concurrent builds); None: one of its own.
    """

    def __init__(self, link: RedisLink, instance_id: str, engine_loop: EngineLoop, view: ClusterView,
                 secret: Optional[bytes] = None, on_transfer=None, transfer_tls=None,
                 grammars: Optional[GrammarCompiler] = None):
        self.link = link
        self.instance_id = instance_id
        self.engine_loop = engine_loop
        self.view = view
        self.secret = secret
        self.on_transfer = on_transfer
        self.transfer_tls = transfer_tls
        self.grammars = grammars or GrammarCompiler(engine_loop.tokenizer, engine_loop.vocab_size)
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False

    async def consume(self) -> None:
        """Take jobs from this instance's list until :meth:`stop`."""
        key = self.link.keys.jobs(self.instance_id)
        while not self._stopping:
            try:
                item = await self.link.call(lambda: self.link.client.blpop([key], timeout=1), give_up_after=5.0)
            except RedisUnavailable:
                continue
            if item is None:
                continue
            try:
                job = Job.from_json(item[1], self.secret)
            except BadRecord as problem:  # counted and logged (once per distinct record), then skipped
                self.link.bad_records.report("job", key, item[1], problem)
                continue
            self._spawn(self._run(job))

    def stop(self) -> None:
        self._stopping = True

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- running a job -------------------------------------------------------------------

    async def _run(self, job: Job) -> None:
        writer = EventWriter(self.link, job.request_id, job.attempt)
        try:
            if not await self._take(job.run_id):
                logger.warning("request %s: refused a second job for run %s (a duplicate dispatch or a replay)",
                               job.request_id, job.run_id)
                return
            if await self._cancelled(job.request_id, job.attempt):
                return
            await self._claim(job.request_id, job.attempt)
            try:
                processors = await self._row_processors(job.options, job.request_id, job.attempt)
            except RequestError as exc:
                await writer.write(Rejected(str(exc), exc.param, exc.code))
                return
            try:
                sampling = sampling_from_dict(job.sampling)
                handoff = job.kind == "prefill"
                stream = self.engine_loop.submit(job.prompt, sampling, job.run_id, handoff=handoff,
                                                 capture_hidden=handoff and bool(job.decode["needs_hidden_states"]),
                                                 tenant=job.tenant, row_processors=processors,
                                                 token_sources=job.token_sources)
            except (QueueFull, EngineStopped) as exc:
                await writer.busy(f"instance {self.instance_id}: {exc}", self.instance_id)
                return
            except Exception as exc:  # noqa: BLE001 - a job the engine refuses fails alone
                await writer.write(Rejected(" ".join(str(exc).split()) or type(exc).__name__))
                return
            try:
                num_prompt_tokens = await stream.admitted()
            except RequestRejected as exc:
                await writer.write(Rejected(str(exc), exc.param, exc.code))
                return
            except EngineStopped as exc:
                await writer.busy(f"instance {self.instance_id}: {exc}", self.instance_id)
                return
            await writer.write(Admitted(num_prompt_tokens))
            await self._forward(job.request_id, job.attempt, job.origin, stream, writer, job)
        except RedisUnavailable as exc:
            logger.error("request %s: %s; dropped it", job.request_id, exc)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - one job's failure must not end the runner
            logger.exception("request %s: the job failed", job.request_id)

    async def _forward(self, request_id: str, attempt: int, origin: str, stream: RequestStream,
                       writer: EventWriter, job: Optional[Job] = None) -> None:
        """Copy ``stream``'s events to Redis until it finishes (or hands off), watching the
        origin meanwhile."""
        watcher = asyncio.ensure_future(self._watch(request_id, attempt, origin, stream))
        try:
            async for event in stream:
                if isinstance(event, Finished) and event.finish_reason == "handoff":
                    watcher.cancel()
                    await asyncio.gather(watcher, return_exceptions=True)
                    await self._hand_off(job, event, writer)
                    return
                await writer.write(event)
        except RedisUnavailable:
            stream.abort()
            raise
        finally:
            watcher.cancel()

    async def _hand_off(self, job: Job, finished: Finished, writer: EventWriter) -> None:
        decode_id = str(job.decode["instance_id"])
        decode = self.view.get(decode_id)
        try:
            # Only to a decode instance this instance sees registered: never to an address a job names.
            if decode is None or decode.role != "decode" or not decode.transfer:
                raise TransferError(f"{decode_id} is not a registered decode instance")
            stats = await send_handoff(decode.transfer, job.decode.get("ticket"), writer.seq, finished.handoff,
                                       self.secret, tls=self.transfer_tls, options=job.options)
        except TransferError as exc:
            logger.warning("request %s: hand-off to %s failed: %s", job.request_id, decode_id, exc)
            await writer.busy(f"hand-off to decode instance {decode_id} failed: {exc}", decode_id)
            return
        if self.on_transfer is not None:
            self.on_transfer(stats)

    # -- the decode side of a hand-off ---------------------------------------------------

    async def accept_handoff(self, meta: dict, state) -> Optional[str]:
        """:class:`~specdec.cluster.transfer.TransferServer`'s handler: run the handed-off
        request here and stream its events on; None when it runs, else why not. ``meta``
        comes from the redeemed ticket (the request's id, attempt and origin) and the sender
        (the next event number, the job's options)."""
        request_id, attempt = str(meta["request_id"]), int(meta["attempt"])
        options: Options = meta["options"]
        try:
            if options.grammar is not None:
                await self._claim(request_id, attempt)
            processors = await self._row_processors(options, request_id, attempt, emitted=state.output_token_ids)
        except RequestError as exc:
            return f"instance {self.instance_id}: {exc}"
        try:
            stream = self.engine_loop.submit_imported(state, f"{request_id}.{attempt}", tenant=options.tenant,
                                                      row_processors=processors, token_sources=options.token_sources)
        except (QueueFull, EngineStopped) as exc:
            return f"instance {self.instance_id}: {exc}"
        try:
            await stream.admitted()  # the origin has the prefill instance's Admitted already
        except (RequestRejected, EngineStopped) as exc:
            return f"instance {self.instance_id}: {exc}"
        await self._claim(request_id, attempt)
        writer = EventWriter(self.link, request_id, attempt, int(meta["seq"]))
        self._spawn(self._forward_handed_off(request_id, attempt, str(meta["origin"]), stream, writer))
        return None

    async def _forward_handed_off(self, request_id, attempt, origin, stream, writer) -> None:
        try:
            await self._forward(request_id, attempt, origin, stream, writer)
        except RedisUnavailable as exc:
            logger.error("request %s: %s; dropped it", request_id, exc)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001
            logger.exception("request %s: forwarding its events failed", request_id)

    # -- grammars --------------------------------------------------------------------------

    async def _row_processors(self, options: Options, request_id: str, attempt: int, emitted=()) -> list:
        """The row processors of the job's grammar (none without one), compiled here while the
        claim is renewed; their matcher has consumed ``emitted`` (the tokens generated before a
        hand-off). Raises the compiler's RequestError (a grammar too slow to compile)."""
        if options.grammar is None:
            return []
        grammar = Grammar(options.grammar["text"], options.grammar["param"])
        build = asyncio.ensure_future(Structured(grammar).compile(self.grammars))
        try:
            while not build.done():
                await asyncio.wait({build}, timeout=WATCH_S)
                if not build.done():
                    await self.link.call(lambda: self._claim(request_id, attempt), give_up_after=WATCH_S)
        finally:
            build.cancel()  # (nothing once done) Redis gone, or this job cancelled: the build is dropped
        processors = build.result().processors()
        for processor in processors:
            processor.on_emitted(emitted)
        return processors

    # -- claims and the watcher ----------------------------------------------------------

    async def _take(self, run_id: str) -> bool:
        """Take ``run_id`` for this instance; False when someone took it before."""
        key = self.link.keys.taken(run_id)
        return bool(await self.link.call(lambda: self.link.client.set(key, self.instance_id, nx=True,
                                                                      ex=self.link.records_ttl_s)))

    async def _claim(self, request_id: str, attempt: int) -> None:
        value = f"{self.instance_id} {attempt}"
        key = self.link.keys.claim(request_id)
        await self.link.call(lambda: self.link.client.set(key, value, ex=CLAIM_TTL_S))

    async def _cancelled(self, request_id: str, attempt: int) -> bool:
        key = self.link.keys.cancel(request_id, attempt)
        return bool(await self.link.call(lambda: self.link.client.exists(key)))

    async def _watch(self, request_id: str, attempt: int, origin: str, stream: RequestStream) -> None:
        """Every second: renew the claim; abort when the origin gave up or died."""
        while not stream.finished:
            await asyncio.sleep(WATCH_S)
            try:
                await self.link.call(lambda: self._claim(request_id, attempt), give_up_after=WATCH_S)
                if await self._cancelled(request_id, attempt):
                    logger.info("request %s: its origin gave up on attempt %d; aborted", request_id, attempt)
                    stream.abort()
                    return
            except RedisUnavailable:
                continue
            if self.view.is_dead(origin):
                logger.info("request %s: its origin %s is gone; aborted", request_id, origin)
                stream.abort()
                return
