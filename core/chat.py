"""The two ends ``specdec chat`` can talk to: a model loaded in this process, or an
OpenAI-compatible server. Both keep nothing between answers (the conversation is the
caller's), stream the answer's text as it comes, and return a :class:`Reply` with its speed
and, where known, what speculation did.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import attrs

from .errors import SpecdecError
from .sampling import SamplingParams

OnText = Callable[[str], None]


@attrs.define
class Reply:
    """One answer: its text, tokens, timings (seconds) and speculative figures (None: unknown)."""

    text: str
    completion_tokens: int
    ttft_s: float
    elapsed_s: float
    mean_acceptance_length: Optional[float] = None
    accepted_per_position: Optional[list[float]] = None

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


class LocalChat:
    """A :class:`specdec.LLM` in this process; ``/method`` switches its speculative method."""

    def __init__(self, llm):
        self.llm = llm

    @property
    def method(self) -> str:
        return self.llm.speculative_config.method

    def set_method(self, name: str) -> None:
        """Speculate with method ``name`` from now on (its demo settings where it has some)."""
        from .demo import demo_methods

        plugins = self.llm.engine.plugins
        if name not in plugins.proposers.names():
            raise SpecdecError(f"/method: unknown method {name!r}; installed: "
                               f"{', '.join(sorted(plugins.proposers.names()))}")
        self.llm.set_speculative_config(demo_methods(plugins).get(name, {"method": name}))

    def answer(self, messages: list[dict], sampling: SamplingParams, on_text: OnText) -> Reply:
        engine = self.llm.engine
        request = engine.add_request(self.llm.tokenizer.encode_chat(messages), sampling)
        shown = 0
        try:
            while not request.finished:
                engine.step()
                if len(request.text) > shown:
                    on_text(request.text[shown:])
                    shown = len(request.text)
        except KeyboardInterrupt:  # Ctrl-C stops this answer; the engine stays usable
            engine.abort_request(request.request_id)
            raise
        output = request.output()
        if len(output.text) > shown:
            on_text(output.text[shown:])
        metrics = output.metrics
        per_position = ([count / metrics.num_drafts for count in metrics.accepted_per_position]
                        if metrics.num_drafts else None)
        return Reply(text=output.text, completion_tokens=output.num_generated_tokens, ttft_s=output.first_token_s,
                     elapsed_s=output.elapsed_s, mean_acceptance_length=metrics.mean_acceptance_length,
                     accepted_per_position=per_position)


class RemoteChat:
    """An OpenAI-compatible server (streamed chat completions, standard fields only)."""

    def __init__(self, base_url: str, api_key: Optional[str], model: Optional[str], timeout: float = 600.0):
        from .bench.remote import OpenAIServer

        self.server = OpenAIServer(base_url, api_key, timeout=timeout)
        self.model = model or self.server.first_model()
        self.method = f"the server's ({self.model})"

    def set_method(self, name: str) -> None:
        raise SpecdecError("/method: a server's method is set when it starts (its --speculative-config)")

    def answer(self, messages: list[dict], sampling: SamplingParams, on_text: OnText) -> Reply:
        body = {"model": self.model, "messages": messages, "max_tokens": sampling.max_tokens,
                "temperature": sampling.temperature}
        start = time.perf_counter()
        result = self.server.stream_chat(body, on_text=on_text)
        spec = result["speculative"] or {}
        drafts = spec.get("num_drafts")
        per_position = ([count / drafts for count in spec["accepted_per_position"]]
                        if drafts and isinstance(spec.get("accepted_per_position"), list) else None)
        return Reply(text=result["text"], completion_tokens=result["completion_tokens"], ttft_s=result["ttft_s"],
                     elapsed_s=time.perf_counter() - start, mean_acceptance_length=spec.get("mean_acceptance_length"),
                     accepted_per_position=per_position)

    def close(self) -> None:
        self.server.close()
