"""A request's state inside the engine, and the output handed back to users."""

from __future__ import annotations

import time
from typing import Any, Optional

import attrs
import numpy as np

from ..metrics import SpecMetrics
from ..sampling import SamplingParams


@attrs.define(slots=True)
class RequestOutput:
    """The result of one request (``specdec generate --output json`` prints these fields)."""

    request_id: str
    prompt: Optional[str]
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_generated_tokens: int
    elapsed_s: float
    finish_reason: str
    metrics: SpecMetrics
    #: Seconds from arrival to the first generated token (prefill, and any wait for a place in the batch).
    first_token_s: float = 0.0
    #: Why the request failed (``finish_reason`` ``error``): which phase raised what.
    error: Optional[str] = None

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first one, per second after the first one (decode speed alone)."""
        decode_time = self.elapsed_s - self.first_token_s
        return (self.num_generated_tokens - 1) / decode_time if decode_time > 0 else 0.0

    def to_dict(self) -> dict:
        data = {
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": self.token_ids,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "elapsed_s": round(self.elapsed_s, 4),
            "first_token_s": round(self.first_token_s, 4),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "finish_reason": self.finish_reason,
            "metrics": self.metrics.to_dict(),
        }
        if self.error is not None:
            data["error"] = self.error
        return data


@attrs.define(slots=True, eq=False)
class Request:
    """One request being served.

    The token buffer holds the prompt, then every generated token; ``num_tokens`` says how much
    of it is filled. The KV cache holds positions ``0 .. context_len - 1``; the last token is
    never in it yet: each step feeds it (plus the drafts) as the step's first row.
    """

    request_id: str
    prompt: Optional[str]
    sampling: SamplingParams
    tokens: np.ndarray
    num_prompt_tokens: int
    num_tokens: int
    rng: np.random.Generator
    detokenizer: object
    arrival_time: float = attrs.field(factory=time.perf_counter)
    context_len: int = 0
    #: KV cache blocks holding positions ``block_size * i ..`` (see ``kv_cache.py``).
    block_table: list = attrs.field(factory=list)
    #: Prefix-cache keys of the prompt's full blocks (computed on first admission).
    prefix_keys: Optional[list] = None
    #: Prompt blocks already offered to the prefix cache.
    num_registered: int = 0
    #: Whether the proposer has seen ``on_request_start`` (a preempted request keeps its state).
    started: bool = False
    #: Times the request lost its KV cache to make room, and was recomputed.
    num_preemptions: int = 0
    #: ``stop``, ``length``, ``abort``, ``handoff`` (handed to another engine: see
    #: ``handoff_state``), or ``error`` (then ``error`` says why); None while running.
    finish_reason: Optional[str] = None
    #: Why the request failed: the phase of the step and the exception it raised.
    error: Optional[str] = None
    text: str = ""
    metrics: SpecMetrics = attrs.field(factory=SpecMetrics)
    finish_time: float = 0.0
    first_token_time: float = 0.0
    #: Run the prompt and the first token only, then hand the request over (``add_request``).
    handoff: bool = False
    #: Collect the target's hidden states of the prompt for the hand-off.
    capture_hidden: bool = False
    #: With finish reason ``handoff``: the :class:`~specdec.engine.handoff.HandoffState` to import elsewhere.
    handoff_state: Any = None
    #: For a request from ``Engine.import_request``: True when its KV cache was imported, False
    #: when it is recomputed (no seat or blocks free then); False for any other request.
    kv_imported: bool = False
    #: Who sent it (``add_request(tenant=...)``), for the proposer: see ``ProposalRequest.tenant``.
    tenant: Optional[str] = None

    @property
    def token_ids(self) -> np.ndarray:
        return self.tokens[: self.num_tokens]

    @property
    def generated_ids(self) -> np.ndarray:
        return self.tokens[self.num_prompt_tokens: self.num_tokens]

    @property
    def num_generated(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def remaining(self) -> int:
        return self.sampling.max_tokens - self.num_generated

    @property
    def num_uncomputed(self) -> int:
        """Tokens not in the KV cache yet (1 for a request that is decoding)."""
        return self.num_tokens - self.context_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            text=self.text,
            token_ids=self.generated_ids.tolist(),
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated,
            elapsed_s=(self.finish_time or time.perf_counter()) - self.arrival_time,
            finish_reason=self.finish_reason or "",
            metrics=self.metrics,
            first_token_s=(self.first_token_time - self.arrival_time) if self.first_token_time else 0.0,
            error=self.error,
        )
