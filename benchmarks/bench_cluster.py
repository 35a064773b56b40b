"""A Redis-scheduled cluster on one machine: throughput of 1 and 2 instances, and what
prefill/decode disaggregation costs per request.

    python benchmarks/bench_cluster.py [--requests 32] [--max-tokens 64] [--ttft-requests 8]

Everything runs for real: ``redis-server`` on loopback, ``specdec serve`` instances as
subprocesses (ngram, k 3, the default model), the official ``openai`` client.

- Throughput. ``--requests`` greedy code-edit completions at once, spread over the endpoints
  of 1 mixed instance, then of 2 mixed instances behind one Redis: generated tokens per second
  of wall time. Both instances share this machine's cores, so 2 instances cannot be faster
  than the cores allow; the figure shows what the cluster layer costs, not what a second
  machine would add.
- Disaggregation. ``--ttft-requests`` streamed requests, one at a time, on 1 mixed instance
  and then on 1 prefill + 1 decode instance: the median time to the first token, and the
  hand-offs' bytes and time (the instances' ``/metrics``: bytes sent, seconds from connect to
  the decode instance's answer, which comes once its engine loop has taken the request).
- The channel alone: the same TCP hand-off of a 16 MB state to a listener in this process that
  answers at once, 10 times; bytes per second of the median.

One markdown table holds every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "cluster"))

from cluster_harness import (MODEL_NAME, RedisServer, cluster_directory, start_instance,  # noqa: E402
                             wait_for_instances)

from specdec.workloads import code_edit_prompts  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


async def _throughput(instances, prompts, max_tokens: int) -> tuple[float, int]:
    clients = [i.async_openai() for i in instances]

    async def one(index: int, prompt: str) -> int:
        response = await clients[index % len(clients)].completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return response.usage.completion_tokens

    started = time.perf_counter()
    tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - started
    for client in clients:
        await client.close()
    return sum(tokens) / elapsed, sum(tokens)


async def _first_token_times(instance, prompts, max_tokens: int) -> list[float]:
    client = instance.async_openai()
    times = []
    for prompt in prompts:
        started = time.perf_counter()
        first = None
        async for chunk in await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                                           temperature=0, stream=True):
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - started
        times.append(first)
    await client.close()
    return times


def _channel_bandwidth(num_bytes: int = 16 * 2**20, reps: int = 10) -> float:
    """Bytes per second of one TCP hand-off of ``num_bytes`` (median of ``reps``) to a
    listener whose handler answers at once: the channel without any engine."""
    import numpy as np

    from specdec.cluster.transfer import TransferServer, send_handoff
    from specdec.engine.handoff import HandoffState, KVLayout
    from specdec.sampling import SamplingParams

    layers, heads, block_size, head_dim = 30, 3, 16, 64  # the default model's float16 cache
    blocks = num_bytes // (layers * 2 * heads * block_size * head_dim * 2)
    layout = KVLayout(backend="cpu", dtype="float16", block_size=block_size, num_layers=layers,
                      num_kv_heads=heads, head_dim=head_dim, model="m", vocab_size=100)
    state = HandoffState(request_id="r", prompt_token_ids=np.zeros(blocks * block_size, dtype=np.int64),
                         output_token_ids=np.zeros(1, dtype=np.int64), sampling=SamplingParams(),
                         rng_state=np.random.default_rng(0).bit_generator.state, num_positions=blocks * block_size,
                         kv=[np.ones((blocks, 2 * heads, block_size, head_dim), dtype=np.float16)
                             for _ in range(layers)], hidden_states=None, layout=layout, first_token_s=0.0)

    async def run() -> list[float]:
        async def handler(meta, received):
            return None

        server = TransferServer("127.0.0.1", 0, handler, max_bytes=2 * num_bytes)
        _, port = await server.start()
        try:
            return [(await send_handoff(f"127.0.0.1:{port}", {}, state)).seconds for _ in range(reps)]
        finally:
            await server.close()

    return state.nbytes / statistics.median(asyncio.run(run()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ttft-requests", type=int, default=8)
    args = parser.parse_args()
    prompts = code_edit_prompts(args.requests, min_lines=4, max_lines=12)
    ttft_prompts = code_edit_prompts(args.ttft_requests, min_lines=12, max_lines=30)
    rows = []
    with cluster_directory() as directory:
        redis = RedisServer(directory)
        try:
            # -- throughput, 1 and 2 mixed instances --------------------------------------
            a = start_instance(redis.url, directory, "bench-a", speculative=NGRAM)
            try:
                wait_for_instances(a, 1)
                asyncio.run(_throughput([a], prompts[:2], 8))  # warm-up
                one, tokens = asyncio.run(_throughput([a], prompts, args.max_tokens))
                rows.append(("throughput, 1 mixed instance", f"{one:.1f} tok/s", f"{tokens} tokens"))
                mixed_ttft = asyncio.run(_first_token_times(a, ttft_prompts, 8))
                b = start_instance(redis.url, directory, "bench-b", speculative=NGRAM)
                try:
                    wait_for_instances(a, 2)
                    wait_for_instances(b, 2)
                    asyncio.run(_throughput([b], prompts[:2], 8))  # warm-up
                    two, tokens = asyncio.run(_throughput([a, b], prompts, args.max_tokens))
                    rows.append(("throughput, 2 mixed instances (same 2 cores)", f"{two:.1f} tok/s",
                                 f"{tokens} tokens, {two / one:.2f}x of 1"))
                finally:
                    b.stop()
            finally:
                a.stop()
            # -- disaggregation -------------------------------------------------------------
            prefill = start_instance(redis.url, directory, "bench-prefill", role="prefill", speculative=NGRAM)
            decode = start_instance(redis.url, directory, "bench-decode", role="decode", speculative=NGRAM)
            try:
                wait_for_instances(prefill, 2)
                wait_for_instances(decode, 2)
                asyncio.run(_first_token_times(prefill, prompts[:2], 4))  # warm-up
                sent_before = prefill.metric("specdec_kv_transfer_bytes_total", direction="sent")
                seconds_before = prefill.metric("specdec_kv_transfer_seconds_total")
                count_before = prefill.metric("specdec_kv_transfers_total", direction="sent")
                pd_ttft = asyncio.run(_first_token_times(prefill, ttft_prompts, 8))
                sent = prefill.metric("specdec_kv_transfer_bytes_total", direction="sent") - sent_before
                seconds = prefill.metric("specdec_kv_transfer_seconds_total") - seconds_before
                count = prefill.metric("specdec_kv_transfers_total", direction="sent") - count_before
            finally:
                prefill.stop()
                decode.stop()
        finally:
            redis.stop()
    mixed_median, pd_median = statistics.median(mixed_ttft), statistics.median(pd_ttft)
    rows.append(("time to first token, 1 mixed instance (median)", f"{mixed_median * 1000:.0f} ms",
                 f"{len(ttft_prompts)} prompts, one at a time"))
    rows.append(("time to first token, prefill + decode (median)", f"{pd_median * 1000:.0f} ms",
                 f"+{(pd_median - mixed_median) * 1000:.0f} ms for the hand-off"))
    rows.append(("KV hand-off per request", f"{sent / max(1, count) / 1e6:.2f} MB",
                 f"{count:.0f} hand-offs, {seconds / max(1, count) * 1000:.1f} ms each (connect to answer)"))
    rows.append(("KV hand-off, bytes / time in the cluster", f"{sent / max(seconds, 1e-9) / 1e9:.2f} GB/s",
                 "connect to answer: the decode engine loop takes the request first"))
    rows.append(("the TCP channel alone (loopback)", f"{_channel_bandwidth() / 1e9:.2f} GB/s",
                 "16 MB hand-offs to a listener that answers at once, median of 10"))
    print("| measure | value | notes |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
