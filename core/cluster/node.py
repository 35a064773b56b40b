"""One instance's membership of the cluster: :class:`Cluster`, which the server starts with
``specdec serve --scheduler redis://HOST:PORT/DB --role mixed|prefill|decode`` (or FastDeploy's
``--scheduler-name splitwise --scheduler-host HOST ...``, see :mod:`specdec.cluster.flags`).

It runs three things on the server's event loop: the heartbeat (register this instance, read
the others, notice a Redis restart), the job runner (:mod:`.runner`) and, on a decode
instance, the KV transfer listener (:mod:`.transfer`). The HTTP handlers call :meth:`submit`
instead of the engine loop's own: it routes the request (:mod:`.router`) and returns the local
stream or a :class:`~specdec.cluster.remote.RemoteRequestStream`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Optional

import attrs
from prometheus_client import Counter, Gauge

from ..errors import SpecdecError
from ..server.engine_loop import EngineLoop, EngineStopped, RequestRejected, RequestStream
from ..structured.grammar import GrammarCompiler
from .messages import MAX_GRAMMAR_BYTES, Options, grammar_bytes
from .records import REASONS
from .redis_link import RedisLink, RedisUnavailable, SchedulerConfig
from .registry import HEARTBEAT_S, ROLES, ClusterView, InstanceInfo, deregister, read_instances, register
from .remote import RemoteRequestStream
from .router import NoRoute, Route, Router
from .runner import JobRunner
from .transfer import TicketBook, TransferServer, TransferStats, TransferTLS

logger = logging.getLogger("specdec.cluster")


@attrs.define(kw_only=True)
class ClusterOptions:
    """The serve flags of a cluster instance.

    :ivar scheduler: where the cluster's Redis is (``--scheduler`` and the ``--scheduler-*`` flags).
    :ivar role: ``--role``: ``mixed``, ``prefill`` or ``decode``.
    :ivar instance_id: ``--instance-id`` (default ``ADVERTISE_HOST:PORT``).
    :ivar advertise_host: ``--advertise-host``: how the other instances reach this one
        (default: ``--host``, or this machine's address when that is a wildcard).
    :ivar kv_transfer_port: ``--kv-transfer-port`` of a decode instance (0: any free port).
    :ivar api_key: the server's API key (what clients hold; the instances prove themselves to
        each other with the cluster secret instead).
    :ivar cluster_secret: the secret the instances share (:mod:`.secret`), or None (allowed
        only for ``mixed`` instances and on loopback).
    :ivar transfer_tls: TLS on the KV transfer channel (``--kv-transfer-tls-*``), or None.
    """

    scheduler: SchedulerConfig
    role: str = "mixed"
    instance_id: Optional[str] = None
    advertise_host: Optional[str] = None
    kv_transfer_port: int = 0
    api_key: Optional[str] = None
    cluster_secret: Optional[bytes] = attrs.field(default=None, repr=False)
    transfer_tls: Optional[TransferTLS] = None

    def __attrs_post_init__(self):
        if self.role not in ROLES:
            raise SpecdecError(f"--role: must be one of {', '.join(ROLES)}, got '{self.role}'")
        if not 0 <= self.kv_transfer_port <= 65535:
            raise SpecdecError(f"--kv-transfer-port: must be between 0 and 65535, got {self.kv_transfer_port}")


class Cluster:
    """This instance in the cluster (see the module docstring).

    :param engine_loop: the local engine loop (its engine must be a single-process one for
        ``prefill`` and ``decode`` roles).
    :param served_model_name: requests go only to instances that serve the same name.
    :param http_host, http_port: where this instance's server listens.
    :param metrics: the server's :class:`~specdec.server.metrics.ServerMetrics` (the cluster
        adds its own metrics to its registry), or None.
    """

    def __init__(self, options: ClusterOptions, engine_loop: EngineLoop, served_model_name: str, *,
                 http_host: str, http_port: int, metrics=None):
        self.options = options
        self.http_host, self.http_port = http_host, http_port
        self.engine_loop = engine_loop
        self.model_name = served_model_name
        engine = engine_loop.engine
        if options.role != "mixed" and engine.config.tensor_parallel_size > 1:
            raise SpecdecError(f"--role {options.role}: prefill/decode disaggregation does not work with "
                               "--tensor-parallel-size > 1 yet; use --role mixed")
        self.link = RedisLink(options.scheduler)
        self.view = ClusterView(self.link)
        self.me: Optional[InstanceInfo] = None
        self.router: Optional[Router] = None
        self.runner: Optional[JobRunner] = None
        #: Compiles the grammars of the jobs this instance runs; ``build_app`` sets the app's
        #: (one cache and one bound on concurrent builds for clients' requests and jobs).
        self.grammar_compiler: Optional[GrammarCompiler] = None
        self.transfer: Optional[TransferServer] = None
        self._tasks: list[asyncio.Task] = []
        self._metrics(metrics)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Join the cluster: reach Redis (a one-line error when it does not answer within
        10 s), listen for hand-offs (decode role), register, start the heartbeat and runner."""
        options, engine = self.options, self.engine_loop.engine
        http_host, http_port = self.http_host, self.http_port
        host = options.advertise_host or _advertised(http_host)
        instance_id = options.instance_id or f"{host}:{http_port}"
        try:
            await self.link.call(self.link.check_run_id, give_up_after=10.0)
        except RedisUnavailable as exc:
            raise SpecdecError(f"--scheduler: {exc}") from None
        server_tls, client_tls = options.transfer_tls.contexts() if options.transfer_tls else (None, None)
        transfer = ""
        if options.role == "decode":
            self.transfer = TransferServer(http_host, options.kv_transfer_port, self._accept_handoff,
                                           _handoff_byte_cap(engine), TicketBook(instance_id, options.cluster_secret),
                                           tls=server_tls)
            try:
                _, port = await self.transfer.start()
            except OSError as exc:
                raise SpecdecError(f"--kv-transfer-port: cannot listen on {http_host}:{options.kv_transfer_port}: "
                                   f"{exc.strerror or exc}") from None
            transfer = f"{host}:{port}"
        self.me = InstanceInfo(instance_id=instance_id, role=options.role, model=self.model_name,
                               url=f"http://{host}:{http_port}", transfer=transfer,
                               kv_layout=engine.kv_layout.to_dict(), needs_hidden_states=engine.needs_hidden_states,
                               method=engine.spec.method, pid=os.getpid(), started_at=time.time())
        self.router = Router(self.me)
        self.runner = JobRunner(self.link, instance_id, self.engine_loop, self.view, options.cluster_secret,
                                on_transfer=self._transferred, transfer_tls=client_tls,
                                grammars=self.grammar_compiler)
        await self._heartbeat_once()
        self._tasks = [asyncio.ensure_future(self._heartbeat()), asyncio.ensure_future(self.runner.consume())]
        logger.info("joined the cluster at %s as %s (%s)", options.scheduler.shown, instance_id, options.role)

    async def leave(self) -> None:
        """Stop taking work from the cluster, as a graceful shutdown begins: no more jobs, no
        heartbeat, the registration deleted (the others stop routing here at once). What
        runs goes on; :meth:`stop` ends it. Idempotent."""
        if self.runner is not None:
            self.runner.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.me is not None:
            try:
                await deregister(self.link, self.me.instance_id)
            except RedisUnavailable:
                pass

    async def stop(self) -> None:
        """Leave the cluster (:meth:`leave`), then end what still runs for others and close
        the transfer listener and the Redis connection."""
        await self.leave()
        if self.transfer is not None:
            await self.transfer.close()
        if self.runner is not None:
            await self.runner.cancel_all()
        await self.link.close()

    def status(self) -> dict:
        """This instance's part of ``/health``."""
        return {"instance_id": self.me.instance_id if self.me else None, "role": self.options.role,
                "redis": "down" if self.link.is_down else "ok", "instances": len(self.view.instances)}

    # -- requests ------------------------------------------------------------------------

    def submit(self, prompt_ids, sampling, request_id: str, streaming: bool = True, *, tenant: Optional[str] = None,
               grammar=None, token_sources: bool = False) -> RequestStream:
        """Route a request (from the event loop): the local engine loop's stream, or a remote
        one (``streaming``: whether the client reads the text as it comes). Raises the engine
        loop's ``QueueFull``/``EngineStopped`` for a local run, ``EngineStopped`` when no
        instance can run it, and ``RequestRejected`` for a grammar larger than a job carries
        (whatever the route, so that a request is refused or not whichever instance is idle).

        ``tenant`` and ``token_sources`` as for the engine loop's ``submit``; ``grammar``: the
        request's compiled grammar (:class:`~specdec.server.structured.CompiledGrammar`: its row
        processors run here, its text goes with a remote job, whose instance compiles it again),
        or None."""
        spec = grammar.spec() if grammar is not None else None
        if spec is not None and grammar_bytes(spec["text"]) > MAX_GRAMMAR_BYTES:
            raise RequestRejected(f"{spec['param']}: its grammar is {grammar_bytes(spec['text'])} bytes, more than "
                                  f"a cluster's job carries ({MAX_GRAMMAR_BYTES})", spec["param"], "invalid_value")
        try:
            route = self.router.choose(self.view.live(), redis_down=self.link.is_down,
                                       local_pending=self.engine_loop.num_pending)
        except NoRoute as exc:
            raise EngineStopped(str(exc)) from None
        self._routed.labels(self.model_name, route.kind).inc()
        if route.kind == "local":
            return self.engine_loop.submit(prompt_ids, sampling, request_id, tenant=tenant,
                                           row_processors=grammar.processors() if grammar else (),
                                           token_sources=token_sources)
        options = Options(tenant=tenant, grammar=spec, token_sources=token_sources)
        return RemoteRequestStream(request_id, self.link, self.view, self.me.instance_id, route, prompt_ids,
                                   sampling, self._route_again, streaming=streaming,
                                   secret=self.options.cluster_secret, options=options)

    def _route_again(self, exclude: frozenset) -> Route:
        route = self.router.choose(self.view.live(), exclude, local_pending=self.engine_loop.num_pending)
        if route.kind == "local":  # through our own job list: a remote stream cannot turn local
            route = Route("run", self.me)
        self._routed.labels(self.model_name, "rerun").inc()
        return route

    async def _accept_handoff(self, meta: dict, state) -> Optional[str]:
        error = await self.runner.accept_handoff(meta, state)
        if error is None:
            self._transfers.labels(self.model_name, "received").inc()
            self._transfer_bytes.labels(self.model_name, "received").inc(state.nbytes)
        return error

    # -- the heartbeat -------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._heartbeat_once()
            except RedisUnavailable:
                continue
            except Exception:  # noqa: BLE001 - the heartbeat must outlive any one failure
                logger.exception("cluster heartbeat failed")

    async def _heartbeat_once(self) -> None:
        snapshot = self.engine_loop.snapshot()
        self.me.num_pending = snapshot.num_pending
        self.me.max_pending = snapshot.max_pending
        self.me.num_free_kv_blocks = snapshot.num_free_kv_blocks
        self.me.num_kv_blocks = snapshot.num_kv_blocks
        await self.link.check_run_id()
        await register(self.link, self.me, self.options.cluster_secret)
        others = [i for i in await read_instances(self.link, self.options.cluster_secret)
                  if i.instance_id != self.me.instance_id]
        self.view.update([self.me, *others])  # this instance as it is, whatever Redis holds under its name
        self.router.view_updated()

    # -- metrics -------------------------------------------------------------------------

    def _metrics(self, metrics) -> None:
        registry = metrics.registry if metrics is not None else None
        labels = ["model_name"]
        self._routed = Counter("specdec_cluster_requests_routed", "Requests this instance routed, by route "
                               "(local, run: whole on another instance, pd: prefill/decode, rerun: a lost "
                               "request run again).", labels + ["route"], registry=registry)
        self._transfers = Counter("specdec_kv_transfers", "KV hand-offs, by direction (sent, received).",
                                  labels + ["direction"], registry=registry)
        self._transfer_bytes = Counter("specdec_kv_transfer_bytes", "Bytes of KV (and hidden states) handed off.",
                                       labels + ["direction"], registry=registry)
        self._transfer_seconds = Counter("specdec_kv_transfer_seconds", "Seconds spent sending hand-offs "
                                         "(connect to answer).", labels, registry=registry)
        instances = Gauge("specdec_cluster_instances", "Instances registered at the last heartbeat.", labels,
                          registry=registry)
        instances.labels(self.model_name).set_function(lambda: len(self.view.instances))
        reconnects = Gauge("specdec_cluster_redis_reconnects", "Times Redis came back after being unreachable.",
                           labels, registry=registry)
        reconnects.labels(self.model_name).set_function(lambda: self.link.reconnects)
        bad_records = Counter("specdec_cluster_bad_records", "Records read from Redis and skipped (each distinct one "
                              "once), by kind (registration, job) and reason (malformed, signature, field, expiry).",
                              labels + ["kind", "reason"], registry=registry)
        for reason in REASONS:  # present from the start, so that a scrape shows 0 rather than nothing
            bad_records.labels(self.model_name, "registration", reason)
        self.link.bad_records.on_count = lambda kind, reason: bad_records.labels(self.model_name, kind, reason).inc()

    def _transferred(self, stats: TransferStats) -> None:
        self._transfers.labels(self.model_name, "sent").inc()
        self._transfer_bytes.labels(self.model_name, "sent").inc(stats.num_bytes)
        self._transfer_seconds.labels(self.model_name).inc(stats.seconds)


def _handoff_byte_cap(engine):
    """``byte_cap(num_positions)`` for the transfer listener: the bytes a hand-off of that many
    positions carries at most (its KV blocks and float32 hidden states); 0 beyond the model's
    length or the pool's size, which refuses it before its body is read."""
    bytes_per_block = engine.attention.bytes_per_block(engine.block_size)
    hidden_bytes = engine.hidden_width * 4

    def byte_cap(num_positions: int) -> int:
        blocks = -(-num_positions // engine.block_size)
        if not 0 < num_positions <= engine.max_model_len or blocks > engine.num_kv_blocks:
            return 0
        return blocks * bytes_per_block + num_positions * hidden_bytes

    return byte_cap


def _advertised(host: str) -> str:
    """The address other instances use for this one, when ``--advertise-host`` is not given."""
    if host in ("", "0.0.0.0", "::"):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return socket.gethostname()
    return host
