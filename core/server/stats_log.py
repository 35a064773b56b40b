"""What ``specdec serve`` logs on its own: specdec's loggers at ``--log-level``, and a stats
line every :data:`STATS_INTERVAL_S` seconds while the server is busy, as vLLM prints one:

    specdec stats: 3 requests in flight | prompt 412.0 tok/s, generation 88.5 tok/s |
    drafts accepted 61% (2.43 tokens a step; by position 0.83 0.64 0.47) | KV cache 7.8% used

The figures are those of the last interval, from the counters ``/metrics`` exports
(:class:`~specdec.server.metrics.ServerMetrics`); an idle server prints nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from .metrics import ServerMetrics, Totals

logger = logging.getLogger("specdec.stats")

#: Seconds between two stats lines.
STATS_INTERVAL_S = 10.0


def configure_logging(level: str) -> None:
    """Send specdec's own loggers (``specdec.*``: engine, server, cluster, plugins) to stderr at
    ``level`` (``--log-level``), in uvicorn's format, unless something configured them already."""
    root = logging.getLogger("specdec")
    root.setLevel(level.upper())
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)-9s %(message)s"))
        root.addHandler(handler)
        root.propagate = False


def stats_line(before: Totals, after: Totals, seconds: float, snapshot) -> Optional[str]:
    """The line for one interval, or None when nothing ran in it and nothing is in flight."""
    generated = after.generation_tokens - before.generation_tokens
    if generated == 0 and snapshot.num_pending == 0:
        return None
    prompt = after.prompt_tokens - before.prompt_tokens
    parts = [f"{snapshot.num_pending} requests in flight",
             f"prompt {prompt / seconds:.1f} tok/s, generation {generated / seconds:.1f} tok/s"]
    draft_tokens = after.draft_tokens - before.draft_tokens
    steps = after.steps - before.steps
    if draft_tokens and steps:
        drafts = after.drafts - before.drafts
        accepted = after.accepted_tokens - before.accepted_tokens
        emitted = after.emitted_tokens - before.emitted_tokens
        by_position = [(now - (before.accepted_per_position[i] if i < len(before.accepted_per_position) else 0))
                       / drafts for i, now in enumerate(after.accepted_per_position)] if drafts else []
        positions = " ".join(f"{rate:.2f}" for rate in by_position)
        parts.append(f"drafts accepted {accepted / draft_tokens:.0%} ({emitted / steps:.2f} tokens a step"
                     f"{f'; by position {positions}' if positions else ''})")
    if snapshot.num_kv_blocks:
        used = 1 - snapshot.num_free_kv_blocks / snapshot.num_kv_blocks
        parts.append(f"KV cache {used:.1%} used")
    return "specdec stats: " + " | ".join(parts)


class StatsLogger:
    """A daemon thread that logs :func:`stats_line` every ``interval`` seconds (INFO, logger
    ``specdec.stats``) until :meth:`close`."""

    def __init__(self, metrics: ServerMetrics, snapshot: Callable, interval: float = STATS_INTERVAL_S):
        self.metrics, self.snapshot, self.interval = metrics, snapshot, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdec-stats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        before, started = self.metrics.totals(), time.monotonic()
        while not self._stop.wait(self.interval):
            after, now = self.metrics.totals(), time.monotonic()
            line = stats_line(before, after, now - started, self.snapshot())
            if line:
                logger.info(line)
            before, started = after, now

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
