"""Records read from Redis that the cluster skips, and the account it keeps of them.

Anyone who can write to the cluster's Redis can put anything under its keys: a value that is
not JSON, a field of the wrong type, a number out of bounds, a record without the cluster
secret's signature. The readers (the registry, the job runner) parse each record alone and
skip a bad one (:class:`BadRecord`); :class:`BadRecords` counts it and logs it once, however
often it is read again (a registration is read every heartbeat), so that a flood of bad records
can neither stop the cluster nor bury its log.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from typing import Callable, Optional

logger = logging.getLogger("specdec.cluster")

#: Why a record was skipped (the ``reason`` label of ``specdec_cluster_bad_records_total``).
REASONS = ("malformed", "signature", "field", "expiry")


class BadRecord(ValueError):
    """A record that is skipped: ``reason`` one of :data:`REASONS`, the message says what."""

    def __init__(self, reason: str, message: str):
        assert reason in REASONS, reason
        super().__init__(message)
        self.reason = reason


class BadRecords:
    """Counts and logs skipped records: each distinct one (its key and value) once.

    :param remember: how many distinct bad records are remembered (older ones may count again).
    :param log_per_minute: log lines at most per minute; the rest are summed up in the next one.
    """

    def __init__(self, remember: int = 4096, log_per_minute: int = 10):
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._remember = remember
        self._log_per_minute = log_per_minute
        self._window_start = time.monotonic()
        self._logged_in_window = 0
        self._suppressed = 0
        #: ``on_count(kind, reason)`` for each distinct bad record (the server's counter).
        self.on_count: Optional[Callable[[str, str], None]] = None
        #: Distinct bad records seen, by ``(kind, reason)``.
        self.counts: dict[tuple[str, str], int] = {}

    def report(self, kind: str, key: str, value: bytes, problem: BadRecord) -> None:
        """A record of ``kind`` (``registration``, ``job``) under ``key`` was skipped."""
        digest = hashlib.sha256(key.encode() + b"\0" + value).digest()
        if digest in self._seen:
            self._seen.move_to_end(digest)
            return
        self._seen[digest] = None
        if len(self._seen) > self._remember:
            self._seen.popitem(last=False)
        self.counts[(kind, problem.reason)] = self.counts.get((kind, problem.reason), 0) + 1
        if self.on_count is not None:
            self.on_count(kind, problem.reason)
        self._log(kind, key, problem)

    def _log(self, kind: str, key: str, problem: BadRecord) -> None:
        now = time.monotonic()
        if now - self._window_start >= 60.0:
            self._window_start, self._logged_in_window = now, 0
        if self._logged_in_window >= self._log_per_minute:
            self._suppressed += 1
            return
        self._logged_in_window += 1
        more = f" ({self._suppressed} more bad records not logged)" if self._suppressed else ""
        self._suppressed = 0
        logger.warning("skipped a bad %s in Redis, %s: %s%s", kind, _printable(key), _printable(str(problem)), more)


def _printable(text: str, limit: int = 200) -> str:
    """``text`` safe for one log line (a key is whatever a writer of Redis chose)."""
    shown = text.encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= limit else shown[:limit] + "..."
