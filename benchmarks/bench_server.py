"""Serving speed over HTTP: naive vs ngram at 1, 8 and 32 concurrent clients (loopback).

    python benchmarks/bench_server.py [--concurrency 1,8,32] [--requests N] [--max-tokens 64]

For each method it starts ``specdec serve`` (a subprocess, on a free loopback port), sends one
warm-up request, then for each concurrency level C runs C clients at once, which together send
max(N, C) streaming chat requests (default N: 2 x C), each client one request after another:
code-edit prompts, greedy, ``ignore_eos`` so that every request generates exactly
``--max-tokens`` tokens. It prints request throughput, output tokens/s, time to first token
(TTFT) and time per output token after the first (TPOT), p50 and p99, measured by the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from specdec.workloads import code_edit_prompts

METHODS = {
    "naive": {"method": "naive"},
    "ngram": {"method": "ngram", "verify_strategy": "greedy"},
}


def start_server(spec: dict, max_num_seqs: int, log_path: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """``specdec serve`` on a free port; returns the process and its URL once it listens."""
    log = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "--port", "0", "--speculative-config", json.dumps(spec),
         "--max-num-seqs", str(max_num_seqs), "--max-pending-requests", "1024", "--log-level", "warning",
         "--no-progress", *extra],
        stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 600
    while True:
        match = re.search(r"listening on (http://\S+)", log_path.read_text())
        if match:
            return process, match.group(1)
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            sys.exit(f"specdec serve did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


async def one_request(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    """One streaming chat request; returns its timings (seconds) and token count."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    first = None
    tokens = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - start, "tpot": (end - first) / (tokens - 1) if tokens > 1 else 0.0, "tokens": tokens}


async def run_level(url: str, prompts: list[str], clients: int, num_requests: int, max_tokens: int) -> dict:
    """``clients`` concurrent clients sharing ``num_requests`` requests; the aggregate figures."""
    todo: asyncio.Queue[str] = asyncio.Queue()
    for i in range(num_requests):
        todo.put_nowait(prompts[i % len(prompts)])
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        async def client() -> list[dict]:
            done = []
            while not todo.empty():
                done.append(await one_request(http, todo.get_nowait(), max_tokens))
            return done

        start = time.perf_counter()
        results = [r for per_client in await asyncio.gather(*(client() for _ in range(clients))) for r in per_client]
        wall = time.perf_counter() - start
    ttft = np.array([r["ttft"] for r in results])
    tpot = np.array([r["tpot"] for r in results])
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall": wall,
            "req_s": len(results) / wall, "tok_s": tokens / wall,
            "ttft_p50": np.percentile(ttft, 50), "ttft_p99": np.percentile(ttft, 99),
            "tpot_p50": np.percentile(tpot, 50), "tpot_p99": np.percentile(tpot, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="naive,ngram")
    parser.add_argument("--concurrency", default="1,8,32", help="client counts, comma-separated")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per concurrency level, at least one per client (default: 2 per client)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16, help="distinct code-edit prompts (cycled)")
    parser.add_argument("--max-lines", type=int, default=30, help="longest function in a prompt, in lines")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the largest concurrency")
    parser.add_argument("--serve-args", default="", help="more flags for specdec serve")
    args = parser.parse_args()

    levels = [int(c) for c in args.concurrency.split(",")]
    max_num_seqs = args.max_num_seqs or max(levels)
    prompts = code_edit_prompts(args.prompts, max_lines=args.max_lines)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.methods.split(","):
            process, url = start_server(METHODS[name], max_num_seqs, Path(tmp) / f"{name}.log", args.serve_args.split())
            try:
                asyncio.run(run_level(url, prompts[:1], 1, 1, 8))  # warm-up
                for clients in levels:
                    count = max(args.requests, clients) if args.requests else 2 * clients
                    rows.append((name, asyncio.run(run_level(url, prompts, clients, count, args.max_tokens))))
                    print(f"  {name} x{clients}: done", file=sys.stderr, flush=True)
            finally:
                stop_server(process)

    threads = os.environ.get("SPECDEC_NUM_THREADS", "all cores")
    print(f"specdec serve, loopback HTTP, max_num_seqs {max_num_seqs}, greedy, {args.max_tokens} new tokens "
          f"(ignore_eos), {len(prompts)} code-edit prompts (chat, at most {args.max_lines} lines of code), "
          f"SPECDEC_NUM_THREADS={threads}")
    header = (f"{'method':<8}{'clients':>8}{'requests':>9}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}"
              f"{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}")
    print(header)
    print("-" * len(header))
    for name, r in rows:
        print(f"{name:<8}{r['clients']:>8}{r['requests']:>9}{r['req_s']:>8.2f}{r['tok_s']:>11.1f}"
              f"{r['ttft_p50']:>9.2f}s{r['ttft_p99']:>9.2f}s{r['tpot_p50'] * 1e3:>8.0f}ms{r['tpot_p99'] * 1e3:>8.0f}ms")
    print("TTFT: submit to first content chunk; TPOT: (end - first content) / (tokens - 1); per request, at the client")


if __name__ == "__main__":
    main()
