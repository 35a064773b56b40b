"""Running the server with uvicorn, as ``specdec serve`` does.

The listening socket is bound before the model loads, so a port in use is a one-line error at
once rather than after the load. SIGINT and SIGTERM stop the server gracefully (see
:class:`Server`); the process then exits with code 0. :func:`uvicorn_config` runs the app on
the h11 protocol of :mod:`~specdec.server.limits` (the request-head timeout, the send
timeout, the connection limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from typing import Iterator, Optional, Sequence

import uvicorn

from ..engine.tensor_parallel import exit_after_failure
from ..errors import SpecdecError
from .app import build_app
from .engine_loop import EngineLoop
from .generation_defaults import GenerationDefaults
from .hosts import default_allowed_hosts
from .limits import ServerLimits, limited_protocol
from .metrics import ServerMetrics
from .metrics_listener import MetricsListener
from .stats_log import StatsLogger, configure_logging
from .watchdog import DEFAULT_STEP_TIMEOUT

#: ``--max-pending-requests``: requests in flight (running or waiting) before 503.
DEFAULT_MAX_PENDING = 1024
#: ``--shutdown-timeout``: seconds requests in flight get to finish after SIGINT/SIGTERM.
DEFAULT_SHUTDOWN_TIMEOUT = 5.0


def bind_socket(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: any free port), not yet listening; errors
    name ``flag``."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise SpecdecError(f"--host: cannot resolve '{host}': {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise SpecdecError(f"{flag}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


class Server(uvicorn.Server):
    """uvicorn's server with a shutdown that ends every request cleanly.

    On SIGINT/SIGTERM it stops accepting connections and refuses new requests (503), lets the
    requests in flight run for up to ``drain_timeout`` seconds, then stops the engine loop:
    whatever still runs finishes with ``finish_reason`` ``abort`` (a stream gets its last
    chunk and ``[DONE]``), and uvicorn closes the connections.

    :param ready_line: printed to stderr once the server accepts connections.
    :param cluster: the :class:`specdec.cluster.Cluster` this server is in; it leaves the
        cluster as the shutdown begins.
    """

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, *,
                 drain_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, ready_line: Optional[str] = None, cluster=None):
        super().__init__(config)
        self.engine_loop = engine_loop
        self.cluster = cluster
        self.drain_timeout = drain_timeout
        self.ready_line = ready_line

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started and self.ready_line:
            print(self.ready_line, file=sys.stderr, flush=True)

    async def shutdown(self, sockets=None):
        for server in getattr(self, "servers", ()):
            server.close()
        self.engine_loop.refuse_new()
        if self.cluster is not None:  # the other instances stop sending requests here
            await self.cluster.leave()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        while self.engine_loop.num_pending and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.engine_loop.stop)  # aborts the rest; their streams end now
        await super().shutdown(sockets)


def uvicorn_config(app, **kwargs) -> uvicorn.Config:
    """uvicorn's config for an app of :func:`~specdec.server.app.build_app`: the h11 protocol
    with the connection limits of the app's :class:`~specdec.server.limits.ServerLimits`
    (``app.state.limits``), counting its refusals in the app's metrics. ``kwargs`` go to
    ``uvicorn.Config``."""
    metrics = app.state.engine_loop.metrics
    protocol = limited_protocol(app.state.limits, on_reject=metrics.request_rejected if metrics else None)
    return uvicorn.Config(app, http=protocol, **kwargs)


def raise_open_file_limit(max_connections: int) -> Optional[str]:
    """Raise the soft limit on open files to fit ``max_connections`` (up to the hard limit);
    return a warning when it still does not fit, else None."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Unix
        return None
    needed = max_connections + 128  # the model's files, the listening socket, the rest
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        target = soft
    if target >= needed:
        return None
    return (f"--max-connections {max_connections} needs about {needed} open files, but the limit is {target} "
            "(ulimit -n); raise it, or lower --max-connections")


@contextlib.contextmanager
def _graceful_exit() -> Iterator[None]:
    """Let uvicorn handle SIGINT/SIGTERM, and make its re-raise of the signal after a graceful
    shutdown a no-op (the default actions would kill the process, or raise KeyboardInterrupt,
    after the shutdown has already completed)."""
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_server(engine, sock: socket.socket, *, served_model_name: str, api_key: Optional[str] = None,
               max_pending: int = DEFAULT_MAX_PENDING, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
               limits: Optional[ServerLimits] = None, enable_docs: bool = False, metrics_require_key: bool = False,
               allowed_hosts: Optional[Sequence[str]] = None, log_level: str = "info",
               metrics_sock: Optional[socket.socket] = None, join_cluster=None,
               step_timeout: float = DEFAULT_STEP_TIMEOUT, hide_speculative_usage: bool = False,
               generation_defaults: Optional[GenerationDefaults] = None) -> None:
    """Serve ``engine`` on ``sock`` until SIGINT/SIGTERM; returns after a graceful shutdown.

    ``limits``, ``enable_docs``, ``metrics_require_key``, ``allowed_hosts`` and
    ``hide_speculative_usage`` are those of :func:`~specdec.server.app.build_app`;
    ``allowed_hosts`` None is the default for the address ``sock`` is bound to
    (:func:`~specdec.server.hosts.default_allowed_hosts`). ``metrics_sock``, when given, serves
    ``/metrics`` alone (:mod:`~specdec.server.metrics_listener`). ``join_cluster(engine_loop, host, port)``, when
    given, returns the :class:`specdec.cluster.Cluster` this server joins (the command line
    builds it: the cluster stands above the server). ``step_timeout`` is the engine loop's
    (0: no step watchdog). ``generation_defaults`` (``--generation-config``) are the sampling
    values of the fields a request leaves out; the ready line names them."""
    limits = limits or ServerLimits()
    configure_logging(log_level)
    warning = raise_open_file_limit(limits.max_connections)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    engine_loop = EngineLoop(engine, max_pending=max_pending, metrics=ServerMetrics(served_model_name),
                             step_timeout=step_timeout or None)
    host, port = sock.getsockname()[:2]
    cluster = None if join_cluster is None else join_cluster(engine_loop, host, port)

    def engine_lost(message: str) -> None:  # a tensor-parallel rank died or hung: fail, then exit
        engine_loop.engine_lost(message)
        exit_after_failure(message)

    engine.set_fatal_handler(engine_lost)
    if allowed_hosts is None:
        allowed_hosts = default_allowed_hosts(host)
    app = build_app(engine_loop, served_model_name=served_model_name, api_key=api_key, limits=limits,
                    enable_docs=enable_docs, metrics_require_key=metrics_require_key, allowed_hosts=allowed_hosts,
                    cluster=cluster, hide_speculative_usage=hide_speculative_usage,
                    generation_defaults=generation_defaults)
    # uvicorn's own timeout is the last resort: by then the engine loop has ended every request.
    config = uvicorn_config(app, log_level=log_level, timeout_graceful_shutdown=5.0)
    shown = f"[{host}]" if ":" in host else host
    ready = (f"specdec serve: listening on http://{shown}:{port} (model '{served_model_name}', "
             f"max_num_seqs {engine.config.max_num_seqs}, method {engine.spec.method}"
             f"{', API key required' if api_key else ''}"
             f"{f', cluster role {cluster.options.role}' if cluster else ''}; "
             f"{(generation_defaults or GenerationDefaults()).describe()})")
    server = Server(config, engine_loop, drain_timeout=shutdown_timeout, ready_line=ready, cluster=cluster)
    listener = None if metrics_sock is None else MetricsListener(
        metrics_sock, engine_loop.metrics, api_key=api_key if metrics_require_key else None)
    stats = StatsLogger(engine_loop.metrics, engine_loop.snapshot)
    try:
        with _graceful_exit():
            server.run(sockets=[sock])
    finally:
        stats.close()
        if listener is not None:
            listener.close()
    if not server.started:
        raise SpecdecError("the server did not start (see the log above)")
