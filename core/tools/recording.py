"""Recording the target's hidden states: the data model-based proposers are trained on.

``specdec train-mtp`` and third-party trainers (Medusa, EAGLE) need, for text the target reads
or writes itself, its last-layer hidden state at every position and its own argmax there (the
token a draft must equal to be accepted). :class:`HiddenStateRecorder` runs the target through
the public engine with a recording proposer on the public contract (``NEEDS_HIDDEN_STATES``),
so the states are exactly those the engine hands proposers at inference.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

import attrs
import numpy as np

from ..proposer import Drafts, ProposalBatch, Proposer


@attrs.define
class RecordedSequence:
    """One sequence: ``tokens [m]`` int64, ``states [m, H]`` float16 (the target's last-layer
    hidden state at each position, before the final norm) and ``labels [m]`` int64 (the
    target's argmax at each position: its prediction of the token after it)."""

    tokens: np.ndarray
    states: np.ndarray
    labels: np.ndarray


class _RecordingProposer(Proposer):
    """Drafts nothing; keeps each request's hidden states and the target's argmax there."""

    NAME = "_record_hidden_states"
    NEEDS_HIDDEN_STATES = True

    def setup(self, context) -> None:
        self.context = context
        self.parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}

    def propose(self, batch: ProposalBatch) -> Drafts:
        for request in batch.requests:
            if len(request.hidden_positions):
                logits = self.context.target.logits(request.hidden_states)
                labels = np.asarray(logits.argmax(axis=-1), dtype=np.int64)
                self.parts.setdefault(request.request_id, []).append(
                    (np.asarray(request.hidden_positions).copy(),
                     np.asarray(request.hidden_states, dtype=np.float16), labels))
        return Drafts.empty(len(batch))


class HiddenStateRecorder:
    """The target loaded once, recording: :meth:`record` runs token sequences through it.

    The prefix cache is off (every position is computed, so every state is recorded). The
    target's :class:`specdec.ProposerContext` is :attr:`context` (``target`` for its LM head,
    ``model_config`` for its shape), and :attr:`llm` is the :class:`specdec.LLM`, for
    ``encode_prompt`` or to switch to a trained proposer afterwards.
    """

    def __init__(self, model: Optional[str], batch_size: int = 32, progress: bool = True):
        """``model``: as :class:`specdec.LLM` takes it (None: the default model)."""
        from ..api import LLM
        from ..plugin_manager import load_plugins

        plugins = load_plugins()
        plugins.proposers.register(_RecordingProposer, "specdec.tools.recording")
        # adaptive_draft_length off: the controller would leave a proposer that drafts nothing
        # out of steps, and the states of a request that finishes meanwhile would be lost.
        self.llm = LLM(model, {"method": _RecordingProposer.NAME, "adaptive_draft_length": False}, plugins=plugins, progress=progress,
                       enable_prefix_caching=False, max_num_seqs=batch_size)
        self._proposer: _RecordingProposer = self.llm.engine.proposer
        self.context = self._proposer.context
        self.batch_size, self.progress = batch_size, progress

    def prompts(self, prompts: Sequence[str], max_tokens: int) -> list[tuple[list[int], int]]:
        """Requests for :meth:`record`: each prompt through the chat template, answered by the
        target in up to ``max_tokens`` tokens (its own answers are the best training data)."""
        return [(self.llm.encode_prompt(prompt, use_chat_template=True), max_tokens) for prompt in prompts]

    def texts(self, texts: Sequence[str], window: int) -> list[tuple[list[int], int]]:
        """Requests for :meth:`record`: each text read in windows of ``window`` tokens."""
        requests = []
        for text in texts:
            ids = self.llm.tokenizer.encode(text)
            # 2 tokens: the second step hands over the states of every prompt position.
            requests.extend((ids[start: start + window], 2) for start in range(0, max(len(ids) - 8, 1), window))
        return requests

    def record(self, requests: Sequence[tuple[list[int], int]]) -> list[RecordedSequence]:
        """Run ``(token ids, max_tokens)`` requests greedily; return one sequence per request
        with at least 8 recorded positions (the prompt, then the generated tokens)."""
        from ..sampling import SamplingParams

        sequences = []
        chunk_size = 4 * self.batch_size
        for start in range(0, len(requests), chunk_size):
            chunk = list(requests[start: start + chunk_size])
            outputs = self.llm.generate([ids for ids, _ in chunk],
                                        [SamplingParams(max_tokens=n, temperature=0.0) for _, n in chunk],
                                        progress=self.progress)
            for (ids, _), output in zip(chunk, outputs):
                parts = self._proposer.parts.pop(output.request_id, [])
                if not parts:
                    continue
                positions = np.concatenate([p for p, _, _ in parts])
                if len(positions) < 8 or not np.array_equal(positions, np.arange(len(positions))):
                    continue  # too short, or recomputed after a preemption
                tokens = np.array(list(ids) + list(output.token_ids), dtype=np.int64)[: len(positions)]
                sequences.append(RecordedSequence(tokens, np.concatenate([s for _, s, _ in parts]),
                                                  np.concatenate([lab for _, _, lab in parts])))
            if self.progress:
                print(f"recorded {sum(len(s.tokens) for s in sequences)} positions from {len(sequences)} "
                      f"sequences", file=sys.stderr)
        return sequences


def save_recorded(sequences: Sequence[RecordedSequence], path) -> None:
    """Write recorded sequences to one ``.npz`` file (reload with :func:`load_recorded`)."""
    np.savez(Path(path), lengths=np.array([len(s.tokens) for s in sequences]),
             tokens=np.concatenate([s.tokens for s in sequences]),
             states=np.concatenate([s.states for s in sequences]),
             labels=np.concatenate([s.labels for s in sequences]))


def load_recorded(path) -> list[RecordedSequence]:
    """The sequences :func:`save_recorded` wrote."""
    with np.load(Path(path)) as data:  # each access of an npz member reads it anew: once each
        lengths, tokens, states, labels = data["lengths"], data["tokens"], data["states"], data["labels"]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [RecordedSequence(tokens[a:b], states[a:b], labels[a:b]) for a, b in zip(bounds, bounds[1:])]


__all__ = ["HiddenStateRecorder", "RecordedSequence", "save_recorded", "load_recorded"]
