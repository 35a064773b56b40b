"""The target's hidden states that a request's proposer has not seen yet (for proposers with
``NEEDS_HIDDEN_STATES``; docs/architecture.md, "The data of a step").

After each forward pass the engine keeps, per request, the rows whose next token is decided: a
prefill chunk's rows at once, a decoding request's fed rows and accepted draft rows once
verification has decided them. The next proposal hands them over and forgets them.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class PendingHiddenStates:
    """Hidden-state rows per request, waiting for the request's next proposal."""

    def __init__(self, paddle: Any, hidden_size: int):
        self.paddle = paddle
        self.hidden_size = hidden_size
        self._parts: dict[int, list[tuple[np.ndarray, Any]]] = {}

    def keep(self, request: Any, hidden: Any, first_row: int, first_position: int, count: int) -> None:
        """Keep rows ``first_row .. first_row + count - 1`` of the step's ``[T, H]`` ``hidden``,
        the states at positions ``first_position ..`` of ``request``."""
        if count <= 0:
            return
        positions = np.arange(first_position, first_position + count, dtype=np.int64)
        self._parts.setdefault(id(request), []).append((positions, hidden[first_row: first_row + count]))

    def take(self, request: Any) -> tuple[Any, np.ndarray]:
        """``([n, H] paddle tensor, [n] positions)`` kept for ``request`` since the last call."""
        parts = self._parts.pop(id(request), [])
        if not parts:
            return self.paddle.zeros([0, self.hidden_size], dtype="float32"), np.zeros(0, dtype=np.int64)
        if len(parts) == 1:
            return parts[0][1], parts[0][0]
        return (self.paddle.concat([states for _, states in parts], axis=0),
                np.concatenate([positions for positions, _ in parts]))

    def drop(self, request: Any) -> None:
        """Forget ``request``'s rows (it finished, or was preempted and will recompute them)."""
        self._parts.pop(id(request), None)

    def __len__(self) -> int:
        return len(self._parts)
