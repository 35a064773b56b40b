"""The step watchdog: notices an engine step that runs far longer than any step should.

Plugins run inside the engine's step, on the engine thread. A proposer that loops or blocks
(a network call without a timeout, a deadlock) would hold every request of the server, and
``/health`` would still say ok. The engine thread marks where each step begins and ends
(:meth:`StepWatchdog.begin`, :meth:`StepWatchdog.end`); the watchdog's own thread looks at the
step in progress a few times per timeout and, once it has run longer than ``timeout``
seconds, calls ``on_stall(seconds)``, once per step. The engine loop then fails the requests
in flight and ``/health`` answers 503 until the step returns, if it ever does.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

#: ``--step-timeout``: seconds one engine step may run before the server counts as stalled.
#: Far above any real step, so that only a plugin that hangs reaches it: a step feeds at most
#: ``max_num_batched_tokens`` rows (2048), and a full 2048-row prefill chunk of the default
#: model took about 10 s on two CPU cores that five other jobs shared.
DEFAULT_STEP_TIMEOUT = 300.0


class StepWatchdog:
    """Watches the engine thread's steps against ``timeout`` seconds.

    :param timeout: how long one step may run.
    :param on_stall: called with the seconds the step has run, from the watchdog's thread,
        once per step that runs past ``timeout``. It runs under the watchdog's lock, so the
        engine thread's :meth:`end` waits for it: when :meth:`end` returns True, ``on_stall``
        has done all it does. It must therefore be quick and must not call :meth:`end`.
    """

    def __init__(self, timeout: float, on_stall: Callable[[float], None]):
        if timeout <= 0:
            raise ValueError(f"the step timeout must be > 0, got {timeout}")
        self.timeout = timeout
        self._on_stall = on_stall
        self._interval = min(1.0, timeout / 4)
        self._lock = threading.Lock()
        self._started: Optional[float] = None  # monotonic time the step in progress began
        self._stalled = False  # on_stall was called for the step in progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="specdec-step-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def begin(self) -> None:
        """A step begins (on the engine thread)."""
        with self._lock:
            self._started, self._stalled = time.monotonic(), False

    def end(self) -> bool:
        """The step has ended (on the engine thread); True when it was declared stalled."""
        with self._lock:
            stalled = self._stalled
            self._started, self._stalled = None, False
        return stalled

    def check(self) -> None:
        """Call ``on_stall`` if the step in progress has run past the timeout (and it has not
        been called for this step yet)."""
        with self._lock:
            if self._started is None or self._stalled:
                return
            seconds = time.monotonic() - self._started
            if seconds <= self.timeout:
                return
            self._stalled = True
            self._on_stall(seconds)

    def _watch(self) -> None:
        while not self._stop.wait(self._interval):
            self.check()
