"""specdec against llama.cpp's own server, over HTTP, with the same client and prompts.

    python benchmarks/bench_peers.py --llama-server /path/to/llama-server
        [--model FILE.gguf] [--workload code-edit|chat] [--prompts 6] [--max-tokens 96]
        [--methods naive,ngram,suffix] [--threads 2] [--rounds 1]
        [--draft-model DRAFT.gguf --draft-k 5]

Starts one ``specdec serve`` per method and two ``llama-server`` processes on the same GGUF
file: plain, and ``--spec-type ngram-mod`` (its lookup speculation). With ``--draft-model``,
also specdec's ``draft_model`` method and llama.cpp's ``--spec-type draft-simple -md`` on that
draft, both drafting ``--draft-k`` tokens a step (llama.cpp's ``--spec-draft-n-max``). Every engine gets the same
chat prompts through the official ``openai`` client, streamed, greedy, batch 1, stopping at EOS
or ``--max-tokens``; the engines take turns prompt by prompt (a shared machine's slow spells hit
them alike), so at most one of them is busy at a time. Each figure is measured by the client:
end-to-end tokens/s (completion tokens over the request's time) and decode tokens/s (the tokens
after the first over the time after the first content). The floor column is the decode rate
the memory allows: the bandwidth both cores reach reading a large array over the bytes of the
file's tensors (a decode step reads every weight once).

Build llama-server from the sources vendored in the ``llama-cpp-python==0.3.36`` sdist
(docs/benchmarks/llamacpp.md: ``cmake -DGGML_NATIVE=ON``, about 25 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench_rows import memory_bandwidth  # benchmarks/ is the script's folder: on sys.path
from bench_server import start_server, stop_server

from specdec.bench.results import machine_description
from specdec.model.resolve import resolve_model_path
from specdec.workloads import chat_prompts, code_edit_prompts

METHODS = {
    "naive": {"method": "naive"},
    "ngram": {"method": "ngram"},
    "suffix": {"method": "suffix"},
}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_llama_server(binary: str, model: str, threads: int, extra: list[str], log_path: Path):
    """``llama-server`` on a free loopback port; returns the process and its URL once healthy."""
    port = free_port()
    log = open(log_path, "w")
    process = subprocess.Popen([binary, "-m", model, "--port", str(port), "--host", "127.0.0.1", "-t", str(threads),
                                "-c", "4096", "-np", "1", *extra], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"llama-server did not start:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    sys.exit(f"llama-server did not get healthy:\n{log_path.read_text()[-3000:]}")


def one_request(client, model: str, prompt: str, max_tokens: int) -> tuple[int, float, float]:
    """``(completion tokens, seconds, seconds to the first content)`` of one streamed chat request."""
    start = time.perf_counter()
    first = None
    tokens = 0
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
    end = time.perf_counter()
    return tokens, end - start, (first or end) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True, help="the llama-server binary")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF file, or a model alias")
    parser.add_argument("--workload", choices=("code-edit", "chat"), default="code-edit")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--methods", default="naive,ngram,suffix")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--rounds", type=int, default=1, help="passes over the prompts")
    parser.add_argument("--draft-model", help="a draft GGUF file of the model's tokenizer: adds specdec's draft_model "
                                              "and llama.cpp's draft-simple")
    parser.add_argument("--draft-k", type=int, default=5, help="tokens drafted a step by both draft models")
    args = parser.parse_args()
    from openai import OpenAI

    model = str(resolve_model_path(args.model))
    prompts = code_edit_prompts(args.prompts) if args.workload == "code-edit" else chat_prompts(args.prompts)
    logs = Path(tempfile.mkdtemp(prefix="bench_peers-"))
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for name in args.methods.split(","):
            servers[f"specdec {name}"] = start_server(METHODS[name], 1, logs / f"specdec-{name}.log", ["--model", model])
        if args.draft_model:
            draft = str(resolve_model_path(args.draft_model))
            spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": args.draft_k}
            servers["specdec draft_model"] = start_server(spec, 1, logs / "specdec-draft.log", ["--model", model])
        servers["llama.cpp plain"] = start_llama_server(args.llama_server, model, args.threads, [],
                                                        logs / "llama-plain.log")
        servers["llama.cpp ngram-mod"] = start_llama_server(args.llama_server, model, args.threads,
                                                            ["--spec-type", "ngram-mod"], logs / "llama-ngram.log")
        if args.draft_model:
            servers["llama.cpp draft-simple"] = start_llama_server(
                args.llama_server, model, args.threads,
                ["--spec-type", "draft-simple", "-md", draft, "--spec-draft-n-max", str(args.draft_k)],
                logs / "llama-draft.log")
        clients = {name: OpenAI(base_url=f"{url}/v1", api_key="none", timeout=3600) for name, (_, url) in servers.items()}
        served = {name: client.models.list().data[0].id for name, client in clients.items()}
        for name, client in clients.items():  # warm-up: first-call allocations
            one_request(client, served[name], prompts[0], 8)
        totals = {name: np.zeros(4) for name in servers}  # tokens, seconds, decode tokens, decode seconds
        for _ in range(args.rounds):
            for prompt in prompts:
                for name, client in clients.items():
                    tokens, seconds, first = one_request(client, served[name], prompt, args.max_tokens)
                    totals[name] += (tokens, seconds, max(tokens - 1, 0), seconds - first)
    finally:
        for process, _ in servers.values():
            stop_server(process)
    floor = memory_bandwidth() / tensor_bytes(model)
    print(f"model {Path(model).name}, {args.workload} x{args.prompts}, at most {args.max_tokens} tokens, greedy, "
          f"batch 1, {args.rounds} round(s); {machine_description()}; llama.cpp with {args.threads} threads")
    base, peer = totals.get("specdec naive"), totals["llama.cpp plain"]
    header = f"{'engine':<22}{'tokens':>8}{'tok/s':>8}{'decode tok/s':>14}{'vs naive':>10}{'vs llama':>10}{'floor':>8}"
    print(header)
    print("-" * len(header))
    for name, (tokens, seconds, decode_tokens, decode_seconds) in totals.items():
        rate = tokens / seconds
        versus = f"{rate / (base[0] / base[1]):.2f}x" if base is not None else "-"
        print(f"{name:<22}{int(tokens):>8}{rate:>8.1f}{decode_tokens / decode_seconds:>14.1f}{versus:>10}"
              f"{rate / (peer[0] / peer[1]):>9.2f}x{floor:>8.1f}")
    print("tok/s: end to end per request (prefill included); vs: end-to-end ratios; floor: decode tok/s the memory "
          "bandwidth allows")


def tensor_bytes(path: str) -> int:
    """Bytes of a GGUF file's tensors (what a decode step reads, the embedding's rows aside)."""
    from gguf import GGUFReader

    return sum(int(tensor.n_bytes) for tensor in GGUFReader(path).tensors)


if __name__ == "__main__":
    main()
