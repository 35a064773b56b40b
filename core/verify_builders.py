"""Building blocks of verify strategies and accept policies (part of :mod:`specdec.sdk`).

All of them work on the whole batch: ``drafts [B, k]``, ``lengths [B]``, rows ``[B, k+1]``.
"""

from __future__ import annotations

import numpy as np

from .proposer import DRAFT_PAD, Drafts
from .verify import VerifyInputs, VerifyResult


def check_inputs(inputs: VerifyInputs) -> None:
    """Raise ``ValueError`` when the logits do not have one row per draft plus one."""
    batch, width = inputs.drafts.token_ids.shape
    shape = inputs.logits_shape
    if len(shape) != 3 or shape[:2] != (batch, width + 1):
        raise ValueError(
            f"verify: logits of shape {shape} do not match drafts of shape "
            f"{(batch, width)}; expected ({batch}, {width + 1}, vocab)"
        )


def draft_mask(drafts: Drafts) -> np.ndarray:
    """``[B, k]`` bool: True where a position holds a real draft (not padding)."""
    return np.arange(drafts.width)[None, :] < drafts.lengths[:, None]


def accepted_prefix(match: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Length of the leading run of True in each row of ``match [B, k]``, capped by ``lengths``."""
    batch, width = match.shape
    valid = match & (np.arange(width)[None, :] < lengths[:, None])
    # argmin finds the first False; the appended False column stops rows that are all True.
    padded = np.concatenate([valid, np.zeros((batch, 1), dtype=bool)], axis=1)
    return np.argmin(padded, axis=1).astype(np.int64)


def assemble_output(draft_ids: np.ndarray, accepted: np.ndarray, next_tokens: np.ndarray) -> np.ndarray:
    """``[B, k+1]`` output rows: the accepted drafts, ``next_tokens[b]``, then ``DRAFT_PAD``."""
    batch, width = draft_ids.shape
    positions = np.arange(width + 1)[None, :]
    output = np.full((batch, width + 1), DRAFT_PAD, dtype=np.int64)
    output[:, :width] = np.where(positions[:, :width] < accepted[:, None], draft_ids, DRAFT_PAD)
    output[np.arange(batch), accepted] = next_tokens
    return output


def at_positions(rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``rows[b, positions[b]]`` for every ``b`` (``rows`` is ``[B, k+1, ...]``)."""
    return rows[np.arange(len(positions)), positions]


def pad_beyond_drafts(target_tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Write ``DRAFT_PAD`` into the rows past each request's drafts (they were padding logits)."""
    padding = np.arange(target_tokens.shape[1])[None, :] > lengths[:, None]
    return np.where(padding, DRAFT_PAD, target_tokens)


def prefix_match_result(drafts: Drafts, target_tokens: np.ndarray) -> VerifyResult:
    """Accept drafts while they equal ``target_tokens``; then emit the target token there.

    This is the whole of ``greedy`` (argmax targets) and ``target_match`` (sampled targets).
    """
    accepted = accepted_prefix(drafts.token_ids == target_tokens[:, :-1], drafts.lengths)
    return VerifyResult(
        accepted_lengths=accepted,
        output_tokens=assemble_output(drafts.token_ids, accepted, at_positions(target_tokens, accepted)),
        target_tokens=pad_beyond_drafts(target_tokens, drafts.lengths),
    )
