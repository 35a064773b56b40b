"""Speculative decoding metrics, per request and summed over requests."""

from __future__ import annotations

import attrs
import numpy as np


@attrs.define(slots=True)
class SpecMetrics:
    """Counters of one request (or a sum of requests).

    ``num_steps`` counts target forward passes that emitted tokens (decode steps). A *draft* is
    one request's proposal in one step (counted when it has at least one token).
    ``accepted_per_position[i]`` counts the drafts whose token ``i`` was accepted.
    ``num_prediction_accepted`` / ``num_prediction_rejected`` count the draft tokens taken from
    the request's prediction (Predicted Outputs) that verification accepted / rejected; they
    are part of the draft counts too. ``num_proposer_off_steps`` counts the decode steps in
    which the controller did not call the proposer for the request (its drafts did not pay:
    docs/config.md, "Adaptive draft length").
    """

    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    accepted_per_position: list[int] = attrs.field(factory=list)
    num_prediction_accepted: int = 0
    num_prediction_rejected: int = 0
    num_proposer_off_steps: int = 0

    def record_step(self, draft_len: int, accepted: int, emitted: int, proposer_off: bool = False) -> None:
        self.num_steps += 1
        self.num_proposer_off_steps += proposer_off
        self.num_emitted_tokens += emitted
        if draft_len:
            self.num_drafts += 1
            self.num_draft_tokens += draft_len
            self.num_accepted_tokens += accepted
            if len(self.accepted_per_position) < draft_len:
                self.accepted_per_position.extend([0] * (draft_len - len(self.accepted_per_position)))
            for i in range(accepted):
                self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (0 when nothing was proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per target forward pass (1.0 for plain decoding)."""
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0

    def __add__(self, other: "SpecMetrics") -> "SpecMetrics":
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        per_position = np.zeros(width, dtype=np.int64)
        per_position[: len(self.accepted_per_position)] += np.asarray(self.accepted_per_position, dtype=np.int64)
        per_position[: len(other.accepted_per_position)] += np.asarray(other.accepted_per_position, dtype=np.int64)
        return SpecMetrics(
            num_steps=self.num_steps + other.num_steps,
            num_drafts=self.num_drafts + other.num_drafts,
            num_draft_tokens=self.num_draft_tokens + other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
            num_emitted_tokens=self.num_emitted_tokens + other.num_emitted_tokens,
            accepted_per_position=per_position.tolist(),
            num_prediction_accepted=self.num_prediction_accepted + other.num_prediction_accepted,
            num_prediction_rejected=self.num_prediction_rejected + other.num_prediction_rejected,
            num_proposer_off_steps=self.num_proposer_off_steps + other.num_proposer_off_steps,
        )

    @classmethod
    def total(cls, items) -> "SpecMetrics":
        result = cls()
        for item in items:
            result = result + item
        return result

    def to_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "num_proposer_off_steps": self.num_proposer_off_steps,
        }
