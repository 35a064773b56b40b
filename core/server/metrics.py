"""The server's Prometheus metrics (``GET /metrics``), on a registry of its own.

Counters are updated by the engine thread after every step, so they are live while requests
run: tokens and the speculative counters as they are produced, a request when it finishes.
docs/server.md lists every metric.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..metrics import SpecMetrics

PREFIX = "specdec_"

# Seconds; the model runs ~20 ms a decode step on a small CPU and far less on a GPU.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class Totals:
    """Counters of a server since it started (:meth:`ServerMetrics.totals`)."""

    prompt_tokens: int
    generation_tokens: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    steps: int
    emitted_tokens: int
    accepted_per_position: tuple


class ServerMetrics:
    """Every metric of one server. Thread-safe (prometheus_client counters are).

    :param model_name: the served model name, a label on every metric.
    :param state: returns the engine loop's :class:`~specdec.server.engine_loop.LoopSnapshot`
        (for the gauges read at scrape time); may be set later with :meth:`watch`.
    """

    def __init__(self, model_name: str, state: Optional[Callable] = None):
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._draft_tokens = 0
        self._accepted_tokens = 0
        self._steps = 0
        self._emitted = 0
        self._drafts_total = 0
        self._prompt_total = 0
        self._generated_total = 0
        self._per_position_total: list[int] = []
        self._state = state
        labels = ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, labels + list(extra), registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        def gauge(name, doc, function):
            metric = Gauge(PREFIX + name, doc, labels, registry=self.registry)
            metric.labels(model_name).set_function(function)

        self._requests = counter("requests", "Requests finished, by finish reason (stop, length, abort, error).",
                                 ["finish_reason"])
        self._rejected = counter("requests_rejected", "Requests refused with an HTTP error, by status code.",
                                 ["status"])
        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests admitted.")
        self._generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._ttft = histogram("time_to_first_token_seconds",
                               "From submission to the first generated token.", _TTFT_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds",
                              "From submission to the end of the request.", _LATENCY_BUCKETS)
        self._tpot = histogram("time_per_output_token_seconds",
                               "Per token after the first: (end - first token) / (tokens - 1).", _TPOT_BUCKETS)
        self._drafts = counter("spec_decode_num_drafts", "Drafts proposed (one request's drafts in one step).")
        self._draft_tokens_counter = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self._accepted_counter = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._per_position = counter("spec_decode_num_accepted_tokens_per_pos",
                                     "Drafts whose token at this position (0 = first) was accepted.",
                                     ["position"])
        gauge("spec_decode_acceptance_rate", "Accepted draft tokens / proposed draft tokens, since start.",
              lambda: self._accepted_tokens / self._draft_tokens if self._draft_tokens else 0.0)
        gauge("spec_decode_mean_acceptance_length", "Tokens emitted per target forward pass, since start.",
              lambda: self._emitted / self._steps if self._steps else 0.0)
        gauge("requests_in_flight", "Requests submitted and not finished (queued, waiting or running).",
              lambda: self._read_state("num_pending"))
        gauge("kv_blocks_free", "Free KV cache blocks.", lambda: self._read_state("num_free_kv_blocks"))
        gauge("kv_blocks_total", "KV cache blocks in the pool.", lambda: self._read_state("num_kv_blocks"))
        self.model_name = model_name
        for metric in (self._prompt_tokens, self._generation_tokens, self._ttft, self._e2e, self._tpot, self._drafts,
                       self._draft_tokens_counter, self._accepted_counter):
            metric.labels(model_name)  # listed (at 0) from the start

    def watch(self, state: Callable) -> None:
        """Read the gauges of the engine state from ``state()`` (a LoopSnapshot) at scrape time."""
        self._state = state

    def _read_state(self, name: str) -> float:
        return float(getattr(self._state(), name)) if self._state is not None else 0.0

    # -- recording (called by the engine thread and the app) -------------------------------------

    def request_admitted(self, num_prompt_tokens: int) -> None:
        self._prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)
        with self._lock:
            self._prompt_total += num_prompt_tokens

    def request_rejected(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    def first_token(self, seconds: float) -> None:
        self._ttft.labels(self.model_name).observe(seconds)

    def tokens_generated(self, count: int) -> None:
        self._generation_tokens.labels(self.model_name).inc(count)
        with self._lock:
            self._generated_total += count

    def speculation(self, now: SpecMetrics, before: SpecMetrics) -> None:
        """Add what a request's counters gained between two steps (``before`` -> ``now``)."""
        name = self.model_name
        drafts = now.num_drafts - before.num_drafts
        draft_tokens = now.num_draft_tokens - before.num_draft_tokens
        accepted = now.num_accepted_tokens - before.num_accepted_tokens
        if drafts:
            self._drafts.labels(name).inc(drafts)
            self._draft_tokens_counter.labels(name).inc(draft_tokens)
        if accepted:
            self._accepted_counter.labels(name).inc(accepted)
        gained = []
        for position, count in enumerate(now.accepted_per_position):
            seen = before.accepted_per_position[position] if position < len(before.accepted_per_position) else 0
            gained.append(max(0, count - seen))
            if count > seen:
                self._per_position.labels(name, str(position)).inc(count - seen)
        with self._lock:
            self._drafts_total += drafts
            for position, count in enumerate(gained):
                if position == len(self._per_position_total):
                    self._per_position_total.append(0)
                self._per_position_total[position] += count
            self._draft_tokens += draft_tokens
            self._accepted_tokens += accepted
            self._steps += now.num_steps - before.num_steps
            self._emitted += now.num_emitted_tokens - before.num_emitted_tokens

    def totals(self) -> "Totals":
        """The counters since start, read together (the stats line's differences)."""
        with self._lock:
            return Totals(self._prompt_total, self._generated_total, self._drafts_total, self._draft_tokens,
                          self._accepted_tokens, self._steps, self._emitted, tuple(self._per_position_total))

    def request_finished(self, finish_reason: str, latency_s: float, per_token_s: Optional[float]) -> None:
        name = self.model_name
        self._requests.labels(name, finish_reason).inc()
        self._e2e.labels(name).observe(latency_s)
        if per_token_s is not None:
            self._tpot.labels(name).observe(per_token_s)

    # -- exposition ------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
