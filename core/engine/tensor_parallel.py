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

Failure. A :class:`Watchdog` thread on rank 0 checks the local workers every
``WATCHDOG_INTERVAL`` seconds, and any rank's step against ``config.tensor_parallel_timeout``
(a collective that waits on a dead or hung rank blocks inside paddle and cannot be
interrupted). On either it calls the engine's fatal handler, which fails the requests in
flight with the reason, and then the process exits: a tensor-parallel engine that lost a rank
cannot recover its KV cache, so it does not try.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import sys
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger("specdec.engine")

#: Seconds between two checks of the workers and of the running step.
WATCHDOG_INTERVAL = 0.2
#: Environment variables paddle.distributed reads to join a process group.
RANK_ENV = ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ENDPOINTS", "PADDLE_CURRENT_ENDPOINT",
            "PADDLE_DISTRI_BACKEND")


def launched_rank() -> Optional[tuple[int, int]]:
    """``(rank, world_size)`` when ``paddle.distributed.launch`` started this process, else None."""
    if "PADDLE_TRAINER_ID" not in os.environ or "PADDLE_TRAINERS_NUM" not in os.environ:
        return None
    return int(os.environ["PADDLE_TRAINER_ID"]), int(os.environ["PADDLE_TRAINERS_NUM"])


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def rank_environments(world_size: int, backend: str) -> list[dict]:
    """paddle.distributed's environment for each rank of a group on this machine (free
    loopback ports, one per rank; rank 0's also serves the group's rendezvous store)."""
    endpoints = [f"127.0.0.1:{port}" for port in _free_ports(world_size)]
    return [{"PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(world_size),
             "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints), "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
             "PADDLE_DISTRI_BACKEND": backend, "FLAGS_selected_gpus": str(rank)}
            for rank in range(world_size)]


def init_process_group(paddle) -> None:
    """Join the process group the environment describes (and, on GPUs, take this rank's)."""
    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        paddle.set_device(f"gpu:{int(os.environ['PADDLE_TRAINER_ID'])}")
    paddle.distributed.init_parallel_env()


def start_local_workers(config, world_size: int, backend: str) -> list:
    """Start ranks ``1 .. world_size - 1`` on this machine and set rank 0's environment in
    this process; returns the worker processes (daemons: they end with this process)."""
    environments = rank_environments(world_size, backend)
    context = multiprocessing.get_context("spawn")
    workers = []
    for rank in range(1, world_size):
        process = context.Process(target=_worker_main, args=(config, environments[rank]), daemon=True,
                                  name=f"specdec-tp-rank{rank}")
        process.start()
        workers.append(process)
    os.environ.update(environments[0])
    return workers


def _worker_main(config, environment: dict) -> None:
    os.environ.update(environment)
    os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")
    try:
        worker_loop(config)
    except KeyboardInterrupt:
        pass


def worker_loop(config) -> None:
    """A rank other than 0: build this rank's slice of the model and attention cache, then
    run every step rank 0 broadcasts, until it says stop (or goes away)."""
    from ..errors import require_paddle
    from ..model.tensor_parallel import CollectiveGroup
    from ..plugin_manager import get_plugins
    from .engine import build_model

    paddle = require_paddle()
    init_process_group(paddle)
    group = CollectiveGroup(paddle)
    built = build_model(config, get_plugins(), progress=False, tensor_parallel=(group, group.rank,
                                                                                 group.world_size))
    model = built.model
    while True:
        message = group.broadcast_object()
        kind = message[0]
        if kind == "stop":
            return
        if kind == "init_cache":
            _, num_blocks, block_size = message
            built.attention.init_cache(num_blocks, block_size)
        elif kind == "forward":
            _, token_ids, meta, logit_rows = message
            model.forward(token_ids, meta, logit_rows)


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

    def init_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate every rank's cache (rank 0's through the engine, the others' by message)."""
        self.group.broadcast_object(("init_cache", num_blocks, block_size))

    def forward(self, token_ids, meta, logit_rows, return_hidden: bool = False, device_logits: bool = False):
        with self.watchdog.step():
            self.group.broadcast_object(("forward", token_ids, meta, logit_rows))
            return self.local.forward(token_ids, meta, logit_rows, return_hidden=return_hidden,
                                      device_logits=device_logits)

    def stop_workers(self) -> None:
        try:
            self.group.broadcast_object(("stop",))
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
        self._step_started: Optional[float] = None
        self._thread = threading.Thread(target=self._run, name="specdec-tp-watchdog", daemon=True)
        self._thread.start()

    def step(self) -> "_Step":
        return _Step(self)

    def _run(self) -> None:
        while self.failure is None:
            time.sleep(WATCHDOG_INTERVAL)
            message = self._check()
            if message is not None:
                self.failure = message
                logger.error("%s", message)
                self.on_failure(message)

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
    time.sleep(grace)
    os._exit(3)
