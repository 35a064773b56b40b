"""One engine over ``tensor_parallel_size`` ranks: rank 0 is the engine, the others follow it.

Rank 0 (the process that built the :class:`~specdec.engine.Engine`, and the server when there
is one) runs the scheduler, the proposer, verification and accept policies, exactly as with
one rank. Its model is a :class:`TensorParallelModel`: before each forward pass it broadcasts
the step's packed inputs (token ids, attention metadata, which rows need logits), and every
rank runs its slice of the decoder on them, meeting at the all-reduces and the final
all-gather of the logits (:mod:`specdec.model.tensor_parallel`). The other ranks run
:func:`worker_loop` and nothing else.

Launch. On one machine the engine starts the other ranks itself (:func:`start_local_workers`:
one process each, with paddle.distributed's environment for that rank, the same variables
``paddle.distributed.spawn`` sets), then joins the process group as rank 0. Across machines,
``python -m paddle.distributed.launch`` starts every rank with that environment already set;
the engine sees it (:func:`launched_rank`) and rank 0 runs the command while the others run
:func:`worker_loop` (docs/deployment.md).

Trust. Rank 0 starts the group's rendezvous store itself (:mod:`.rendezvous_store`), on the
address the ranks are given (loopback on one machine), from a socket it binds first and keeps
bound; the store listens only until every rank has connected; local ranks' gloo (or NCCL) sockets use the
loopback interface. Steps travel as fixed-layout int64 tensors (:mod:`.tensor_parallel_messages`),
checked before use: a rank never unpickles what it receives.

Waiting. A rank waiting inside a collective gives up after 30 s under gloo. So every rank
loads its model before it joins the process group (the join itself waits as long as loading
takes), and idle rank 0 pings the others every ``KEEPALIVE_INTERVAL`` seconds.

Failure. A :class:`Watchdog` thread on rank 0 checks the local workers every
``WATCHDOG_INTERVAL`` seconds, and any rank's step against ``config.tensor_parallel_timeout``
(a collective that waits on a dead or hung rank blocks inside paddle and cannot be
interrupted); a collective that raises (gloo does when a peer's connection drops) is a
failure too. Then it calls the engine's fatal handler, which fails the requests in flight with
the reason, and the process exits: a tensor-parallel engine that lost a rank cannot recover
its KV cache, so it does not try.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import socket
import sys
import threading
import time
from typing import Callable, NamedTuple, Optional

from .rendezvous_store import StoreProcess, connect_as_client
from .tensor_parallel_messages import (HEADER_SIZE, Forward, InitCache, Limits, Message, MessageError, Ping, Stop,
                                       decode, encode, payload_length)

logger = logging.getLogger("specdec.engine")

#: Seconds between two checks of the workers and of the running step.
WATCHDOG_INTERVAL = 0.2
#: Seconds of silence after which idle rank 0 pings the others (gloo times out after 30).
KEEPALIVE_INTERVAL = 5.0
#: Environment variables paddle.distributed reads to join a process group.
RANK_ENV = ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ENDPOINTS", "PADDLE_CURRENT_ENDPOINT",
            "PADDLE_MASTER", "PADDLE_DISTRI_BACKEND")


def launched_rank() -> Optional[tuple[int, int]]:
    """``(rank, world_size)`` when ``paddle.distributed.launch`` started this process, else None."""
    if "PADDLE_TRAINER_ID" not in os.environ or "PADDLE_TRAINERS_NUM" not in os.environ:
        return None
    return int(os.environ["PADDLE_TRAINER_ID"]), int(os.environ["PADDLE_TRAINERS_NUM"])


def loopback_interface() -> str:
    """The name of this machine's loopback interface (``lo`` on Linux)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in ("lo", "lo0") if name in names), "lo")


def rank_environments(world_size: int, backend: str, store_endpoint: str) -> list[dict]:
    """paddle.distributed's environment for each rank of a group on this machine, whose
    rendezvous store serves at ``store_endpoint`` (a :class:`StoreProcess` on loopback).
    gloo and NCCL open their sockets on the loopback interface: nothing listens beyond it.
    (paddle reads only the first trainer endpoint, as the store's address, when it joins.)"""
    interface = loopback_interface()
    return [{"PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(world_size),
             "PADDLE_TRAINER_ENDPOINTS": ",".join([store_endpoint] * world_size),
             "PADDLE_CURRENT_ENDPOINT": store_endpoint, "PADDLE_MASTER": store_endpoint,
             "PADDLE_DISTRI_BACKEND": backend, "FLAGS_selected_gpus": str(rank),
             "GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}
            for rank in range(world_size)]


def master_endpoint() -> tuple[str, int]:
    """``(host, port)`` of the store this process's environment names (what paddle reads:
    ``PADDLE_MASTER``, else the first of ``PADDLE_TRAINER_ENDPOINTS``)."""
    endpoint = os.environ.get("PADDLE_MASTER") or os.environ["PADDLE_TRAINER_ENDPOINTS"].split(",")[0]
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


@contextlib.contextmanager
def _environment(environment: Optional[dict]):
    """``environment`` set only inside the block: processes this one starts later must not
    inherit a rank's variables (they would take themselves for that rank)."""
    saved = {name: os.environ.get(name) for name in (environment or {})}
    os.environ.update(environment or {})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def use_rank_device(paddle, environment: Optional[dict] = None) -> None:
    """On GPUs, make this rank's GPU the default device (before anything is allocated):
    ``FLAGS_selected_gpus``, which launch sets per machine (the global rank would name a GPU
    another machine has)."""
    with _environment(environment):
        if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
            local = os.environ.get("FLAGS_selected_gpus") or os.environ.get("PADDLE_LOCAL_RANK") or "0"
            paddle.set_device(f"gpu:{int(local.split(',')[0])}")


def init_process_group(paddle, environment: Optional[dict] = None) -> None:
    """Join the process group that ``environment`` (else this process's environment)
    describes, as a client of its rendezvous store (:class:`StoreProcess`, which rank 0
    starts). Every rank joins only once its model is built: the rendezvous waits as long as
    loading takes, while a rank waiting inside a collective gives up after 30 s (gloo)."""
    with _environment(environment):
        connect_as_client(paddle)
        paddle.distributed.init_parallel_env()


def start_local_workers(config, world_size: int, backend: str, store_endpoint: str) -> tuple[list, dict]:
    """Start ranks ``1 .. world_size - 1`` on this machine, meeting at the store at
    ``store_endpoint``; returns the worker processes (daemons: they end with this process)
    and rank 0's environment, for :func:`init_process_group`."""
    environments = rank_environments(world_size, backend, store_endpoint)
    context = multiprocessing.get_context("spawn")
    workers = []
    for rank in range(1, world_size):
        process = context.Process(target=_worker_main, args=(config, environments[rank]), daemon=True,
                                  name=f"specdec-tp-rank{rank}")
        process.start()
        workers.append(process)
    return workers, environments[0]


def _worker_main(config, environment: dict) -> None:
    os.environ.update(environment)
    os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")
    from ..errors import SpecdecError

    try:
        worker_loop(config)
    except KeyboardInterrupt:
        pass
    except MessageError as exc:  # only this rank saw it: say why it ends
        print(f"error: tensor-parallel rank {environment['PADDLE_TRAINER_ID']}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except SpecdecError:  # a bad configuration: rank 0 meets the same error and reports it
        sys.exit(2)


class RankZero(NamedTuple):
    """What the engine holds as rank 0: ``tensor_parallel`` as :func:`~specdec.engine.build.build_model`
    takes it (its group, rank 0, the world size), the :class:`Watchdog`, rank 0's environment
    (for :func:`init_process_group` once the model is built), the local workers it started
    and the rendezvous store it serves."""

    tensor_parallel: tuple
    watchdog: "Watchdog"
    environment: Optional[dict]
    workers: list
    store: Optional[StoreProcess] = None


def start_rank_zero(config, on_fatal: Callable[[str], None]) -> RankZero:
    """Become rank 0 of the tensor-parallel group: start the other ranks on this machine
    (unless ``paddle.distributed.launch`` started them) and watch them; a rank that dies while
    loading ends this process with the reason (``on_fatal``) instead of leaving it waiting at
    the rendezvous. The group is joined once the model is built."""
    from ..errors import SpecdecError, require_paddle
    from ..model.tensor_parallel import CollectiveGroup
    from .build import on_gpu

    paddle = require_paddle()
    world_size = config.tensor_parallel_size
    launched = launched_rank()
    workers, environment = [], None
    if launched is None:
        # Port 0: the OS picks one, and the bound socket keeps it (no pick-then-bind race).
        store = StoreProcess("127.0.0.1", clients=world_size)
        workers, environment = start_local_workers(config, world_size, "nccl" if on_gpu() else "gloo",
                                                   store.endpoint)
    elif launched[1] != world_size:
        raise SpecdecError(f"tensor_parallel_size: {world_size}, but paddle.distributed.launch "
                           f"started {launched[1]} ranks")
    else:  # at the address and port the launchers agreed on (host 0's)
        store = StoreProcess(*master_endpoint(), clients=world_size)
    watchdog = Watchdog(workers, config.tensor_parallel_timeout, on_fatal)
    use_rank_device(paddle, environment)
    return RankZero((CollectiveGroup(paddle, 0, world_size), 0, world_size), watchdog, environment, workers, store)


def worker_loop(config) -> None:
    """A rank other than 0: build this rank's slice of the model and attention cache, then
    run every step rank 0 broadcasts, until it says stop (or goes away)."""
    from ..errors import require_paddle
    from ..model.tensor_parallel import CollectiveGroup
    from ..plugin_manager import get_plugins
    from specdec.kernels.cpu import release_free_heap

    from .build import build_model

    paddle = require_paddle()
    rank, world_size = launched_rank()
    use_rank_device(paddle)
    group = CollectiveGroup(paddle, rank, world_size)
    built = build_model(config, get_plugins(), progress=False, tensor_parallel=(group, rank, world_size))
    release_free_heap()  # the loader's temporaries, freed by now
    init_process_group(paddle)
    model = built.model
    limits = Limits(vocab_size=built.model_config.vocab_size, max_positions=model.max_positions)
    while True:
        message = receive_message(group, limits)
        if isinstance(message, Stop):
            return
        if isinstance(message, Ping):  # rank 0 is idle; see TensorParallelModel._keep_alive
            continue
        if isinstance(message, InitCache):
            built.attention.init_cache(message.num_blocks, message.block_size)
            limits = Limits(limits.vocab_size, limits.max_positions, message.num_blocks, message.block_size)
        elif isinstance(message, Forward):
            model.forward(message.token_ids, message.meta(), message.logit_rows)


def send_message(group, message: Message) -> None:
    """Broadcast ``message`` from rank 0: its header, then its payload if it has one."""
    header, payload = encode(message)
    group.broadcast_int64(header)
    if payload is not None and len(payload):
        group.broadcast_int64(payload)


def receive_message(group, limits: Limits) -> Message:
    """The next message rank 0 broadcasts, checked against ``limits`` before its payload is
    received (:class:`MessageError` for one that is not a valid message)."""
    header = group.broadcast_int64(length=HEADER_SIZE)
    length = payload_length(header, limits)
    payload = group.broadcast_int64(length=length) if length else None
    return decode(header, payload, limits)


class TensorParallelModel:
    """Rank 0's model: its slice of the decoder (a :class:`~specdec.model.llama.LlamaModel`
    holding :class:`~specdec.model.tensor_parallel.TensorParallelWeights`) behind the
    ``LlamaModel`` interface the engine and proposers use.

    :meth:`forward` first broadcasts the step to the other ranks. What a model-based proposer
    reads (``embed``, ``lm_head_weight``, ``embed_tokens``, ``logits_of_hidden``) is computed on
    rank 0 alone from whole copies of the embedding and LM head it keeps for that: MTP runs on
    rank 0, unsplit, and never enters a collective the workers are not in.
    """

    def __init__(self, local_model, group, embedding, lm_head, watchdog: "Watchdog"):
        self.local = local_model
        self.group = group
        self.paddle = local_model.paddle
        self.config = local_model.config
        self.attention = local_model.attention
        self.max_positions = local_model.max_positions
        self.quantization = local_model.quantization
        self.weights = local_model.weights
        self._embedding = self.paddle.to_tensor(embedding)
        self._lm_head = self._embedding if lm_head is embedding else self.paddle.to_tensor(lm_head)
        self.watchdog = watchdog
        # One message at a time: the engine thread's steps and the keep-alive thread's pings.
        self._lock = threading.Lock()
        self._last_message = time.monotonic()
        threading.Thread(target=self._keep_alive, name="specdec-tp-keepalive", daemon=True).start()

    def _send(self, message: Message) -> None:
        """Broadcast ``message`` to the other ranks (holding ``_lock``)."""
        send_message(self.group, message)
        self._last_message = time.monotonic()

    def _keep_alive(self) -> None:
        """While rank 0 is idle the workers wait inside a collective, which gloo gives up on
        after 30 s: a ping every :data:`KEEPALIVE_INTERVAL` seconds keeps them waiting."""
        while self.watchdog.failure is None:
            time.sleep(KEEPALIVE_INTERVAL / 5)
            if time.monotonic() - self._last_message < KEEPALIVE_INTERVAL:
                continue
            with self._lock, self.watchdog.step():
                if self.watchdog.failure is not None:
                    return
                try:
                    self._send(Ping())
                except Exception as exc:  # noqa: BLE001 - a rank is gone
                    self.watchdog.collective_failed(exc)
                    return

    def init_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate every rank's cache (rank 0's through the engine, the others' by message)."""
        with self._lock, self.watchdog.step():
            self._send(InitCache(num_blocks, block_size))

    def forward(self, token_ids, meta, logit_rows, return_hidden: bool = False, device_logits: bool = False,
                hidden_layers=None):
        with self._lock, self.watchdog.step():
            try:
                self._send(Forward.of(token_ids, meta, logit_rows))
                return self.local.forward(token_ids, meta, logit_rows, return_hidden=return_hidden,
                                          device_logits=device_logits, hidden_layers=hidden_layers)
            except Exception as exc:  # noqa: BLE001 - a collective failed: the group is broken for good
                self.watchdog.collective_failed(exc)
                raise

    def stop_workers(self) -> None:
        """Tell the other ranks to end (they exit on their own); the watchdog stops first, so
        that their exit is not taken for a failure."""
        self.watchdog.stop()
        with self._lock:
            try:
                self._send(Stop())
            except Exception:  # noqa: BLE001 - a worker that is already gone
                pass

    # -- what proposers read, from rank 0's whole copies ------------------------------------------

    @property
    def embed(self):
        return self._embedding

    @property
    def final_norm(self):
        return self.local.final_norm

    @property
    def lm_head_weight(self):
        return self._lm_head

    def embed_tokens(self, token_ids):
        p = self.paddle
        ids = token_ids if isinstance(token_ids, p.Tensor) else p.to_tensor(token_ids, dtype="int64")
        with p.no_grad():
            return p.gather(self._embedding, ids.reshape([-1]).astype("int64"))

    def logits_of_hidden(self, hidden_states):
        p = self.paddle
        x = hidden_states if isinstance(hidden_states, p.Tensor) else p.to_tensor(hidden_states)
        with p.no_grad():
            x = x.astype("float32").reshape([-1, self.config.hidden_size])
            if x.shape[0] == 0:
                return p.zeros([0, self.config.vocab_size], dtype="float32")
            normed = self.weights.linear.rms_norm(x) * self.local.final_norm
            return p.matmul(normed, self._lm_head, transpose_y=True)


class Watchdog:
    """Rank 0's guard against a lost rank: checks the local worker processes, and the step in
    progress against ``timeout`` seconds, every :data:`WATCHDOG_INTERVAL`; on a failure calls
    ``on_failure(message)`` once (from its own thread: the engine thread may be blocked in a
    collective that will never return)."""

    def __init__(self, workers: list, timeout: float, on_failure: Callable[[str], None]):
        self.workers = workers
        self.timeout = timeout
        self.on_failure = on_failure
        self.failure: Optional[str] = None
        self._lock = threading.Lock()
        self._step_started: Optional[float] = None
        self._thread = threading.Thread(target=self._run, name="specdec-tp-watchdog", daemon=True)
        self._thread.start()

    def step(self) -> "_Step":
        return _Step(self)

    def stop(self) -> None:
        """Stop watching (the workers are being shut down on purpose)."""
        with self._lock:
            if self.failure is None:
                self.failure = "stopped"

    def fail(self, message: str) -> None:
        """Report ``message`` through ``on_failure``, once (later calls do nothing)."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = message
        logger.error("%s", message)
        self.on_failure(message)

    def collective_failed(self, exc: Exception) -> None:
        """A collective raised (gloo does when a peer's connection drops): most likely a rank
        died, which the next checks will name; give them a moment, else report the error."""
        deadline = time.monotonic() + 5 * WATCHDOG_INTERVAL
        while time.monotonic() < deadline and self.failure is None:
            message = self._check()
            if message is not None:
                self.fail(message)
                return
            time.sleep(WATCHDOG_INTERVAL / 4)
        self.fail(f"a tensor-parallel collective failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")

    def _run(self) -> None:
        while self.failure is None:
            time.sleep(WATCHDOG_INTERVAL)
            message = self._check()
            if message is not None:
                self.fail(message)

    def _check(self) -> Optional[str]:
        for rank, process in enumerate(self.workers, start=1):
            if process.exitcode is not None:
                how = f"signal {-process.exitcode}" if process.exitcode < 0 else f"exit code {process.exitcode}"
                return f"tensor-parallel rank {rank} died ({how})"
        started = self._step_started
        if started is not None and time.monotonic() - started > self.timeout:
            return (f"a tensor-parallel step has waited more than tensor_parallel_timeout ({self.timeout:g} s): "
                    "a rank is hung or gone")
        return None


class _Step:
    def __init__(self, watchdog: Watchdog):
        self.watchdog = watchdog

    def __enter__(self):
        self.watchdog._step_started = time.monotonic()

    def __exit__(self, *exc):
        self.watchdog._step_started = None


def exit_after_failure(message: str, grace: float = 1.0) -> None:
    """The default fatal handler: say why on stderr, then end the process (its workers are
    daemons and go with it) after ``grace`` seconds for replies in flight to leave."""
    print(f"error: {message}; the requests in flight failed", file=sys.stderr, flush=True)
    # The main thread may finish meanwhile (its requests just failed) and exit with its own
    # code: the exit handler registered last runs first, and keeps the code 3.
    atexit.register(os._exit, 3)
    time.sleep(grace)
    os._exit(3)
