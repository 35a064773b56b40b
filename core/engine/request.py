"""A request's state inside the engine, and the output handed back to users."""

from __future__ import annotations

import time
from typing import Any, Optional

import attrs
import numpy as np

from ..metrics import SpecMetrics
from ..sampling import SamplingParams

#: How a generated token came, by its code in :attr:`Request.token_sources`: ``decode``, a step
#: without drafts; ``draft``, a draft the target accepted; ``bonus``, the token the target
#: itself chose at the end of a speculative step (the correction of a rejected draft, or the
#: bonus token after the accepted ones).
TOKEN_SOURCES = ("decode", "draft", "bonus")
DECODE, DRAFT, BONUS = range(3)


def step_sources(draft_len: int, accepted: int, emitted: int) -> bytes:
    """The source codes of the ``emitted`` tokens of one step that verified ``draft_len``
    drafts and accepted ``accepted``: the accepted drafts, then the target's own token (cut at
    ``emitted``, which an EOS or a limit can make shorter than ``accepted + 1``)."""
    drafts = min(accepted, emitted)
    return bytes([DRAFT]) * drafts + bytes([BONUS if draft_len else DECODE]) * (emitted - drafts)


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
    #: Per generated token, a :class:`~specdec.engine.logprobs.TokenLogprob` when the request
    #: asked for ``logprobs``; not in to_dict().
    logprobs: Optional[list] = None

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
    #: Whether the proposer was called for the request at its last decode step (a call that
    #: is not the next after one catches up: see ``Engine._catching_up``).
    proposed_last_step: bool = False
    #: How many of its tokens the proposer has been shown (``num_tokens`` at its last
    #: proposal; 0 before the first and after a preemption): what a catch-up runs over.
    proposed_through: int = 0
    #: The positions below which a proposer that reads hidden states has been handed every
    #: state at a proposal (0 before the first and after a preemption): its own cache rows
    #: are there, and the prompt blocks below join the prefix cache (``Engine._register_computed``).
    states_handed_through: int = 0
    #: Hidden-state rows handed to the proposer at the end of its last step
    #: (``Proposer.catch_up``), which its next proposal counts as handed then.
    rows_caught_up: int = 0
    #: ``stop``, ``length``, ``abort``, ``handoff`` (handed to another engine: see
    #: ``handoff_state``), or ``error`` (then ``error`` says why); None while running.
    finish_reason: Optional[str] = None
    #: Why the request failed: the phase of the step and the exception it raised.
    error: Optional[str] = None
    text: str = ""
    #: One code per generated token (``TOKEN_SOURCES``): how each came. Tokens generated by
    #: another engine before a hand-off count as ``decode``.
    token_sources: bytearray = attrs.field(factory=bytearray)
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
    #: The request's :class:`~specdec.engine.logits_processing.RowProcessor` s, applied in
    #: order to its logits at every verified row (penalties, logit bias, min-p, grammars);
    #: empty for a request that needs none, which then costs nothing.
    row_processors: list = attrs.field(factory=list)
    #: With ``sampling.logprobs`` set: a :class:`~specdec.engine.logprobs.TokenLogprob` per
    #: generated token, in order; None otherwise.
    logprobs: Optional[list] = None

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
            logprobs=None if self.logprobs is None else list(self.logprobs),
        )
