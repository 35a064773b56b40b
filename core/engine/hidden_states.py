"""The target's hidden states that a request's proposer has not seen yet (for proposers with
``NEEDS_HIDDEN_STATES``; docs/architecture.md, "The data of a step").

After each forward pass the engine keeps, per request, the rows whose next token is decided: a
prefill chunk's rows at once, a decoding request's fed rows and accepted draft rows once
verification has decided them. The next proposal hands them over and forgets them.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..errors import SpecdecError


#: The positions of a request with no rows kept (read-only: shared).
_NO_POSITIONS = np.zeros(0, dtype=np.int64)
_NO_POSITIONS.flags.writeable = False


class PendingHiddenStates:
    """Hidden-state rows per request, waiting for the request's next proposal.

    A step's rows are kept as a reference to the step's tensor and where the request's rows lie
    in it, and sliced out when taken: a slice is a paddle op (several microseconds), and a large
    batch whose proposer is off for most requests (the drafting controller's doing) would pay one
    per request and step for rows most of which are taken much later, or never. A slice is a view
    of the step's tensor either way, so what is kept alive is the same."""

    def __init__(self, paddle: Any, hidden_size: int):
        self.paddle = paddle
        self.hidden_size = hidden_size
        # per request: (first position, the step's [T, H] tensor, first row, count) per step kept
        self._parts: dict[int, list[tuple[int, Any, int, int]]] = {}
        self._none = None  # the [0, H] tensor of a request with no rows kept, made once

    def keep(self, request: Any, hidden: Any, first_row: int, first_position: int, count: int) -> None:
        """Keep rows ``first_row .. first_row + count - 1`` of the step's ``[T, H]`` ``hidden``,
        the states at positions ``first_position ..`` of ``request``."""
        if count <= 0:
            return
        self._parts.setdefault(id(request), []).append((first_position, hidden, first_row, count))

    def take(self, request: Any) -> tuple[Any, np.ndarray]:
        """``([n, H] paddle tensor, [n] positions)`` kept for ``request`` since the last call."""
        parts = self._parts.pop(id(request), None)
        if not parts:  # (a paddle op costs tens of us on the caches a pass has just flushed)
            if self._none is None:
                self._none = self.paddle.zeros([0, self.hidden_size], dtype="float32")
            return self._none, _NO_POSITIONS
        if len(parts) == 1:  # one step's rows (a request proposed for every step): no concat
            first, hidden, row, count = parts[0]
            whole = row == 0 and count == hidden.shape[0]  # batch 1 with its drafts accepted: no slice either
            return (hidden if whole else hidden[row: row + count]), np.arange(first, first + count, dtype=np.int64)
        positions = np.concatenate([np.arange(first, first + count, dtype=np.int64) for first, _, _, count in parts])
        states = [hidden[row: row + count] for _, hidden, row, count in parts]
        return self.paddle.concat(states, axis=0), positions

    def drop(self, request: Any) -> None:
        """Forget ``request``'s rows (it finished, or was preempted and will recompute them)."""
        self._parts.pop(id(request), None)

    def __len__(self) -> int:
        return len(self._parts)


#: At most this many layers' states per row (EAGLE-3 reads three).
MAX_HIDDEN_LAYERS = 8


def hidden_state_layers(proposer: Any, num_layers: int) -> Optional[tuple[int, ...]]:
    """The layers whose input states ``proposer`` reads (``Proposer.hidden_state_layers``),
    checked against the target's ``num_layers``; None for the last layer's output alone (the
    default, and what a proposer without ``NEEDS_HIDDEN_STATES`` gets)."""
    if not proposer.NEEDS_HIDDEN_STATES:
        return None
    layers = proposer.hidden_state_layers()
    if layers is None:
        return None
    name = getattr(proposer, "NAME", type(proposer).__name__)
    try:
        layers = tuple(int(layer) for layer in layers)
    except (TypeError, ValueError):
        raise SpecdecError(f"speculative_config.method: proposer '{name}': hidden_state_layers() must return "
                           f"layer numbers, got {layers!r}") from None
    if not 0 < len(layers) <= MAX_HIDDEN_LAYERS or any(not 0 <= layer <= num_layers for layer in layers):
        raise SpecdecError(f"speculative_config.method: proposer '{name}': hidden_state_layers() must give 1 to "
                           f"{MAX_HIDDEN_LAYERS} layers in [0, {num_layers}] (the target's {num_layers} layers' "
                           f"inputs, {num_layers} its output), got {list(layers)}")
    return None if layers == (num_layers,) else layers
