"""Benchmark runs against a running OpenAI-compatible server: specdec serve, llama-server, vLLM.

Each request is a streamed ``POST /v1/chat/completions`` with standard fields only (``model``,
``messages``, ``max_tokens``, ``temperature``, ``stream``, ``stream_options.include_usage``;
``ignore_eos`` only when asked for, which vLLM, llama-server and specdec accept). The client
measures the time to the first content chunk (TTFT) and to the end. The token count is the
final chunk's ``usage.completion_tokens``, or the number of content chunks when the server
sends no usage; speculative figures come from specdec's ``usage.speculative`` and are left
``None`` when absent. A batch size B is B requests in flight at once, until all are done.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from typing import Optional

import httpx

from ..errors import SpecdecError
from .prompts import Conversation
from .results import Sample


class OpenAIServer:
    """An OpenAI-compatible server at ``base_url`` (with or without the ``/v1`` suffix)."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = 600.0):
        root = base_url.rstrip("/")
        self.base_url = root if root.endswith("/v1") else root + "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    def close(self) -> None:
        self.http.close()

    def first_model(self) -> str:
        """The first model ``GET /models`` lists (what to ask for when the user named none)."""
        data = self._json(self._call("GET", "/models"))
        try:
            return data["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise SpecdecError(f"--base-url: {self.base_url}/models lists no model; name one with --model") from None

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise SpecdecError(f"--base-url: cannot reach {self.base_url}{path}: {exc}") from None
        if response.status_code >= 400:
            raise SpecdecError(f"--base-url: {method} {self.base_url}{path} answered {response.status_code}: "
                               f"{response.text[:300].strip()}")
        return response

    def _json(self, response: httpx.Response):
        try:
            return response.json()
        except ValueError:
            raise SpecdecError(f"--base-url: {response.request.url} answered no JSON") from None

    def stream_chat(self, body: dict, on_text=None) -> dict:
        """One streamed chat completion. Returns ``{"text", "ttft_s", "elapsed_s", "completion_tokens",
        "speculative"}`` (``speculative``: the server's ``usage.speculative``, or None);
        ``on_text`` is called with each piece of text as it comes."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first, chunks, pieces, usage = None, 0, [], None
        try:
            with self.http.stream("POST", "/chat/completions", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise SpecdecError(f"--base-url: POST {self.base_url}/chat/completions answered "
                                       f"{response.status_code}: {response.text[:300].strip()}")
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    try:
                        chunk = json.loads(payload)
                    except json.JSONDecodeError:
                        raise SpecdecError(f"--base-url: the stream sent something that is not JSON: "
                                           f"{payload[:200]!r}") from None
                    if chunk.get("error"):  # an error event mid-stream (vLLM, llama-server, specdec)
                        error = json.dumps(chunk["error"])[:300]
                        raise SpecdecError(f"--base-url: the server failed the request: {error}")
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            first = first or time.perf_counter()
                            chunks += 1
                            pieces.append(text)
                            if on_text is not None:
                                on_text(text)
        except httpx.HTTPError as exc:
            raise SpecdecError(f"--base-url: the request to {self.base_url}/chat/completions failed: {exc}") from None
        end = time.perf_counter()
        tokens = usage.get("completion_tokens") if usage else None
        return {"text": "".join(pieces), "ttft_s": (first or end) - start, "elapsed_s": end - start,
                "completion_tokens": tokens if isinstance(tokens, int) else chunks,
                "speculative": (usage or {}).get("speculative")}


def sample_of(method: str, batch_size: int, index: int, result: dict) -> Sample:
    """The :class:`Sample` of one streamed request (speculative figures when the server sent them)."""
    spec = result["speculative"]
    sample = Sample(method=method, batch_size=batch_size, prompt_index=index,
                    completion_tokens=result["completion_tokens"], ttft_s=result["ttft_s"],
                    elapsed_s=result["elapsed_s"])
    if isinstance(spec, dict) and isinstance(spec.get("accepted_per_position"), list):
        # usage.speculative has no step count: tokens / (tokens per step) gives it back
        length = spec.get("mean_acceptance_length") or 0
        sample.num_steps = round(sample.completion_tokens / length) if length else 0
        sample.num_drafts = spec.get("num_drafts", 0)
        sample.accepted_per_position = list(spec["accepted_per_position"])
    return sample


def run_remote(server: OpenAIServer, label: str, request_body: dict, conversations: list[Conversation],
               batch_sizes: list[int], progress: bool = True) -> tuple[list[Sample], dict]:
    """For each batch size B, max(len(conversations), B) requests (the conversations cycled),
    B of them in flight at once; returns the samples (method ``label``) and each batch size's
    wall time. ``request_body`` holds the fields every request shares (model, max_tokens, ...)."""
    from tqdm import tqdm

    server.stream_chat({**request_body, "messages": conversations[0], "max_tokens": 4})  # warm-up
    samples, walls = [], {}
    total = sum(max(len(conversations), size) for size in batch_sizes)
    # disable=None: no bar when stderr is no terminal (a log file)
    with tqdm(total=total, desc="bench", unit="req", file=sys.stderr, leave=False,
              disable=None if progress else True) as bar:
        for size in batch_sizes:
            todo: queue.Queue = queue.Queue()
            for i in range(max(len(conversations), size)):
                todo.put(i % len(conversations))
            done, failures = [], []

            def client():
                while not failures:  # one failed request ends the run
                    try:
                        index = todo.get_nowait()
                    except queue.Empty:
                        return
                    try:
                        result = server.stream_chat({**request_body, "messages": conversations[index]})
                    except SpecdecError as exc:
                        failures.append(exc)
                        return
                    done.append(sample_of(label, size, index, result))
                    bar.update(1)

            start = time.perf_counter()
            threads = [threading.Thread(target=client, daemon=True) for _ in range(size)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            walls[(label, size)] = time.perf_counter() - start
            if failures:
                raise failures[0]
            samples.extend(sorted(done, key=lambda s: s.prompt_index))
    return samples, walls
