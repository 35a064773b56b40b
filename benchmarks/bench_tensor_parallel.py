"""Tensor parallelism on one machine: decode step time at 1 and 2 ranks, and what the all-reduces cost.

    python benchmarks/bench_tensor_parallel.py [--max-tokens 64] [--batches 1,8] [--reps 2000]

Two measurements, in one run, on the default model (float32 ``kernels: paddle`` for both rank
counts, so that they are comparable):

- Step time. The engine at ``tensor_parallel_size`` 1, then 2, decodes ``--max-tokens`` greedy
  tokens (naive, EOS ignored) for ``--batches`` short chat prompts at once; the script drives
  ``Engine.step`` itself and reports the median wall time of the decode steps (the steps after
  every request has its first token). At 2 ranks it also times, on rank 0, every collective
  of those steps: the broadcast of the step's inputs, the all-reduces (the embedding, then O
  and down in every layer) and the all-gather of the logits. That time includes waiting for
  rank 1 to reach the same collective.
- The collectives alone. Two gloo ranks (processes started as the engine starts its workers,
  through the same ``CollectiveGroup``) all-reduce a ``[rows, hidden]`` float32 hidden state
  ``--reps`` times and all-gather ``[rows, vocab / 2]`` logits, for rows 1 (batch 1), 6 (batch
  1 with 5 drafted tokens: ``1 + k`` rows) and 8 (batch 8), timing the wall clock and rank
  0's CPU time (user and system) per call. A step of ``L`` layers makes ``2 L + 1``
  all-reduces and one all-gather; the table multiplies out. For scale, a plain loopback TCP
  round trip of one batch-1 hidden state between two processes (no gloo, no paddle).

One markdown table holds every figure (about 80 s on a 2-core machine). The machine's load
shows in every number. The
collectives are a floor a tensor-parallel step cannot go under, however many cores there are.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import socket
import statistics
import time

import specdec
from specdec.workloads import chat_prompts

#: Rows of the hidden state a step all-reduces: batch 1, batch 1 with k = 5 drafts, batch 8.
ROWS = (1, 6, 8)


# -- the collectives alone, in two processes --------------------------------------------------


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _echo(port_queue) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port_queue.put(server.getsockname()[1])
    connection, _ = server.accept()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := connection.recv(4096):
        connection.sendall(data)


def tcp_round_trip(reps: int) -> float:
    """Seconds of one 2,304-byte loopback TCP round trip between two processes (plain sockets):
    what moving a batch-1 hidden state there and back costs without gloo and paddle."""
    context = multiprocessing.get_context("spawn")
    port_queue = context.Queue()
    process = context.Process(target=_echo, args=(port_queue,), daemon=True)
    process.start()
    client = socket.create_connection(("127.0.0.1", port_queue.get(timeout=60)))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = bytes(2304)

    def round_trip():
        client.sendall(payload)
        received = 0
        while received < len(payload):
            received += len(client.recv(65536))

    for _ in range(reps // 10):
        round_trip()
    start = time.perf_counter()
    for _ in range(reps):
        round_trip()
    seconds = (time.perf_counter() - start) / reps
    client.close()
    process.join(10)
    return seconds


def _collectives_rank(environment: dict, hidden: int, vocab_per_rank: int, reps: int, gather_reps: int,
                      queue) -> None:
    """One rank of the collective benchmark; rank 0 puts ``{(kind, rows): (wall seconds, CPU
    seconds) per call}`` (CPU: this process's user and system time)."""
    os.environ.update(environment)
    os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")
    from specdec.engine.tensor_parallel import init_process_group
    from specdec.errors import require_paddle
    from specdec.model.tensor_parallel import CollectiveGroup

    paddle = require_paddle()
    init_process_group(paddle)
    group = CollectiveGroup(paddle)
    line_up = paddle.zeros([1], dtype="float32")
    seconds = {}
    for rows in ROWS:
        state = paddle.zeros([rows, hidden], dtype="float32")  # zeros: the sums stay finite
        for _ in range(max(10, reps // 20)):
            group.all_reduce(state)
        group.all_reduce(line_up)
        start, cpu = time.perf_counter(), _cpu_seconds()
        for _ in range(reps):
            group.all_reduce(state)
        seconds[("all_reduce", rows)] = ((time.perf_counter() - start) / reps, (_cpu_seconds() - cpu) / reps)

        logits = paddle.zeros([rows, vocab_per_rank], dtype="float32")
        for _ in range(max(5, gather_reps // 20)):
            group.all_gather(logits)
        group.all_reduce(line_up)
        start, cpu = time.perf_counter(), _cpu_seconds()
        for _ in range(gather_reps):
            group.all_gather(logits)
        seconds[("all_gather", rows)] = ((time.perf_counter() - start) / gather_reps,
                                         (_cpu_seconds() - cpu) / gather_reps)
    group.all_reduce(line_up)
    if group.rank == 0:
        queue.put(seconds)


def measure_collectives(hidden: int, vocab_per_rank: int, reps: int, gather_reps: int) -> dict:
    from specdec.engine.rendezvous_store import StoreProcess
    from specdec.engine.tensor_parallel import rank_environments

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    store = StoreProcess("127.0.0.1", clients=2)  # the ranks' rendezvous, served from here
    processes = [context.Process(target=_collectives_rank,
                                 args=(environment, hidden, vocab_per_rank, reps, gather_reps, queue))
                 for environment in rank_environments(2, "gloo", store.endpoint)]
    for process in processes:
        process.start()
    seconds = queue.get(timeout=600)
    for process in processes:
        process.join(30)
    return seconds


# -- the engine's steps ---------------------------------------------------------------------


class CollectiveTimer:
    """Wraps rank 0's ``CollectiveGroup`` methods to add up the time spent in each."""

    KINDS = ("broadcast_int64", "all_reduce", "all_gather")

    def __init__(self, group):
        self.seconds = dict.fromkeys(self.KINDS, 0.0)
        self.calls = dict.fromkeys(self.KINDS, 0)
        for kind in self.KINDS:
            setattr(group, kind, self._timed(kind, getattr(group, kind)))

    def _timed(self, kind, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - start
                self.calls[kind] += 1
        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.KINDS, 0.0)
        self.calls = dict.fromkeys(self.KINDS, 0)


def decode_steps(llm, prompts, max_tokens: int, timer) -> dict:
    """Median seconds of a decode step (and, with ``timer``, of rank 0's collectives in one)."""
    engine = llm.engine
    sampling = specdec.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    requests = [engine.add_request(llm.encode_prompt(p, use_chat_template=True), sampling) for p in prompts]
    steps, collective = [], {kind: [] for kind in CollectiveTimer.KINDS}
    calls = {}
    while any(not r.finished for r in requests):
        decoding = all(r.num_generated > 0 for r in requests)
        if timer is not None:
            timer.reset()
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if decoding and all(not r.finished for r in requests):  # a full batch of decode rows
            steps.append(elapsed)
            if timer is not None:
                for kind in CollectiveTimer.KINDS:
                    collective[kind].append(timer.seconds[kind])
                calls = dict(timer.calls)
    result = {"step": statistics.median(steps), "num_steps": len(steps), "calls": calls}
    if timer is not None:
        result.update({kind: statistics.median(values) for kind, values in collective.items()})
    return result


def measure_engine(tp: int, batches: list[int], max_tokens: int, num_kv_blocks: int) -> tuple[dict, object]:
    llm = specdec.LLM(kernels="paddle", dtype="float32", tensor_parallel_size=tp, max_num_seqs=max(batches),
                      num_kv_blocks=num_kv_blocks, progress=False)
    config = llm.engine.model_config
    timer = CollectiveTimer(llm.engine.model.group) if tp > 1 else None
    llm.generate(chat_prompts(1), specdec.SamplingParams(max_tokens=8), use_chat_template=True)  # warm-up
    results = {batch: decode_steps(llm, chat_prompts(batch), max_tokens, timer) for batch in batches}
    if tp > 1:
        # Engine.close() stops the workers, and the watchdog would then report rank 1 as gone.
        llm.engine.set_fatal_handler(lambda message: None)
        llm.engine.close()
    return results, config


# -- the table ------------------------------------------------------------------------------


def _bytes(n: int) -> str:
    return f"{n:,} B"


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--batches", default="1,8", help="batch sizes of the step-time runs")
    parser.add_argument("--reps", type=int, default=2000, help="all-reduces timed per size")
    parser.add_argument("--gather-reps", type=int, default=300, help="logits all-gathers timed per size")
    parser.add_argument("--num-kv-blocks", type=int, default=128)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    began = time.perf_counter()
    single, config = measure_engine(1, batches, args.max_tokens, args.num_kv_blocks)
    hidden, layers, vocab = config.hidden_size, config.num_layers, config.vocab_size
    vocab_per_rank = -(-vocab // 2)
    round_trip = tcp_round_trip(args.reps)
    collectives = measure_collectives(hidden, vocab_per_rank, args.reps, args.gather_reps)
    double, _ = measure_engine(2, batches, args.max_tokens, args.num_kv_blocks)
    all_reduces = 2 * layers + 1

    print(f"model {config.num_layers} layers, hidden {hidden}, vocabulary {vocab}; float32, kernels paddle; "
          f"greedy naive decode, {args.max_tokens} tokens a request; {os.cpu_count()} CPU cores; "
          f"{time.perf_counter() - began:.0f} s in all")
    print()
    print("| what | ranks | rows | bytes | time |")
    print("|---|---|---|---|---|")
    for batch in batches:
        one, two = single[batch], double[batch]
        print(f"| decode step (median of {one['num_steps']}) | 1 | {batch} | | {_time(one['step'])} |")
        print(f"| decode step (median of {two['num_steps']}) | 2 | {batch} | | {_time(two['step'])} "
              f"({two['step'] / one['step']:.2f}x 1 rank) |")
        calls = two["calls"]
        total = sum(two[kind] for kind in CollectiveTimer.KINDS)
        print(f"| rank 0 in collectives in that step: step broadcast ({calls.get('broadcast_int64', 0)} call) "
              f"{_time(two['broadcast_int64'])}, all-reduces ({calls.get('all_reduce', 0)}) "
              f"{_time(two['all_reduce'])}, logits all-gather ({calls.get('all_gather', 0)}) "
              f"{_time(two['all_gather'])} | 2 | {batch} | | {_time(total)} |")
    print(f"| loopback TCP round trip, plain sockets (no gloo, no paddle) | | 1 | {_bytes(4 * hidden)} each way | "
          f"{_time(round_trip)} |")
    for rows in ROWS:
        reduce_s, reduce_cpu = collectives[("all_reduce", rows)]
        gather_s, gather_cpu = collectives[("all_gather", rows)]
        state, logits = rows * hidden * 4, rows * vocab_per_rank * 4
        print(f"| all-reduce of the hidden state, {rows} x {hidden} float32 | 2 | {rows} | {_bytes(state)} | "
              f"{_time(reduce_s)} ({_time(reduce_cpu)} CPU on rank 0) |")
        print(f"| per layer: 2 all-reduces (after O, after down) | 2 | {rows} | {_bytes(2 * state)} | "
              f"{_time(2 * reduce_s)} |")
        print(f"| logits all-gather, {rows} x {vocab_per_rank} float32 per rank | 2 | {rows} | "
              f"{_bytes(logits)} out, {_bytes(2 * logits)} in | {_time(gather_s)} "
              f"({_time(gather_cpu)} CPU on rank 0) |")
        print(f"| per step: {all_reduces} all-reduces (2 x {layers} + embedding) + logits all-gather | 2 | {rows} | "
              f"{_bytes(all_reduces * state + logits)} out | {_time(all_reduces * reduce_s + gather_s)} |")
    print()
    first = batches[0]
    floor = all_reduces * collectives[("all_reduce", first)][0] + collectives[("all_gather", first)][0]
    print(f"On {os.cpu_count()} cores 2 ranks cannot beat 1. The 1-rank step ({_time(single[first]['step'])} at "
          f"batch {first}) already keeps one core busy, so 2 ranks can at best halve its matmul time "
          f"({_time(single[first]['step'] / 2)}), and every step adds {all_reduces} all-reduces and an all-gather "
          f"({_time(floor)} measured alone), the step broadcast and every wait for the slower rank, all of it "
          f"CPU time on the same 2 cores (shared with the engine's other threads and the rest of the machine).")


if __name__ == "__main__":
    main()
