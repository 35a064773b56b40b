"""The engine: one step path for every method (schedule, propose, pack, forward, verify, accept,
update), as in ARCHITECTURE.md.

Data are laid out for a batch from the start: drafts are ``[B, k]`` plus lengths, the forward
pass sees one packed token array, verification works on ``[B, k+1, V]`` logits. Requests join
the batch between steps (up to ``max_num_seqs``); each owns a KV cache slot in the attention
backend, and rejected rows are dropped by length: the next step overwrites them.
"""

from __future__ import annotations

import itertools
import sys
import time
from typing import Iterable, Optional, Sequence

import numpy as np

from ..attention import AttentionMetadata
from ..config import MAX_SPECULATIVE_TOKENS, EngineConfig, SpeculativeConfig
from ..errors import SpecdecError
from ..proposer import Drafts, ProposalBatch, ProposalRequest
from ..sampling import SamplingParams
from ..verify import BatchSampling, VerifyInputs
from .request import Request, RequestOutput


def _on_gpu() -> bool:
    from ..errors import require_paddle

    paddle = require_paddle()
    return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def resolve_kernels(config: EngineConfig) -> tuple[str, str]:
    """``(kernels, weight dtype)`` that ``config.kernels`` and ``config.dtype`` come to here:
    ``cpu`` when the CPU kernels build (and run on CPU tensors), else ``paddle``; ``auto`` dtype
    is float16 weights with the CPU kernels, float32 on the reference path."""
    from specdec.kernels.cpu import KernelUnavailable, load_cpu_ops

    dtype = config.dtype
    if dtype == "bfloat16":
        raise SpecdecError("dtype: bfloat16 is not supported on this build; use float32 or float16")
    kernels = config.kernels
    if kernels == "auto":
        kernels = "paddle" if _on_gpu() else "cpu"  # the CPU kernels take CPU tensors only
        try:
            load_cpu_ops()
        except KernelUnavailable:
            if dtype == "float16":
                raise SpecdecError("dtype: float16 weights need the CPU kernels, which cannot be built "
                                   "here; use dtype: float32") from None
            kernels = "paddle"
    elif kernels == "cpu":
        try:
            load_cpu_ops()
        except KernelUnavailable as exc:
            raise SpecdecError(f"kernels: {exc}; use kernels: paddle") from None
    if dtype == "auto":
        dtype = "float16" if kernels == "cpu" else "float32"
    if kernels == "paddle" and dtype != "float32":
        raise SpecdecError(f"dtype: {dtype} weights need the CPU kernels (kernels: cpu or auto)")
    return kernels, dtype


class Engine:
    """Owns the model, the plugins chosen by the config, and the running requests."""

    def __init__(self, config: EngineConfig, plugins=None, progress: bool = True):
        from ..model.llama import LlamaModel
        from ..model.resolve import load_checkpoint
        from ..plugin_manager import get_plugins

        self.plugins = plugins if plugins is not None else get_plugins()
        spec = config.speculative
        if spec.num_speculative_tokens is None:
            spec = spec.resolved(self.plugins)
        self.config = config
        self.spec: SpeculativeConfig = spec
        self.num_speculative_tokens = spec.num_speculative_tokens or 0

        # Resolve every plugin before loading weights, so a bad name fails fast.
        self._spec_plugin_classes(spec)
        kernels, weight_dtype = resolve_kernels(config)
        self.kernels, self.weight_dtype = kernels, weight_dtype
        backend = config.attention_backend
        if backend == "auto":
            backend = "cpu" if kernels == "cpu" else "paddle"
        attention_cls = self.plugins.attention_backends.get(backend, "attention_backend")

        model_config, weights, self.tokenizer = load_checkpoint(config.model, progress=progress)
        self.model_config = model_config
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.attention = attention_cls(None, config)
        self.model = LlamaModel(model_config, weights, self.attention,
                                max_positions=self.max_model_len + MAX_SPECULATIVE_TOKENS + 1,
                                kernels=kernels, weight_dtype=weight_dtype)
        del weights
        self._build_spec_plugins(spec)

        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self._eos_array = np.array(sorted(self.eos_token_ids), dtype=np.int64)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._ids = itertools.count()

    def _spec_plugin_classes(self, spec: SpeculativeConfig):
        return (
            self.plugins.proposers.get(spec.method, "speculative_config.method"),
            self.plugins.verify_strategies.get(spec.verify_strategy, "speculative_config.verify_strategy"),
            self.plugins.accept_policies.get(spec.accept_policy, "speculative_config.accept_policy"),
        )

    def _build_spec_plugins(self, spec: SpeculativeConfig) -> None:
        proposer_cls, verify_cls, accept_cls = self._spec_plugin_classes(spec)
        self.spec = spec
        self.num_speculative_tokens = spec.num_speculative_tokens or 0
        self.proposer = proposer_cls(spec.method_config, spec)
        self.verifier = verify_cls(spec.verify_config, spec)
        self.accept_policy = accept_cls(spec.accept_config, spec)

    def set_speculative_config(self, spec: SpeculativeConfig) -> None:
        """Switch method, verify strategy or accept policy without reloading the model.

        Only between runs: raises if requests are queued or running.
        """
        if self.has_unfinished():
            raise SpecdecError("cannot change the speculative config while requests are running")
        if spec.num_speculative_tokens is None:
            spec = spec.resolved(self.plugins)
        self._build_spec_plugins(spec)

    # -- requests ----------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                    prompt: Optional[str] = None, request_id: Optional[str] = None) -> Request:
        """Queue a request; it joins the running batch at the next step that has room."""
        from ..model.tokenizer import DetokenizeStream

        prompt_ids = np.asarray(prompt_token_ids, dtype=np.int64)
        if prompt_ids.ndim != 1 or len(prompt_ids) == 0:
            raise SpecdecError("prompt: must hold at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise SpecdecError(
                f"prompt: {len(prompt_ids)} tokens do not fit the context of {self.max_model_len} tokens"
            )
        if prompt_ids.min() < 0 or prompt_ids.max() >= self.model_config.vocab_size:
            raise SpecdecError(f"prompt: token ids must lie in [0, {self.model_config.vocab_size})")
        number = next(self._ids)
        seed = sampling.seed if sampling.seed is not None else self.config.seed * 1_000_003 + number
        capacity = min(len(prompt_ids) + sampling.max_tokens, self.max_model_len)
        tokens = np.zeros(capacity + self.num_speculative_tokens + 1, dtype=np.int64)
        tokens[: len(prompt_ids)] = prompt_ids
        request = Request(
            request_id=request_id or f"req-{number}",
            prompt=prompt,
            sampling=sampling,
            tokens=tokens,
            num_prompt_tokens=len(prompt_ids),
            num_tokens=len(prompt_ids),
            rng=np.random.default_rng(seed),
            detokenizer=DetokenizeStream(self.tokenizer),
        )
        if sampling.max_tokens == 0:
            self._finish(request, "length")
        else:
            self.waiting.append(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        """Stop a queued or running request now (finish reason ``abort``) and free its KV
        cache. Returns False when no unfinished request has that id."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    if request.slot >= 0:
                        self.attention.free(request.slot)
                        request.slot = -1
                        self.proposer.on_request_finish(request.request_id)
                    self._finish(request, "abort")
                    return True
        return False

    @property
    def num_kv_blocks(self) -> int:
        """Size of the KV block pool."""
        return self.config.max_num_seqs

    @property
    def num_free_kv_blocks(self) -> int:
        """Blocks of the KV pool not held by any request (equals ``num_kv_blocks`` when idle)."""
        return self.config.max_num_seqs - self.attention.num_allocated

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        """Move waiting requests into the batch while there is room, prefilling their prompts."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.pop(0)
            request.slot = self.attention.allocate(len(request.tokens))
            self._prefill(request)
            self.proposer.on_request_start(ProposalRequest(
                request.request_id, request.token_ids, request.num_prompt_tokens, 0))
            self.running.append(request)

    def _prefill(self, request: Request) -> None:
        """Fill the KV cache with every prompt token but the last (the first step feeds it)."""
        count = request.num_prompt_tokens - 1
        if count > 0:
            meta = AttentionMetadata([count], [0], [request.slot])
            self.model.forward(request.tokens[:count], np.arange(count), meta, np.arange(0))
        request.context_len = count

    # -- the step ----------------------------------------------------------------------------

    def _max_draft_len(self, request: Request) -> int:
        # Every step emits accepted drafts + 1 token, and writes 1 + drafts KV rows.
        room = len(request.tokens) - 1 - request.context_len - 1
        k = self.num_speculative_tokens
        if request.sampling.num_speculative_tokens is not None:
            k = min(k, request.sampling.num_speculative_tokens)
        return max(0, min(k, request.remaining - 1, room))

    def step(self) -> list[Request]:
        """Run one step for every running request; return the requests that finished."""
        self._admit()
        running = self.running
        if not running:
            return []
        batch = ProposalBatch([
            ProposalRequest(r.request_id, r.token_ids, r.num_prompt_tokens, self._max_draft_len(r))
            for r in running
        ])
        drafts = self._propose(batch)
        logits = self._forward(running, drafts)
        result = self.verifier.verify(VerifyInputs(logits, drafts, self._sampling(running, drafts)))
        result = self.accept_policy.apply(result, drafts)
        return self._update(running, batch, drafts, result)

    def _propose(self, batch: ProposalBatch) -> Drafts:
        max_lens = np.fromiter((r.max_draft_len for r in batch.requests), dtype=np.int64, count=len(batch))
        if not max_lens.any():
            return Drafts.empty(len(batch))
        drafts = self.proposer.propose(batch)
        if drafts.batch_size != len(batch):
            raise SpecdecError(
                f"proposer '{self.spec.method}' returned {drafts.batch_size} drafts for {len(batch)} requests"
            )
        if (drafts.lengths > max_lens).any() or drafts.width > max_lens.max():
            drafts = drafts.clipped(max_lens)
        return drafts

    def _forward(self, running: list[Request], drafts: Drafts) -> np.ndarray:
        """Pack ``[last token, drafts...]`` of every request, run the model, return ``[B, k+1, V]``."""
        lengths = drafts.lengths
        width = drafts.width
        last = np.fromiter((r.tokens[r.num_tokens - 1] for r in running), dtype=np.int64, count=len(running))
        context = np.fromiter((r.context_len for r in running), dtype=np.int64, count=len(running))
        rows = np.concatenate([last[:, None], drafts.token_ids], axis=1)  # [B, k+1]
        offsets = np.arange(width + 1)
        valid = offsets[None, :] <= lengths[:, None]
        tokens = rows[valid]
        positions = (context[:, None] + offsets[None, :])[valid]
        query_lens = lengths + 1
        meta = AttentionMetadata(query_lens.tolist(), context.tolist(), [r.slot for r in running])
        logits = self.model.forward(tokens, positions, meta, np.arange(len(tokens)))
        if len(running) == 1:
            return logits[None]
        starts = np.asarray(meta.cu_seqlens_q[:-1])
        index = starts[:, None] + np.minimum(offsets[None, :], lengths[:, None])
        return logits[index]

    def _sampling(self, running: list[Request], drafts: Drafts) -> BatchSampling:
        batch_size, width = drafts.batch_size, drafts.width
        temperature = np.fromiter((r.sampling.temperature for r in running), dtype=np.float32, count=batch_size)
        uniforms = np.zeros((batch_size, width + 1, 2))
        for b in np.flatnonzero(temperature > 0):
            # Drawn from the request's own generator, and only as many as its own drafts
            # need, so its tokens do not depend on what else is in the batch.
            draws = int(drafts.lengths[b]) + 1
            uniforms[b, :draws] = running[b].rng.random((draws, 2))
        return BatchSampling(
            temperature=temperature,
            top_p=np.fromiter((r.sampling.top_p for r in running), dtype=np.float32, count=batch_size),
            top_k=np.fromiter((r.sampling.top_k for r in running), dtype=np.int64, count=batch_size),
            uniforms=uniforms,
        )

    def _update(self, running, batch, drafts, result) -> list[Request]:
        finished = []
        appended_per_request = []
        for b, request in enumerate(running):
            accepted = int(result.accepted_lengths[b])
            appended = self._append(request, result.output_tokens[b, : accepted + 1])
            request.context_len += len(appended)
            request.metrics.record_step(int(drafts.lengths[b]), accepted, len(appended))
            appended_per_request.append(appended)
            self._check_stop_strings(request)
            if request.finished:
                finished.append(request)
        self.proposer.on_step(batch, appended_per_request)
        for request in finished:
            self.running.remove(request)
            self.attention.free(request.slot)
            self.proposer.on_request_finish(request.request_id)
            self._finish(request, request.finish_reason)
        return finished

    def _append(self, request: Request, emitted: np.ndarray) -> np.ndarray:
        """Append ``emitted`` up to the first stop condition; return what was appended."""
        count, reason = len(emitted), None
        if not request.sampling.ignore_eos and self._eos_array.size:
            is_eos = np.isin(emitted, self._eos_array)
            if is_eos.any():
                count, reason = int(np.argmax(is_eos)) + 1, "stop"
        limit = min(request.remaining, self.max_model_len - request.num_tokens)
        if count > limit or (count == limit and reason is None):
            count, reason = limit, "length"
        if reason is not None:
            request.finish_reason = reason
        start = request.num_tokens
        if start == request.num_prompt_tokens and count:
            request.first_token_time = time.perf_counter()
        request.tokens[start: start + count] = emitted[:count]
        request.num_tokens += count
        return request.tokens[start: start + count]

    def _check_stop_strings(self, request: Request) -> None:
        before = len(request.text)
        request.text += request.detokenizer.step(request.generated_ids)
        stops = request.sampling.stop
        if not stops:
            return
        longest = max(len(s) for s in stops)
        window_start = max(0, before - longest + 1)
        hits = [(i, s) for s in stops if (i := request.text.find(s, window_start)) >= 0]
        if hits:
            position = min(i for i, _ in hits)
            request.text = request.text[:position]
            request.finish_reason = "stop"
            request.detokenizer = None  # the text is final

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        if request.detokenizer is not None:
            request.text += request.detokenizer.flush()
        request.finish_time = time.perf_counter()

    # -- driving -----------------------------------------------------------------------------

    def run(self, requests: Iterable[Request], progress: bool = False) -> list[RequestOutput]:
        """Step until every request in ``requests`` has finished; return their outputs in order."""
        requests = list(requests)
        bar = None
        if progress:
            from tqdm import tqdm

            total = sum(r.sampling.max_tokens for r in requests)
            bar = tqdm(total=total, desc="generating", unit="tok", file=sys.stderr, leave=False)
        try:
            while any(not r.finished for r in requests):
                before = sum(r.num_generated for r in requests)
                self.step()
                if bar is not None:
                    bar.update(sum(r.num_generated for r in requests) - before)
        finally:
            if bar is not None:
                bar.close()
        return [r.output() for r in requests]
