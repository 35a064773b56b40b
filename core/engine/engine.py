"""The engine: one step path for every method (schedule, propose, pack, forward, verify, accept,
update), as docs/architecture.md describes it.

Requests join and leave the batch between steps (continuous batching, ``scheduler.py``); their
KV caches live in fixed-size blocks of one pool (``kv_cache.py``), shared between requests
with a common prompt prefix. A step packs every scheduled request's new rows into one token
array (prefill chunks, and for decoding requests the last token plus its drafts), runs one
forward pass, and verifies the drafts of the whole batch in one call on ``[B, k+1, V]``
logits. Rejected rows are dropped by length: the next step overwrites them.

The engine's other rooms: ``build.py`` builds the model and wires the plugins,
``tensor_parallel.py`` runs the other ranks, ``handoff.py`` exports and imports requests
(prefill/decode disaggregation), ``admission.py`` checks what a request asks for.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

import attrs
import numpy as np

from specdec.kernels.cpu import release_free_heap

from ..config import EngineConfig, SpeculativeConfig
from ..errors import SpecdecError
from ..model.gguf_file import release_mapped_pages
from ..model.resolve import known_model_name
from ..proposer import Drafts, ProposalBatch, ProposalRequest, valid_draft_classes
from ..proposer_context import ProposerContext, TargetModel
from ..sampling import SamplingParams
from ..verify import BatchSampling, VerifyInputs, VerifyResult
from . import admission
from .batch import PickedRows, SequenceRows, pack_step
from .build import build_model, build_spec_plugins, create_cache_layers, load_draft_model, spec_plugin_classes
from .controller import DraftController
from .handoff import HandoffState, KVLayout, check_handoff_supported, export_request, import_request
from .hidden_states import PendingHiddenStates, hidden_state_layers
from .kv_cache import BlockPool, KVCacheManager
from .logits_processing import apply_row_processors
from .logprobs import emitted_logprobs, log_softmax
from .sampling_processors import sampling_processors
from .prediction import Predictions
from .request import Request, RequestOutput, step_sources
from .row_costs import measure_row_curve
from .scheduler import ScheduledStep, Scheduler
from .tensor_parallel import exit_after_failure

logger = logging.getLogger("specdec.engine")
T = TypeVar("T")


def _merged_result(rows: list[tuple], width: int) -> VerifyResult:
    """One :class:`VerifyResult` at ``width`` drafts from per-request ``(accepted,
    output_tokens, target_tokens)`` of groups verified at narrower widths (-1 beyond)."""
    output = np.full((len(rows), width + 1), -1, dtype=np.int64)
    target = np.full((len(rows), width + 1), -1, dtype=np.int64)
    for b, (_, tokens, targets) in enumerate(rows):
        output[b, : len(tokens)] = tokens
        target[b, : len(targets)] = targets
    accepted = np.fromiter((row[0] for row in rows), dtype=np.int64, count=len(rows))
    return VerifyResult(accepted_lengths=accepted, output_tokens=output, target_tokens=target)


def _reads_argmax_only(requests: list[Request]) -> bool:
    """Whether verifying these requests needs only the argmax of their logits: all greedy, none
    with row processors or logprobs (which read the whole ``[k+1, V]`` rows)."""
    return all(r.sampling.temperature <= 0.0 and not r.row_processors and r.sampling.logprobs is None
               for r in requests)


def _rows(logits, pick: np.ndarray):
    """The rows ``pick`` of step logits (numpy, or a paddle tensor on its device)."""
    if isinstance(logits, np.ndarray):
        return logits[pick]
    if isinstance(logits, PickedRows):
        return logits.select(pick)
    import paddle

    return paddle.gather(logits, paddle.to_tensor(pick))


@attrs.define(slots=True)
class _StepState:
    """What one step has computed so far, row-aligned with ``plan.decodes``; :meth:`only`
    narrows it to some of its requests (when others failed)."""

    plan: ScheduledStep
    batch: ProposalBatch
    drafts: Optional[Drafts] = None
    #: ``[B, k+1, V]`` numpy logits, or a paddle tensor on the device with the Triton kernels,
    #: or (a greedy step) :class:`PickedRows`, the same without the padded copy.
    logits: Any = None
    sampling: Optional[BatchSampling] = None
    result: Optional[VerifyResult] = None
    #: ``[T, H]`` last-layer hidden states of the step's packed rows, and each request's first
    #: row among them (by ``id``), when the proposer reads hidden states or a request of the
    #: step captures them for a hand-off.
    hidden: Any = None
    first_rows: dict = attrs.field(factory=dict)
    #: By ``id(request)``, the raw ``[k+1, V]`` log-probabilities of the requests that asked
    #: for logprobs (taken before any row processor).
    logprobs: dict = attrs.field(factory=dict)
    #: ``[B]`` bool: the requests the proposer was called for with room to draft, and those
    #: with room that the controller left out.
    proposed: Optional[np.ndarray] = None
    proposer_off: Optional[np.ndarray] = None
    #: The packed step (``batch.py``), for laying its logits out per request.
    packed: Any = None
    #: Seconds of this step's proposer call; its packed rows when it had no prompt rows
    #: (0 when it had some).
    proposer_seconds: float = 0.0
    decode_rows: int = 0

    def only(self, keep: Callable[[Request], bool]) -> "_StepState":
        rows = [i for i, request in enumerate(self.plan.decodes) if keep(request)]
        if len(rows) == len(self.plan.decodes) and all(keep(r) for r, _ in self.plan.chunks):
            return self  # nothing to narrow: no copy of the step's [B, k+1, V] logits
        pick = np.asarray(rows, dtype=np.int64)
        return _StepState(
            plan=self.plan.keeping(keep),
            batch=ProposalBatch([self.batch.requests[i] for i in rows]),
            drafts=None if self.drafts is None else self.drafts.select(pick),
            logits=None if self.logits is None else _rows(self.logits, pick),
            sampling=None if self.sampling is None else self.sampling.select(pick),
            result=None if self.result is None else self.result.select(pick),
            hidden=self.hidden,
            first_rows=self.first_rows,
            logprobs=self.logprobs,
            proposed=None if self.proposed is None else self.proposed[pick],
            proposer_off=None if self.proposer_off is None else self.proposer_off[pick],
            proposer_seconds=self.proposer_seconds,
            decode_rows=self.decode_rows,
            packed=self.packed,
        )


class Engine:
    """Owns the model, the plugins chosen by the config, the KV pool and the requests."""

    def __init__(self, config: EngineConfig, plugins=None, progress: bool = True):
        """Load the model and build the plugins ``config`` names (``build.py``).

        :param config: a resolved config, as :func:`specdec.config.build_engine_config` makes
            it (a hand-built ``SpeculativeConfig`` goes through ``.resolved(plugins)`` first).
        :param plugins: the plugin registries (:func:`specdec.plugin_manager.get_plugins` when
            None).
        :raises SpecdecError: for an unresolved config, before any weight is read.
        """
        from ..plugin_manager import get_plugins

        self.plugins = plugins if plugins is not None else get_plugins()
        self.config = config
        spec_plugin_classes(self.plugins, config.speculative)  # a bad name fails before loading
        #: The other tensor-parallel ranks' processes (started here on one machine), if any.
        self.tensor_parallel_workers: list = []
        self._closed = False
        self._on_fatal: Callable[[str], None] = exit_after_failure
        rank_zero = None
        if config.tensor_parallel_size > 1:
            from .tensor_parallel import start_rank_zero

            rank_zero = start_rank_zero(config, lambda message: self._on_fatal(message))
            self.tensor_parallel_workers = rank_zero.workers
            atexit.register(self.close)  # before multiprocessing's own exit handler terminates the workers
        try:
            built = build_model(config, self.plugins, progress,
                                tensor_parallel=None if rank_zero is None else rank_zero.tensor_parallel)
            release_free_heap()  # the loader's temporaries, freed by now
            release_mapped_pages()  # the file's pages, read once to load it
            if rank_zero is not None:
                from .tensor_parallel import init_process_group

                init_process_group(rank_zero.tensor_parallel[0].paddle, rank_zero.environment)  # after loading
        except BaseException:
            if rank_zero is not None:  # the workers fail the same way: that is not news
                rank_zero.watchdog.stop()
                for process in self.tensor_parallel_workers:
                    process.kill()  # silently: paddle prints a C++ trace on SIGTERM
                self._closed = True
            raise
        self.kernels, self.weight_dtype, self.quantization = built.kernels, built.weight_dtype, built.quantization
        self.attention_backend = built.backend
        self.attention, self.kv_cache_dtype, self.tokenizer = built.attention, built.kv_cache_dtype, built.tokenizer
        self.model_config, self.max_model_len, self.model = built.model_config, built.max_model_len, built.model
        if rank_zero is not None:
            from .tensor_parallel import TensorParallelModel

            self.model = TensorParallelModel(built.model, rank_zero.tensor_parallel[0], built.embedding,
                                             built.lm_head, rank_zero.watchdog)
        logger.debug("kernels %s, attention backend %s, weights %s (quantization %s), kv cache %s, "
                     "tensor parallel %d", self.kernels, built.backend, self.weight_dtype, self.quantization,
                     self.kv_cache_dtype, config.tensor_parallel_size)
        self.block_size = config.block_size
        self.kv = self._allocate_kv_cache()
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        #: What the drafting controller has learned, per method (see _use_spec_plugins).
        self._controllers: dict[str, DraftController] = {}
        #: A pass's time by its rows on this machine (row_costs.py), measured when a method that
        #: drafts first needs it; False until then.
        self._measured_row_curve: dict[int, float] | None | bool = False
        #: Draft models proposers loaded (``ProposerContext.load_model``), by model and quantization.
        self._draft_models: dict[tuple, Any] = {}
        self._use_spec_plugins(config.speculative)
        #: Requests' predicted outputs as drafts (``prediction.py``).
        self.predictions = Predictions()

        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self._eos_array = np.array(sorted(self.eos_token_ids), dtype=np.int64)
        self._ids = itertools.count()

    def set_fatal_handler(self, handler: Callable[[str], None]) -> None:
        """What to do when the engine cannot go on (a tensor-parallel rank died or hung):
        ``handler(message)`` is called once, from a watchdog thread, while the engine thread
        may be blocked for good. The default prints the message and exits the process; the
        server fails the requests in flight first."""
        self._on_fatal = handler

    def close(self) -> None:
        """Tell the other tensor-parallel ranks to stop (nothing to do with one rank)."""
        if self.config.tensor_parallel_size > 1 and not self._closed:
            self._closed = True
            self.model.stop_workers()
            for process in self.tensor_parallel_workers:
                process.join(5)

    def _allocate_kv_cache(self) -> KVCacheManager:
        """Size the block pool (``num_kv_blocks``, else what ``kv_cache_memory_gb`` holds), have
        the attention backend allocate the cache memory, and manage its blocks."""
        config = self.config
        num_blocks = config.num_kv_blocks or max(
            1, int(config.kv_cache_memory_gb * 2**30) // self.attention.bytes_per_block(self.block_size))
        self.attention.init_cache(num_blocks, self.block_size)
        if self.config.tensor_parallel_size > 1:
            self.model.init_cache(num_blocks, self.block_size)
        return KVCacheManager(BlockPool(num_blocks, self.block_size, config.enable_prefix_caching))

    # -- the speculative plugins (build.py) ----------------------------------------------------

    def _use_spec_plugins(self, spec: SpeculativeConfig) -> None:
        """Build the plugins ``spec`` names and make them the step loop's."""
        built = build_spec_plugins(spec, self.plugins, self._proposer_context)
        hidden_layers = hidden_state_layers(built.proposer, self.model_config.num_layers)
        self.spec: SpeculativeConfig = spec
        self.num_speculative_tokens = spec.num_speculative_tokens or 0
        self.proposer, self.verifier, self.accept_policy = built.proposer, built.verifier, built.accept_policy
        # The controller's statistics belong to the method (draft classes mean what its
        # proposer says; the step-cost fit needs its multi-row steps, which another method's
        # 1-row steps would drown; the proposer's time is its own): switching methods and back
        # resumes them.
        if spec.method not in self._controllers:
            self._controllers[spec.method] = DraftController(row_curve=self._row_curve(spec))
        self.controller = self._controllers[spec.method]
        self.hidden_layers = hidden_layers
        #: Columns of the hidden states handed to the proposer (and captured for a hand-off).
        self.hidden_width = self.model_config.hidden_size * (len(hidden_layers) if hidden_layers else 1)
        self.hidden_states = PendingHiddenStates(self.model.paddle, self.hidden_width)
        #: Seconds of the last ``Proposer.catch_up`` call, counted with the next proposal's.
        self._caught_up_seconds = 0.0
        #: The prompt's hidden states of requests that capture them for a hand-off.
        self.captured_hidden = PendingHiddenStates(self.model.paddle, self.hidden_width)

    def _row_curve(self, spec: SpeculativeConfig) -> dict[int, float] | None:
        """The controller's measured row costs (``row_costs.py``) for a method that drafts
        with the adaptive draft length; None for one that does not (nothing to price). Measured
        once per engine, before any request holds a block (0.16-0.23 s for the default model)."""
        if not spec.adaptive_draft_length or not spec.num_speculative_tokens:
            return None
        if self.kernels == "triton":
            from specdec.kernels.triton.runtime import interpreting

            if interpreting():  # seconds a pass, in tests: not timed (the prior stays)
                return None
        if self._measured_row_curve is False:
            self._measured_row_curve = measure_row_curve(self.model, self.kv.pool, self.block_size,
                                                         self.model_config.vocab_size, self.max_model_len)
            logger.debug("row curve %s", self._measured_row_curve)
        return self._measured_row_curve

    def _proposer_context(self, create_proposer: Callable) -> ProposerContext:
        """What a proposer's ``setup`` gets: the target, its tokenizer and the cache geometry."""
        return ProposerContext(model_name=known_model_name(self.config.model), model_config=self.model_config,
                               tokenizer=self.tokenizer, target=TargetModel(self.model), block_size=self.block_size,
                               num_blocks=self.kv.pool.num_blocks, create_cache_layers=self._create_cache_layers,
                               create_proposer=create_proposer, load_model=self._load_draft_model)

    def _create_cache_layers(self, num_layers: int, **shape: Optional[int]):
        """``ProposerContext.create_cache_layers`` over this engine's pool (see its docstring)."""
        backend = create_cache_layers(self.attention, self.model_config, self.kv_cache_dtype, self.kv.pool.num_blocks,
                                      self.block_size, num_layers, **shape)
        self.kv.pool.reset_prefix_cache()  # its cached blocks hold no draft rows
        return backend

    def _load_draft_model(self, model: str, quantization: Optional[str]):
        """``ProposerContext.load_model``: a draft model on this engine's kernels, its cache
        over this engine's pool (see its docstring). Loaded once per model and quantization:
        a proposer built again (a method switched back to) gets the same one."""
        key = (model, quantization)
        draft = self._draft_models.get(key)
        if draft is None:
            draft = load_draft_model(model, quantization, target_name=self.config.model,
                                     target_tokenizer=self.tokenizer, target_vocab_size=self.model_config.vocab_size,
                                     kernels=self.kernels, weight_dtype=self.weight_dtype, attention=self.attention,
                                     kv_cache_dtype=self.kv_cache_dtype, max_positions=self.model.max_positions,
                                     num_blocks=self.kv.pool.num_blocks, block_size=self.block_size)
            self._draft_models[key] = draft
            release_free_heap()  # the loader's temporaries
            release_mapped_pages()
        self.kv.pool.reset_prefix_cache()  # its cached blocks hold no draft rows
        return draft

    def set_speculative_config(self, spec: SpeculativeConfig) -> None:
        """Switch method, verify strategy or accept policy without reloading the model.

        ``spec`` must be resolved (see :meth:`__init__`). Only between runs: raises if requests
        are queued or running.
        """
        if self.has_unfinished():
            raise SpecdecError("cannot change the speculative config while requests are running")
        self._use_spec_plugins(spec)

    # -- requests ----------------------------------------------------------------------------

    @property
    def waiting(self) -> list[Request]:
        """Requests queued for admission (preempted ones first)."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        """Requests in the batch (prefilling or decoding)."""
        return self.scheduler.running

    def add_request(self, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                    prompt: Optional[str] = None, request_id: Optional[str] = None, *,
                    handoff: bool = False, capture_hidden: bool = False, tenant: Optional[str] = None,
                    row_processors: Sequence = ()) -> Request:
        """Queue a request; it joins the running batch at the next step that has room.

        :param handoff: run the prompt and the first output token only, without drafts, then
            end the request with finish reason ``handoff`` and :attr:`Request.handoff_state` (a
            :class:`~specdec.engine.handoff.HandoffState` for another engine's
            :meth:`import_request`; ``text`` holds the text so far). A request that this first
            token finishes (EOS, a stop string, ``max_tokens``, the context's end) ends as usual
            instead, without a state.
        :param capture_hidden: with ``handoff``, also collect the target's hidden states of the
            computed positions into the state (for a decode engine whose proposer reads them,
            :attr:`needs_hidden_states`). The request then computes its whole prompt (it takes
            nothing from the prefix cache). Ignored without ``handoff``.
        :param tenant: who sent the request (the server's id of its API key), passed to the
            proposer as ``ProposalRequest.tenant``.
        :param row_processors: :class:`~specdec.engine.logits_processing.RowProcessor` s of
            this request alone (a grammar's token mask), run before those its sampling asks
            for (so that min-p and top-k choose among the tokens the grammar allows).
        :raises RequestError: for a prompt or sampling values the engine cannot take.
        :raises SpecdecError: for ``handoff`` with tensor parallelism.
        """
        prompt_ids = self.checked_prompt(prompt_token_ids)
        self.check_sampling(sampling, len(prompt_ids))
        if handoff:
            check_handoff_supported(self, "add_request(handoff=True)")
        request = self.new_request(prompt_ids, sampling, prompt, request_id)
        request.handoff = handoff
        request.capture_hidden = handoff and capture_hidden
        request.tenant = tenant
        request.row_processors[:0] = list(row_processors)
        if request.capture_hidden:
            request.prefix_keys = []  # every position's hidden state must be computed here
        self.scheduler.waiting.append(request)
        return request

    def new_request(self, prompt_ids: np.ndarray, sampling: SamplingParams, prompt: Optional[str],
                     request_id: Optional[str]) -> Request:
        """A request for a checked prompt, with its token buffer, generator and detokenizer."""
        from ..model.tokenizer import DetokenizeStream

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
            row_processors=sampling_processors(sampling, prompt_ids),
            logprobs=None if sampling.logprobs is None else [],
        )
        if sampling.reproducible and self.proposer.NEEDS_HIDDEN_STATES:
            # A model proposer's drafts depend on the hidden states it is given, and a cached
            # prefix gives none for its positions; sampled tokens depend on the drafts. Computing
            # the whole prompt keeps a seeded request's tokens the same from run to run.
            request.prefix_keys = []
        return request

    # -- handing requests between engines (handoff.py) ---------------------------------------

    @property
    def kv_layout(self) -> KVLayout:
        """What another engine's KV blocks must match to be imported here."""
        c = self.model_config
        return KVLayout(backend=self.attention.NAME, dtype=self.kv_cache_dtype, block_size=self.block_size,
                        num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                        model=self.config.model, vocab_size=c.vocab_size)

    @property
    def needs_hidden_states(self) -> bool:
        """Whether this engine's proposer reads the target's hidden states (a request handed
        to it should come with them: ``add_request(..., capture_hidden=True)`` there)."""
        return bool(self.proposer.NEEDS_HIDDEN_STATES)

    def import_request(self, state: HandoffState, request_id: Optional[str] = None, *,
                       tenant: Optional[str] = None, row_processors: Sequence = ()) -> Request:
        """Continue a request another engine handed off: :func:`specdec.engine.handoff.import_request`."""
        return import_request(self, state, request_id, tenant=tenant, row_processors=row_processors)

    # -- admission (admission.py) ------------------------------------------------------------

    def checked_prompt(self, prompt_token_ids: Sequence[int]) -> np.ndarray:
        """The prompt as an int64 array, or a :class:`RequestError` naming what is wrong."""
        return admission.checked_prompt(prompt_token_ids, self.model_config.vocab_size, self.max_model_len,
                                        self.block_size, self.kv.pool.num_blocks)

    def check_sampling(self, sampling: SamplingParams, num_prompt_tokens: int) -> None:
        """Check ``sampling`` against this engine; a :class:`RequestError` names the field."""
        admission.check_sampling(sampling, num_prompt_tokens, self.model_config.vocab_size, self.max_model_len,
                                 self.config.max_stop_strings, self.config.max_stop_string_length)

    def abort_request(self, request_id: str) -> bool:
        """Stop a queued or running request now (finish reason ``abort``) and free its KV
        blocks. Returns False when no unfinished request has that id."""
        for request in (*self.scheduler.running, *self.scheduler.waiting):
            if request.request_id == request_id:
                self._retire(request, "abort")
                return True
        return False

    @property
    def num_kv_blocks(self) -> int:
        """Size of the KV block pool."""
        return self.kv.pool.num_blocks

    @property
    def num_free_kv_blocks(self) -> int:
        """Blocks of the KV pool that no request holds (equals ``num_kv_blocks`` when idle)."""
        return self.kv.pool.num_free

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def reset_prefix_cache(self) -> None:
        """Forget the cached prompt prefixes (benchmarks start each run cold). Only when idle."""
        if self.has_unfinished():
            raise SpecdecError("cannot reset the prefix cache while requests are running")
        self.kv.pool.reset_prefix_cache()

    def reset_controller(self) -> None:
        """Forget what the drafting controller learned for the current method (step costs,
        acceptance, the proposer's time): the next requests start from its priors, as on a
        fresh engine. For runs whose drafting must not depend on what ran before (timings
        taken under another load mislead it for a hundred steps). Only when idle."""
        if self.has_unfinished():
            raise SpecdecError("cannot reset the drafting controller while requests are running")
        self.controller = self._controllers[self.spec.method] = DraftController(row_curve=self._row_curve(self.spec))

    def _retire(self, request: Request, reason: Optional[str]) -> None:
        """Take a request out of the engine for good: blocks, proposer state, final text."""
        self.scheduler.remove(request)
        if request.started:
            try:
                self.proposer.on_request_finish(request.request_id)
            except Exception:  # noqa: BLE001 - the request is over either way
                logger.exception("proposer '%s': on_request_finish(%s) failed", self.spec.method, request.request_id)
        self.controller.forget(request.request_id)
        self.predictions.forget(request.request_id)
        self.hidden_states.drop(request)
        self.captured_hidden.drop(request)
        self._finish(request, reason or request.finish_reason)

    def _fail(self, request: Request, phase: str, exc: Exception) -> None:
        """End ``request`` with finish reason ``error``: ``phase`` raised ``exc`` for it."""
        message = " ".join(str(exc).split())
        request.error = f"{phase} failed: {type(exc).__name__}: {message}" if message else \
            f"{phase} failed: {type(exc).__name__}"
        logger.error("request %s: %s", request.request_id, request.error, exc_info=exc)
        self._retire(request, "error")

    def _isolated(self, phase: str, state: _StepState, call: Callable[[_StepState], T],
                  members: Callable[[_StepState], list[Request]], repeat: bool = True) -> tuple[_StepState, Optional[T]]:
        """``call(state)``, so that a plugin or model failure ends only the requests it concerns.

        When the call raises, it is tried for each of ``members(state)`` alone; those that
        raise alone fail (finish reason ``error``), every one of them if none does (a failure
        of the combination), and the call runs again for the rest. Returns the state of the
        requests left and the call's result for them. With ``repeat`` the call must be safe
        to repeat: the proposals, the forward pass (it rewrites the same KV rows) and
        verification are; without it, the calls for single requests stand as the result.
        """
        try:
            return state, call(state)
        except Exception as batch_error:  # noqa: BLE001 - sorted out below, request by request
            failing = []
            for request in members(state):
                try:
                    call(state.only(lambda r: r is request))
                except Exception as exc:  # noqa: BLE001
                    failing.append((request, exc))
            if not failing:
                failing = [(request, batch_error) for request in members(state)]
        for request, exc in failing:
            self._fail(request, phase, exc)
        state = state.only(lambda r: r.error is None)
        if not members(state) or not repeat:
            return state, None
        try:
            return state, call(state)
        except Exception as exc:  # noqa: BLE001 - fails again without the culprits: end them all
            for request in members(state):
                self._fail(request, phase, exc)
            return state.only(lambda r: r.error is None), None

    # -- the step ----------------------------------------------------------------------------

    def _max_draft_len(self, request: Request) -> int:
        """The most drafts ``request`` can use: its k, and room for accepted drafts + 1 token
        (none for a request that is handed off after its first token)."""
        if request.handoff:
            return 0
        k = Predictions.max_draft_len(request, self.num_speculative_tokens)
        room = min(request.remaining, self.max_model_len - request.num_tokens) - 1
        return max(0, min(k, room))

    def step(self) -> list[Request]:
        """Run one step for the scheduled requests; return the requests that finished.

        The phases, in order (docs/architecture.md, "The step"): schedule, start the admitted
        requests (``proposer.on_request_start``), then for the scheduled rows :meth:`_run_step`:
        propose, pack and forward, verify, accept, update. Every plugin and model call runs
        isolated (:meth:`_isolated`): one that raises ends only the requests it raises for,
        with finish reason ``error`` and ``Request.error`` saying why; the rest go on."""
        plan = self.scheduler.schedule(self._max_draft_len)
        for request in plan.exhausted:
            self._retire(request, "length")
        for request in plan.preempted:  # it recomputes its rows, hidden states included
            request.proposed_last_step = False
            request.proposed_through = 0
            request.rows_caught_up = 0
            request.states_handed_through = 0
            self.hidden_states.drop(request)
            self.captured_hidden.drop(request)
        for request in plan.admitted:
            if not request.started:  # not a preempted request coming back
                self.start_request(request)
        touched = {id(r): r for r in (*plan.exhausted, *plan.admitted, *plan.requests)}
        plan = plan.keeping(lambda r: not r.finished)
        if plan.num_requests:
            self._run_step(plan)
        return [request for request in touched.values() if request.finished]

    def _proposal_request(self, request: Request, max_draft_len: int) -> ProposalRequest:
        """What the proposer sees of ``request`` this step (the hidden states kept for it are
        handed over when it is proposed for: :meth:`_with_hidden_states`)."""
        max_draft_len = self._method_draft_len(request, max_draft_len)
        return ProposalRequest(request.request_id, request.token_ids, request.num_prompt_tokens, max_draft_len,
                               sampling=request.sampling, rng=request.rng, tenant=request.tenant)

    def _method_draft_len(self, request: Request, room: int) -> int:
        """The most drafts the method's proposer gives ``request`` in a step with ``room``
        drafts left it (a prediction may have left more room than the method's ``k``)."""
        method_k = self.num_speculative_tokens
        if request.sampling.num_speculative_tokens is not None:
            method_k = min(method_k, request.sampling.num_speculative_tokens)
        return min(int(room), method_k)

    def _with_hidden_states(self, proposal: ProposalRequest, request: Request) -> ProposalRequest:
        """``proposal`` with every hidden state kept for ``request`` since its last proposal
        (more than one step's when the controller left it out of some) and its block table."""
        if proposal.hidden_positions is None:  # not taken by an earlier try of this step
            proposal.hidden_states, proposal.hidden_positions = self.hidden_states.take(request)
            if len(proposal.hidden_positions):
                request.states_handed_through = int(proposal.hidden_positions[-1]) + 1
        proposal.block_table = np.asarray(request.block_table, dtype=np.int32)
        proposal.block_table.flags.writeable = False
        return proposal

    def start_request(self, request: Request) -> None:
        """Tell the proposer a request starts (its prompt), and for an imported request the
        tokens generated elsewhere (one ``on_step``); a failure ends that request alone."""
        request.started = True
        prompt = request.tokens[: request.num_prompt_tokens]
        try:
            self.proposer.on_request_start(ProposalRequest(request.request_id, prompt, request.num_prompt_tokens, 0,
                                                           tenant=request.tenant))
            if request.num_generated:
                before = ProposalRequest(request.request_id, prompt, request.num_prompt_tokens, 0,
                                         sampling=request.sampling, rng=request.rng, tenant=request.tenant)
                if self.proposer.NEEDS_HIDDEN_STATES:
                    before.block_table = np.asarray(request.block_table, dtype=np.int32)
                self.proposer.on_step(ProposalBatch([before]), [request.generated_ids.copy()])
        except Exception as exc:  # noqa: BLE001 - fails this request alone
            self._fail(request, f"proposer '{self.spec.method}' on_request_start", exc)

    def _run_step(self, plan: ScheduledStep) -> None:
        """Propose, pack and forward, verify, accept and update for the requests of ``plan``;
        each phase narrows the step to the requests that have not failed."""
        started = time.perf_counter()
        state = _StepState(plan, ProposalBatch([
            self._proposal_request(r, max_draft_len) for r, max_draft_len in zip(plan.decodes, plan.max_draft_lens)
        ]))
        decoding = lambda s: s.plan.decodes  # noqa: E731 - the members of the decode-only phases
        # propose: proposer.propose, then the caps and the adaptive draft length
        state, state.drafts = self._isolated(f"proposer '{self.spec.method}'", state, self._propose, decoding)
        if state.drafts is None:  # every decoding request failed; prefill chunks go on
            state.drafts = Drafts.empty(0)
        # pack and forward: one model call for every row of the step
        state, state.logits = self._isolated("model forward", state, self._forward, lambda s: s.plan.requests)
        for request, rows in state.plan.chunks:
            if state.hidden is not None:
                self._keep_hidden(state, request, request.context_len, rows)
            request.context_len += rows
            self._register_computed(request)
        if not state.plan.decodes:
            return
        # process, verify, accept: per group of draft widths where that copies fewer logits
        state = self._verified(state)
        if not state.plan.decodes:
            return
        # update: append the tokens, then proposer.on_step, then retire the finished
        # (proposer.on_request_finish); on_step is not safe to repeat: after a failure the
        # calls for single requests are the update.
        state, appended = self._update(state)
        done = [r for r in state.plan.decodes if r.finished]
        self._isolated(f"proposer '{self.spec.method}' on_step", state,
                       lambda s: self.proposer.on_step(s.batch, [appended[id(r)] for r in s.plan.decodes]),
                       decoding, repeat=False)
        for request in done:
            if request.error is None:
                self._retire(request, request.finish_reason)
        caught_up_seconds = self._catch_up_after_step(state) if self.proposer.CATCHES_UP_AFTER_STEP else 0.0
        if state.decode_rows:
            # Only decode steps feed the cost model: a prefill row also attends over its whole
            # prompt, which would make every draft row look dearer than it is.
            self.controller.step_time(state.decode_rows, time.perf_counter() - started - state.proposer_seconds
                                      - caught_up_seconds)

    def _catch_up_after_step(self, state: _StepState) -> float:
        """Hand a proposer with ``CATCHES_UP_AFTER_STEP`` the hidden states this step decided
        for the requests it proposed for, now (``Proposer.catch_up``) rather than with their
        next proposal, so that it can run on them while the engine finishes the step and
        plans the next. Each such request first gets the block of its last token's position
        (the next step needs it anyway); one that cannot waits for its next proposal. Returns
        the call's seconds, which count as the proposer's at the next step."""
        proposals: dict[int, ProposalRequest] = {}
        for request in state.plan.decodes:
            if request.finished or not request.proposed_last_step or not self.kv.grow(request, request.num_tokens):
                continue
            hidden, positions = self.hidden_states.take(request)
            if not len(positions):
                continue
            table = np.asarray(request.block_table, dtype=np.int32)
            table.flags.writeable = False
            proposals[id(request)] = ProposalRequest(
                request.request_id, request.token_ids, request.num_prompt_tokens, self.num_speculative_tokens,
                hidden_states=hidden, hidden_positions=positions, block_table=table, sampling=request.sampling,
                rng=request.rng, tenant=request.tenant)
            request.proposed_through = request.num_tokens
            request.states_handed_through = int(positions[-1]) + 1
            request.rows_caught_up += len(positions)
        if not proposals:
            return 0.0
        started = time.perf_counter()
        self._isolated(f"proposer '{self.spec.method}' catch_up", state,
                       lambda s: self.proposer.catch_up(ProposalBatch(
                           [proposals[id(r)] for r in s.plan.decodes if id(r) in proposals])),
                       lambda s: [r for r in s.plan.decodes if id(r) in proposals], repeat=False)
        seconds = time.perf_counter() - started
        self._caught_up_seconds += seconds
        return seconds

    def _verified(self, state: _StepState) -> _StepState:
        """Process the rows, verify and accept (:meth:`_verify_group`) on the ``[B, k+1, V]``
        logits of the step. Where most requests have no draft and a few have long ones, that
        array would be mostly padding (a batch of 64 with drafts of 5 copies 64 x 6 rows of
        logits, 75 MB, for 70 real rows). A step that needs only each row's argmax (every
        request greedy, without row processors or logprobs) verifies from the step's rows
        through their index (:class:`PickedRows`), no copy; otherwise the requests without
        drafts and those with drafts go as two groups, each at its own width, and the results
        are put together."""
        raw, packed, lengths = state.logits, state.packed, state.drafts.lengths
        if isinstance(raw, np.ndarray) and packed.padded_rows is not None and _reads_argmax_only(state.plan.decodes):
            state.logits = PickedRows(raw, packed.padded_rows)
            return self._verify_group(state)
        groups = [np.flatnonzero(lengths == 0), np.flatnonzero(lengths > 0)]
        padded = len(lengths) * (state.drafts.width + 1)
        if not isinstance(raw, np.ndarray) or packed.padded_rows is None or not all(len(g) for g in groups) \
                or padded < 2 * len(raw):
            state.logits = packed.verify_logits(raw)
            return self._verify_group(state)
        state.logits = None
        results: dict[int, tuple] = {}
        for rows in groups:
            members = {id(state.plan.decodes[b]) for b in rows}
            group = state.only(lambda r: id(r) in members)
            group.drafts = group.drafts.clipped(group.drafts.lengths)
            group.logits = raw[packed.padded_rows[rows, : group.drafts.width + 1]]
            group = self._verify_group(group)
            for b, request in enumerate(group.plan.decodes):
                result = group.result
                results[id(request)] = (result.accepted_lengths[b], result.output_tokens[b], result.target_tokens[b])
        state = state.only(lambda r: id(r) in results)
        state.result = _merged_result([results[id(r)] for r in state.plan.decodes], state.drafts.width)
        return state

    def _verify_group(self, state: _StepState) -> _StepState:
        """Process the rows, verify the drafts and apply the accept policy for the requests of
        ``state`` (its logits ``[B, k+1, V]``); each phase narrows it to the requests that
        have not failed."""
        decoding = lambda s: s.plan.decodes  # noqa: E731 - the members of these phases
        # process: raw logprobs, then each request's row processors (penalties, bias, ...)
        state = self._process_rows(state)
        if not state.plan.decodes:
            return state
        # verify: verify_strategy.verify on [B, k+1, V] logits
        state.sampling = self._sampling(state.plan.decodes, state.drafts)
        state, state.result = self._isolated(
            f"verify strategy '{self.spec.verify_strategy}'", state,
            lambda s: self._checked_result(self.verifier.verify(self._verify_inputs(s)), s),
            decoding)
        if not state.plan.decodes:
            return state
        # accept: accept_policy.apply
        state, state.result = self._isolated(
            f"accept policy '{self.spec.accept_policy}'", state,
            lambda s: self._checked_result(self.accept_policy.apply(s.result, s.drafts), s), decoding)
        return state

    def _process_rows(self, state: _StepState) -> _StepState:
        """Keep the raw log-probabilities of the requests that ask for them (``logprobs.py``),
        then apply the requests' row processors (``logits_processing.py``) to the step's
        logits; a processor that raises fails its own request alone."""
        decodes = state.plan.decodes
        for b, request in enumerate(decodes):
            if request.sampling.logprobs is not None:
                state.logprobs[id(request)] = log_softmax(state.logits[b, : int(state.drafts.lengths[b]) + 1])
        if not any(r.row_processors for r in decodes):
            return state
        state.logits, failures = apply_row_processors(decodes, state.logits, state.drafts.token_ids,
                                                      state.drafts.lengths)
        if not failures:
            return state
        for b, exc in failures:
            self._fail(decodes[b], "row processor", exc)
        return state.only(lambda r: r.error is None)

    def _checked_result(self, result: VerifyResult, state: _StepState) -> VerifyResult:
        """``result`` when it has the shapes and values of the contract, else a SpecdecError
        (a bad token id would otherwise reach the embedding lookup next step)."""
        drafts = state.drafts
        shape = (drafts.batch_size, drafts.width + 1)
        accepted = np.asarray(result.accepted_lengths)
        tokens = np.asarray(result.output_tokens)
        if accepted.shape != shape[:1] or tokens.shape != shape:
            raise SpecdecError(f"returned accepted_lengths {accepted.shape} and output_tokens {tokens.shape}; "
                               f"expected {shape[:1]} and {shape}")
        if (accepted < 0).any() or (accepted > drafts.lengths).any():
            raise SpecdecError("returned accepted_lengths outside [0, the draft length]")
        emitted = np.arange(shape[1])[None, :] <= accepted[:, None]
        if ((tokens < 0) | (tokens >= self.model_config.vocab_size))[emitted].any():
            raise SpecdecError(f"returned token ids outside [0, {self.model_config.vocab_size})")
        return result

    def _propose(self, state: _StepState) -> Drafts:
        """The step's drafts: the proposer's for the requests the controller proposes for
        (``controller.py``), composed with the requests' predictions, cut by the adaptive
        draft length."""
        batch, plan = state.batch, state.plan
        max_draft_lens = np.fromiter((r.max_draft_len for r in batch.requests), dtype=np.int64, count=len(batch))
        rooms = np.asarray(plan.max_draft_lens, dtype=np.int64)  # more than the method's with a prediction
        request_ids = [r.request_id for r in batch.requests]
        adaptive = self.spec.adaptive_draft_length
        needs_hidden = self.proposer.NEEDS_HIDDEN_STATES
        keeps = self._keeps_drafts(plan.decodes)
        predicted = self.predictions.drafts(plan.decodes, rooms)
        # A request whose prediction draft wins whatever the method drafts needs no proposer
        # call this step (a model proposer catches up when it next drafts for it); but a
        # seeded sampled request's proposer always runs, drawing from its random stream as
        # it would alone.
        led = self.predictions.leading(predicted, np.fromiter(
            (self._method_draft_len(r, room) for r, room in zip(plan.decodes, rooms)), dtype=np.int64,
            count=len(plan.decodes))) & ~keeps if predicted else np.zeros(len(batch), dtype=bool)
        # A model proposer also gets the requests without room to draft that it proposed for
        # at their previous step: a row or two keeps it caught up on their states. One it left
        # out waits for its next proposal (a request without room gets none again: its
        # remaining tokens only shrink), rather than pay a catch-up over every step it missed.
        kept_up = np.fromiter((r.proposed_last_step for r in plan.decodes), dtype=bool, count=len(plan.decodes))
        wanted = ((max_draft_lens > 0) | (needs_hidden & kept_up)) & ~led
        unseen = np.fromiter((r.num_tokens - r.proposed_through for r in plan.decodes), dtype=np.int64,
                             count=len(plan.decodes))
        asked = max_draft_lens
        if adaptive:
            wanted &= self.controller.proposing(request_ids, keeps, max_draft_lens, unseen, without_proposer=led)
        if adaptive and wanted.any():  # (with the proposer off for all, nothing is asked)
            # No more drafts than are worth their proposer's time and their rows; a request
            # whose first draft is not worth them this step is left out of the call.
            asked = self.controller.drafts_to_ask(request_ids, max_draft_lens, len(plan.decodes), len(batch))
            wanted &= ~((asked == 0) & (max_draft_lens > 0))
        proposer_off = ~wanted & ~led & (max_draft_lens > 0)
        if needs_hidden:
            # A model proposer gets a request's prompt states at its first decode step, asked
            # for no drafts where it would not have been called: the prompt's blocks join the
            # prefix cache once it has them (_register_computed), not after a long wait.
            first = np.fromiter((r.states_handed_through == 0 for r in plan.decodes), dtype=bool,
                                count=len(plan.decodes)) & ~wanted
            if first.any():
                asked = np.where(first, 0, asked)
                wanted |= first
        rows = np.flatnonzero(wanted)
        catching_up = self._catching_up(kept_up[rows])
        caught_up_tokens = int(unseen[rows][~kept_up[rows]].sum())
        for request, proposed in zip(plan.decodes, wanted):
            request.proposed_last_step = bool(proposed)
            if proposed:
                request.proposed_through = request.num_tokens
        state.proposed = wanted & (asked > 0)
        state.proposer_off = proposer_off
        drafts = Drafts.empty(len(batch))
        if len(rows) and (needs_hidden or max_draft_lens[rows].any()):
            proposals = [batch.requests[b] if asked[b] == max_draft_lens[b]
                         else attrs.evolve(batch.requests[b], max_draft_len=int(asked[b])) for b in rows]
            timed = True
            if needs_hidden:
                proposals = [self._with_hidden_states(p, plan.decodes[b]) for p, b in zip(proposals, rows)]
                earlier = np.fromiter((plan.decodes[b].rows_caught_up for b in rows), dtype=np.int64, count=len(rows))
                for b in rows:
                    plan.decodes[b].rows_caught_up = 0
                # what the proposer catches up on is in the rows handed over, not in the tokens
                catching_up, caught_up_tokens, timed = self._hidden_catch_up(proposals, rooms[rows], earlier)
            price = self.controller.row_price(len(plan.decodes), len(batch)) if adaptive else 0.0
            started = time.perf_counter()
            proposed = self.proposer.propose(ProposalBatch(proposals, row_price=price))
            state.proposer_seconds = time.perf_counter() - started
            # what the proposer cost: this call and its catch-up at the end of the step before
            spent, self._caught_up_seconds = state.proposer_seconds + self._caught_up_seconds, 0.0
            if proposed.batch_size != len(rows):
                raise SpecdecError(
                    f"proposer '{self.spec.method}' returned {proposed.batch_size} drafts for {len(rows)} requests")
            if proposed.classes is not None:
                classes = valid_draft_classes(proposed.classes, len(rows))
                if classes is None:
                    raise SpecdecError(f"proposer '{self.spec.method}' returned draft classes that are not "
                                       f"{len(rows)} non-negative integer labels")
                proposed.classes = classes
                self.controller.drafts_have_classes = True
            if proposed.lengths.any():
                self.controller.drafts_seen = True
            if timed and catching_up:
                self.controller.catch_up_time(len(rows), spent, caught_up_tokens,
                                              [request_ids[b] for b in rows])
            elif timed:
                self.controller.proposer_time(len(rows), spent, int(proposed.lengths.max(initial=0)))
            drafts = proposed if len(rows) == len(batch) else proposed.placed(rows, len(batch))
        drafts, max_draft_lens = self.predictions.compose(plan.decodes, drafts, max_draft_lens, predicted)
        lengths = np.minimum(drafts.lengths, max_draft_lens)
        # A request proposed for because it is seeded and sampled keeps its drafts (see
        # _keeps_drafts), as does one probed this step.
        max_draft_lens = self.controller.draft_lengths(request_ids, lengths, drafts.classes, len(plan.decodes),
                                                       len(batch), adaptive)
        if (drafts.lengths > max_draft_lens).any() or drafts.width > max_draft_lens.max(initial=0):
            drafts = drafts.clipped(max_draft_lens)
        return drafts

    @staticmethod
    def _hidden_catch_up(proposals: list[ProposalRequest], rooms: np.ndarray,
                         earlier: np.ndarray) -> tuple[bool, int, bool]:
        """For a proposer that reads hidden states: ``(catching_up, tokens, timed)``. Its
        catch-up shows in the rows handed over, more than one step makes (the fed row and
        the accepted drafts, at most ``room + 1``): a request's prompt reaches it at the step
        after its prefill (whose own call hands over nothing yet), the steps it was left out of
        at its next proposal. ``earlier``: rows handed at the end of the last step
        (``Proposer.catch_up``), which count as handed now. ``tokens``: the rows of the requests
        catching up. A call that hands over no row at all (every request at its prefill's step)
        is not timed (``timed`` False): it is neither a usual call nor a catch-up."""
        handed = np.fromiter((len(p.hidden_positions) for p in proposals), dtype=np.int64,
                             count=len(proposals)) + earlier
        behind = handed > np.asarray(rooms, dtype=np.int64) + 1
        return bool(behind.any()), int(handed[behind].sum()), bool(handed.any())

    @staticmethod
    def _catching_up(proposed_last_step: np.ndarray) -> bool:
        """Whether a proposer call may carry a catch-up: one of its requests was not proposed
        for at its previous step (``proposed_last_step``, ``[n]`` bool: its first proposal, or
        the controller left it out). A model proposer then runs every token it missed (a draft
        model its whole prompt), one-time work that is not what drafting costs a step: the
        controller does not learn the proposer's time from such a call."""
        return not proposed_last_step.all()

    @staticmethod
    def _keeps_drafts(requests: list[Request]) -> np.ndarray:
        """``[B]`` bool: the seeded requests at temperature > 0, which are always proposed for
        and keep all their drafts: which drafts are verified decides which random numbers a
        lossless strategy draws, and their tokens must depend on their seed alone, not on
        what else shares the batch."""
        return np.fromiter((r.sampling.reproducible for r in requests), dtype=bool, count=len(requests))

    def _forward(self, state: _StepState) -> np.ndarray:
        """Pack every scheduled request's rows (``batch.py``; the packing goes to
        ``state.packed``), run the model, return the ``[R, V]`` logits of the decoding
        requests' rows (prefill chunks need none; :meth:`_verified` lays them out per request).
        For a proposer that reads hidden states, or a request that captures them for its
        hand-off, ``state.hidden`` gets every row's."""
        plan = state.plan
        packed = pack_step(
            [SequenceRows(r.tokens[r.context_len: r.num_tokens], r.context_len, r.block_table) for r in plan.decodes],
            state.drafts,
            [SequenceRows(r.tokens[r.context_len: r.context_len + rows], r.context_len, r.block_table)
             for r, rows in plan.chunks],
            self.block_size)
        state.decode_rows = packed.meta.num_rows if packed.is_decode_only else 0
        # The fused verify kernels read the logits where the model left them.
        options = {"device_logits": True} if self.kernels == "triton" else {}
        if self.proposer.NEEDS_HIDDEN_STATES or any(r.capture_hidden for r in plan.requests):
            if self.hidden_layers is not None:
                options["hidden_layers"] = self.hidden_layers
            logits, state.hidden = self.model.forward(packed.token_ids, packed.meta, packed.logit_rows,
                                                      return_hidden=True, **options)
            starts = packed.meta.cu_seqlens_q
            state.first_rows = {id(r): int(starts[i]) for i, r in enumerate(plan.requests)}
        else:
            logits = self.model.forward(packed.token_ids, packed.meta, packed.logit_rows, **options)
        state.packed = packed
        return logits

    @staticmethod
    def _verify_inputs(state: _StepState) -> VerifyInputs:
        """The verify strategy's inputs; device logits stay on the device (the strategy copies
        them to the host only if it has no fused kernel)."""
        if isinstance(state.logits, np.ndarray):
            return VerifyInputs(state.logits, state.drafts, state.sampling)
        if isinstance(state.logits, PickedRows):
            return VerifyInputs(None, state.drafts, state.sampling, rows=state.logits.rows,
                                row_index=state.logits.index)
        return VerifyInputs(None, state.drafts, state.sampling, device_logits=state.logits)

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

    def _update(self, state: _StepState) -> tuple[_StepState, dict[int, np.ndarray]]:
        """Append each request's emitted tokens (cut at EOS and limits, for the whole batch at
        once), move its KV length past the accepted rows, check stop strings. Returns the
        state of the requests updated without error and, by ``id(request)``, what each got."""
        decodes, drafts, result = state.plan.decodes, state.drafts, state.result
        accepted = result.accepted_lengths
        counts, reasons = self._emitted_counts(decodes, result.output_tokens, accepted)
        self.controller.record([r.request_id for r in decodes], state.proposed, drafts.classes, drafts.lengths,
                               accepted)
        self.predictions.record(decodes, drafts.lengths, accepted)
        appended_by_request = {}
        for b, request in enumerate(decodes):
            try:
                count = int(counts[b])
                if state.hidden is not None:  # the fed rows and the accepted drafts' rows
                    self._keep_hidden(state, request, request.context_len, request.num_uncomputed + int(accepted[b]))
                request.context_len = request.num_tokens + int(accepted[b])
                appended = self._append(request, result.output_tokens[b, :count], reasons[b])
                request.token_sources += step_sources(int(drafts.lengths[b]), int(accepted[b]), count)
                for processor in request.row_processors:
                    processor.on_emitted(appended)
                if id(request) in state.logprobs:
                    request.logprobs.extend(emitted_logprobs(state.logprobs[id(request)], appended,
                                                             request.sampling.logprobs))
                self._register_computed(request)
                request.metrics.record_step(int(drafts.lengths[b]), int(accepted[b]), count,
                                            proposer_off=bool(state.proposer_off[b]))
                appended_by_request[id(request)] = appended
                self._check_stop_strings(request)
                if request.handoff and not request.finished:
                    export_request(self, request)
            except Exception as exc:  # noqa: BLE001 - a detokenizer failure, say: this request only
                self._fail(request, "update", exc)
        return state.only(lambda r: id(r) in appended_by_request and r.error is None), appended_by_request

    def _register_computed(self, request: Request) -> None:
        """Offer the prompt blocks ``request`` has computed to the prefix cache. With a
        proposer that reads hidden states, only those whose states it has been handed
        (``states_handed_through``; it writes its own cache rows there as it takes them, the
        ``Proposer.NEEDS_HIDDEN_STATES`` contract): a request that shares a block reads the
        proposer's rows for its tokens there, never rows it has not written yet (cache layers are
        allocated uninitialized: an MTP head attended over whatever that memory held)."""
        self.kv.register_computed(request, self.shareable_through(request))

    def shareable_through(self, request: Request) -> Optional[int]:
        """The position below which ``request``'s computed prompt blocks may be shared (see
        :meth:`_register_computed`); None: every computed block."""
        return request.states_handed_through if self.proposer.NEEDS_HIDDEN_STATES else None

    def _keep_hidden(self, state: _StepState, request: Request, first_position: int, count: int) -> None:
        """Keep ``count`` rows of the step's hidden states of ``request`` from ``first_position``:
        for the proposer when it reads them, and for the request's hand-off when it captures them."""
        first_row = state.first_rows[id(request)]
        if self.proposer.NEEDS_HIDDEN_STATES:
            self.hidden_states.keep(request, state.hidden, first_row, first_position, count)
        if request.capture_hidden:
            self.captured_hidden.keep(request, state.hidden, first_row, first_position, count)

    def _emitted_counts(self, decodes, output_tokens: np.ndarray, accepted: np.ndarray):
        """How many of each request's ``accepted + 1`` output tokens it keeps, and why it stops
        (``stop`` at an EOS, ``length`` at max_tokens or the context end, else ``None``)."""
        counts = accepted + 1
        reasons = np.full(len(decodes), None, dtype=object)
        eos_ok = np.fromiter((not r.sampling.ignore_eos for r in decodes), dtype=bool, count=len(decodes))
        stop_ids = [b for b, r in enumerate(decodes) if r.sampling.stop_token_ids]
        if (self._eos_array.size and eos_ok.any()) or stop_ids:
            positions = np.arange(output_tokens.shape[1])[None, :]
            # A comparison against each EOS id, not np.isin: a model has one to three of them, and
            # np.isin's sorting took 50 us of a batch-1 step on the caches a forward pass flushes.
            is_eos = (output_tokens[:, :, None] == self._eos_array).any(axis=2) & eos_ok[:, None]
            for b in stop_ids:  # the request's own stop tokens, with or without ignore_eos
                is_eos[b] |= np.isin(output_tokens[b], decodes[b].sampling.stop_token_ids)
            is_eos &= positions < counts[:, None]
            hit = is_eos.any(axis=1)
            counts = np.where(hit, np.argmax(is_eos, axis=1) + 1, counts)
            reasons[hit] = "stop"
        limits = np.fromiter((min(r.remaining, self.max_model_len - r.num_tokens) for r in decodes),
                             dtype=np.int64, count=len(decodes))
        at_limit = (counts > limits) | ((counts == limits) & (reasons == None))  # noqa: E711
        counts = np.where(counts > limits, limits, counts)
        reasons[at_limit] = "length"
        return counts, reasons

    def _append(self, request: Request, emitted: np.ndarray, reason: Optional[str]) -> np.ndarray:
        """Append ``emitted`` (already cut at its stop condition); return what was appended."""
        if reason is not None:
            request.finish_reason = reason
        start, count = request.num_tokens, len(emitted)
        if start == request.num_prompt_tokens and count:
            request.first_token_time = time.perf_counter()
        request.tokens[start: start + count] = emitted
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
        # A handed-off request's text goes on elsewhere: a character still held back is not over.
        if request.detokenizer is not None and reason != "handoff":
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
