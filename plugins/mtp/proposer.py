"""The ``mtp`` method: a multi-token-prediction head fed by the target's hidden states.

Each step, for every decoding request, the head first catches up: one row per position whose
hidden state the target computed since the last step (the row at ``p`` from the state at
``p - 1`` and the token at ``p``; its keys and values go to the head's own cache layer, over the
request's blocks). The last of those rows sits at the request's last token and predicts the
next one: draft 1. With ``num_model_steps`` > 1 the head then runs that many substeps, each
feeding its own output state and its previous draft back in (as FastDeploy does), one
draft per substep. Rows of drafts the target rejects are simply rewritten by the next
catch-up. For a greedy request a draft is the head's argmax (deterministic, no ``probs``); at
temperature > 0 it is sampled, with the request's own generator, from the head's distribution
processed like the target's (temperature, top-k, top-p), and that distribution goes with the
drafts as ``Drafts.probs``: ``rejection`` then stays lossless and accepts as often as the head
agrees with the target's distribution, not just with its argmax.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np

import specdec
from specdec.sdk import (AttentionMetadata, Drafts, ProposalBatch, ProposalRequest, SpecdecError, one_of,
                         processed_probs, sample_tokens)

from .head import MtpHead, rows_of
from .weights import load_mtp_layers

#: The head's ``quantization``: ``wint8``/``wint4``, its matrices quantized at load and run by
#: the engine's quantized kernels (specdec.sdk.QuantizedDraftInput, QuantizedDecoderLayer,
#: QuantizedLinear), three native calls per forward; ``none``, float32 eager paddle ops (about
#: 5x the head's time per step on the default model, benchmarks/bench_mtp_head.py, for the
#: same acceptance).
QUANTIZATIONS = ("wint8", "wint4", "none")
#: What null means: int4 in groups of 32, as the default model's own Q4_1 weights. Its drafts
#: measured the acceptance of float32's and int8's (44.8%, 43.4%, 43.8% on the benchmark's
#: prompts) at 0.69x int8's time per step: the head's step reads its weights from memory.
DEFAULT_QUANTIZATION = "wint4"
HEADS_DIR = Path(__file__).resolve().parent / "heads"
#: The heads that ship with specdec, by the model name that selects their target.
SHIPPED_HEADS = {"smollm2-135m-instruct": str(HEADS_DIR / "smollm2-135m-instruct.safetensors")}


@attrs.define(frozen=True, kw_only=True)
class MtpConfig:
    """Flat keys of ``--speculative-config`` for ``method: mtp``.

    :ivar mtp_strategy: FastDeploy's key: ``default``; ``with_ngram`` selects the
        ``hybrid`` method instead (which declares that spelling).
    """

    mtp_strategy: str = attrs.field(default="default", validator=one_of("default", "with_ngram"))


class MtpProposer(specdec.Proposer):
    """Multi-token prediction (DeepSeek-V3 / ERNIE-4.5 / MiMo style) over the target's hidden states."""

    NAME = "mtp"
    Config = MtpConfig
    NEEDS_HIDDEN_STATES = True
    USED_MODEL_KEYS = frozenset({"num_model_steps", "model", "quantization"})
    DEMO_CONFIG = {}

    def setup(self, context: specdec.ProposerContext) -> None:
        spec = self.spec_config
        model = spec.model
        if model is None:
            model = SHIPPED_HEADS.get(context.model_name)
            if model is None:
                raise SpecdecError(f"needs `model`, the path of MTP head weights (safetensors): no head ships for "
                                   f"'{context.model_name}' (one ships for {', '.join(sorted(SHIPPED_HEADS))}; "
                                   f"train one with `specdec train-mtp`)")
        quantization = DEFAULT_QUANTIZATION if spec.quantization is None else spec.quantization
        if quantization not in QUANTIZATIONS:
            raise SpecdecError(f"quantization: must be one of {', '.join(QUANTIZATIONS)} or null "
                               f"({DEFAULT_QUANTIZATION}), got {spec.quantization!r}")
        layers = load_mtp_layers(model, context.model_config.hidden_size)
        weights = layers[0]  # every substep reuses the first layer, as FastDeploy does
        self.num_model_steps = spec.num_model_steps
        self.block_size = context.block_size
        self.hidden_size = context.model_config.hidden_size
        self.vocab_size = context.model_config.vocab_size
        self._fallback_rng = np.random.default_rng(0)  # for requests built without a generator
        self.head = MtpHead(weights, context, context.create_cache_layers(1),
                           quantization=None if quantization == "none" else quantization)
        self.paddle = self.head.paddle
        #: Per request: the first hidden position the next proposal should bring (a different
        #: one means a fresh start: first proposal, prefix-cache hit, or preemption).
        self._next_position: dict[str, int] = {}
        #: Where the head is one native call, its catch-up runs at the end of each step on the
        #: kernels' worker thread (catch_up), while the engine finishes the step and plans the
        #: next; the drafts are collected at the next proposal.
        self.CATCHES_UP_AFTER_STEP = self.head.fused is not None
        if self.CATCHES_UP_AFTER_STEP:
            self.head.prepare_start(self.block_size)
        self._early: _EarlyCatchUp | None = None

    def on_request_finish(self, request_id: str) -> None:
        self._next_position.pop(request_id, None)
        if self._early is not None:
            # A catch-up still in flight may write into this request's cache blocks, which the
            # engine is about to give back: it ends first. Its drafts for the request are
            # dropped, so that no later request of the same id and length can take them.
            self._early.pending.result()
            self._early.drafting.pop(request_id, None)

    def catch_up(self, batch: ProposalBatch) -> None:
        """Start the head's catch-up over the states this step decided, in the background
        (:meth:`MtpHead.start`); :meth:`propose` collects its first drafts."""
        self._collect_early()  # one not used (a step without a proposal): its cache writes end first
        requests = [r for r in batch.requests if len(r.hidden_positions)]
        if not requests:
            return
        drafting = [i for i, r in enumerate(requests) if _drafts_now(r)]
        tokens, states, meta, last_rows = self._catch_up_inputs(requests)
        pending = self.head.start(tokens, states, meta, logit_rows=last_rows[drafting] if drafting else None)
        self._early = _EarlyCatchUp(pending, {requests[i].request_id: (k, int(last_rows[i]), len(requests[i].token_ids))
                                              for k, i in enumerate(drafting)})

    def propose(self, batch: ProposalBatch) -> Drafts:
        early = self._collect_early()
        drafts: list[list[int]] = [[] for _ in batch.requests]
        catching_up = [(b, r) for b, r in enumerate(batch.requests) if len(r.hidden_positions)]
        # Per drafting request: (batch row, request, the head's output, its row there, its logits).
        sources: list[tuple[int, ProposalRequest, object, int, np.ndarray]] = []
        if catching_up:
            drafting = [(i, b, r) for i, (b, r) in enumerate(catching_up) if _drafts_now(r)]
            out, last_rows, logits = self._catch_up([r for _, r in catching_up], [i for i, _, _ in drafting])
            if drafting:
                logits = _host(logits)
                sources = [(b, r, out, int(last_rows[i]), logits[k]) for k, (i, b, r) in enumerate(drafting)]
        if early:
            handed = {b for b, _ in catching_up}
            for b, r in enumerate(batch.requests):
                found = early.get(r.request_id)
                # caught up at the end of the last step, with nothing decided since
                if found is not None and b not in handed and r.max_draft_len > 0 and found[3] == len(r.token_ids):
                    sources.append((b, r, found[0], found[1], found[2]))
            sources.sort(key=lambda source: source[0])
        if not sources:
            return Drafts.from_lists(drafts)
        draft_probs = self._draft(sources, drafts)
        return Drafts.from_lists(drafts, probs=self._probs_array(draft_probs, drafts))

    def _collect_early(self) -> dict[str, tuple]:
        """The background catch-up's results, by request id: ``(output, row, logits, number
        of tokens then)``; it is waited for here (empty without one)."""
        early, self._early = self._early, None
        if early is None:
            return {}
        out, logits = early.pending.result()
        if not early.drafting:
            return {}
        logits = _host(logits)
        return {request_id: (out, row, logits[k], count) for request_id, (k, row, count) in early.drafting.items()}

    def _catch_up(self, requests: list[ProposalRequest], drafting: list[int]):
        """Run the head over each request's new rows; return its ``[T, H]`` output, the index
        of each request's last row, and the logits of the last rows of requests ``drafting``
        (None when none drafts)."""
        tokens, states, meta, last_rows = self._catch_up_inputs(requests)
        out, logits = self.head.forward(tokens, states, meta, logit_rows=last_rows[drafting] if drafting else None)
        return out, last_rows, logits

    def _catch_up_inputs(self, requests: list[ProposalRequest]):
        """The head's input for each request's new rows: ``(tokens [T], states [T, H], meta,
        the index of each request's last row)``."""
        p = self.paddle
        tokens, states, query_lens, context_lens, tables = [], [], [], [], []
        for request in requests:
            positions = np.asarray(request.hidden_positions, dtype=np.int64)
            hidden = request.hidden_states
            rows = positions + 1
            if self._next_position.get(request.request_id) != int(positions[0]):
                # The row at the first position has no state before it here (position 0, a
                # cached prefix or a recomputation after preemption): a zero state stands in.
                rows = np.concatenate([[positions[0]], rows])
                hidden = p.concat([p.zeros([1, self.hidden_size], dtype="float32"), hidden], axis=0)
            self._next_position[request.request_id] = int(positions[-1]) + 1
            tokens.append(request.token_ids[rows])
            states.append(hidden)
            query_lens.append(len(rows))
            context_lens.append(int(rows[0]))
            tables.append(request.block_table)
        meta = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size)
        last_rows = meta.cu_seqlens_q[1:].astype(np.int64) - 1
        return np.concatenate(tokens), states[0] if len(states) == 1 else p.concat(states, axis=0), meta, last_rows

    def _draft(self, sources, drafts: list[list[int]]) -> dict[int, list[np.ndarray]]:
        """Substep 1 drafts from the catch-up's logits (``sources``: per drafting request, its
        batch row, the request, the head's output, its row there and its logits); substep ``s``
        runs one row per request at position ``len(token_ids) + s - 2`` from the previous
        substep's output and draft. Returns the distributions sampled drafts came from, per
        batch row (none when greedy)."""
        steps = [min(self.num_model_steps, r.max_draft_len) for _, r, _, _, _ in sources]
        active = list(range(len(sources)))
        draft_probs: dict[int, list[np.ndarray]] = {}
        logits = sources[0][4][None] if len(sources) == 1 else np.stack([source[4] for source in sources])
        state = None
        for substep in range(1, max(steps) + 1):
            tokens, probs = self._choose(logits, [sources[k][1] for k in active])
            for row, k in enumerate(active):
                drafts[sources[k][0]].append(int(tokens[row]))
                if probs is not None:
                    draft_probs.setdefault(sources[k][0], []).append(probs[row])
            keep = [row for row, k in enumerate(active) if steps[k] > substep]
            if not keep:
                return draft_probs
            if state is None:  # the catch-up's last rows of the drafting requests
                state = self._last_states(sources)
            active = [active[row] for row in keep]
            requests = [sources[k][1] for k in active]
            meta = AttentionMetadata.build([1] * len(active), [len(r.token_ids) + substep - 1 for r in requests],
                                           [r.block_table for r in requests], self.block_size)
            state, logits = self.head.forward(tokens[keep], rows_of(self.paddle, state, np.array(keep, dtype=np.int64)),
                                              meta, logit_rows=np.arange(len(keep)))
        return draft_probs

    def _last_states(self, sources):
        """The head's output at each source's row, ``[n, H]`` paddle, in the sources' order
        (an output is a paddle tensor from :meth:`MtpHead.forward`, a numpy array from a
        catch-up started in the background)."""
        p, outputs = self.paddle, [source[2] for source in sources]
        if all(isinstance(out, np.ndarray) for out in outputs):
            return p.to_tensor(np.stack([out[row] for _, _, out, row, _ in sources]))
        if all(out is outputs[0] for out in outputs):
            return rows_of(p, outputs[0], np.array([source[3] for source in sources], dtype=np.int64))
        return p.concat([p.to_tensor(out[row:row + 1]) if isinstance(out, np.ndarray)
                         else rows_of(p, out, np.array([row], dtype=np.int64)) for _, _, out, row, _ in sources], axis=0)

    def _choose(self, logits, requests: list[ProposalRequest]) -> tuple[np.ndarray, np.ndarray | None]:
        """Each row's draft from its head logits: the argmax for greedy requests; for requests
        at temperature > 0 a sample from the head's processed distribution, returned too
        (``[n, K]`` over the head's vocabulary, one-hot on the argmax for the greedy rows)."""
        if all(r.temperature <= 0.0 for r in requests):
            return self.head.draft_tokens(logits), None
        logits = np.asarray(logits, dtype=np.float32)[:, None, :]
        temperature = np.array([r.temperature for r in requests])
        top_k = np.array([0 if r.sampling is None else r.sampling.top_k for r in requests], dtype=np.int64)
        top_p = np.array([1.0 if r.sampling is None else r.sampling.top_p for r in requests])
        probs = processed_probs(logits, temperature, top_k, top_p)[:, 0]
        uniforms = np.array([(r.rng or self._fallback_rng).random() if r.temperature > 0.0 else 0.0
                             for r in requests])
        picks = sample_tokens(probs[:, None], uniforms[:, None])[:, 0]
        vocab = self.head.draft_vocab
        return (picks if vocab is None else vocab[picks]), probs

    def _probs_array(self, draft_probs: dict[int, list[np.ndarray]], drafts: list[list[int]]) -> np.ndarray | None:
        """``Drafts.probs``, ``[B, k, V]``: each sampled draft's distribution over the target's
        vocabulary (zero outside the head's draft vocabulary); ``None`` when no draft was sampled."""
        if not draft_probs:
            return None
        width = max(len(d) for d in drafts)
        out = np.zeros((len(drafts), width, self.vocab_size), dtype=np.float32)
        columns = self.head.draft_vocab if self.head.draft_vocab is not None else slice(None)
        for row, rows in draft_probs.items():
            for position, probs in enumerate(rows):
                out[row, position, columns] = probs
        return out


@attrs.define
class _EarlyCatchUp:
    """A catch-up started at the end of a step (:meth:`MtpProposer.catch_up`): the head's
    pending forward and, per drafting request id, ``(its logits row, its output row, its number
    of tokens then)``."""

    pending: object
    drafting: dict[str, tuple[int, int, int]]


def _drafts_now(request: ProposalRequest) -> bool:
    """Whether ``request`` may draft and its rows reach its last token: the catch-up computes
    the logits of such a request's last row only."""
    return request.max_draft_len > 0 and int(request.hidden_positions[-1]) == len(request.token_ids) - 2


def _host(logits) -> np.ndarray:
    """``logits`` as a numpy array (a paddle tensor's ``numpy()`` costs less than
    ``np.asarray`` of it on cold caches)."""
    return logits if isinstance(logits, np.ndarray) else logits.numpy()
