"""The engine: one step path for every method (schedule, propose, pack, forward, verify, accept,
update), as docs/architecture.md describes it.

Requests join and leave the batch between steps (continuous batching, ``scheduler.py``); their
KV caches live in fixed-size blocks of one pool (``kv_cache.py``), shared between requests
with a common prompt prefix. A step packs every scheduled request's new rows into one token
array (prefill chunks, and for decoding requests the last token plus its drafts), runs one
forward pass, and verifies the drafts of the whole batch in one call on ``[B, k+1, V]``
logits. Rejected rows are dropped by length: the next step overwrites them.
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

from ..config import MAX_SPECULATIVE_TOKENS, EngineConfig, SpeculativeConfig
from ..errors import RequestError, SpecdecError
from ..plugin_kinds import SPECULATIVE_KINDS
from ..proposer import Drafts, ProposalBatch, ProposalRequest, valid_draft_classes
from ..sampling import SamplingParams
from ..verify import BatchSampling, VerifyInputs, VerifyResult
from .adaptive import AcceptanceModel, StepCostModel, choose_draft_lengths
from .batch import SequenceRows, pack_step
from .handoff import HandoffState, KVLayout
from .hidden_states import PendingHiddenStates
from .kv_cache import BlockPool, KVCacheManager
from .request import Request, RequestOutput
from .scheduler import ScheduledStep, Scheduler
from .tensor_parallel import exit_after_failure

logger = logging.getLogger("specdec.engine")
T = TypeVar("T")


def _on_gpu() -> bool:
    from ..errors import require_paddle

    paddle = require_paddle()
    return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def resolve_kv_cache_dtype(kv_cache_dtype: str, backend: str, weight_dtype: str) -> str:
    """The cache dtype ``kv_cache_dtype`` comes to: ``auto`` follows the weights with the
    ``cpu`` backend (whose kernel reads either) and is float32 with any other."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    return weight_dtype if backend == "cpu" else "float32"


def resolve_quantization(config: EngineConfig, kernels: str) -> str:
    """What ``config.quantization`` comes to for this model and these kernels, before loading:
    ``auto`` is ``gguf`` for a GGUF file on the CPU kernels (the engine turns it into ``none``
    once loading finds no quantized matrix in the file), else ``none``; a quantized path the
    model or the kernels cannot take is a one-line error."""
    from ..model.resolve import resolve_model_path

    quantization = config.quantization
    path = resolve_model_path(config.model)
    is_gguf = path.suffix == ".gguf"
    if quantization == "auto":
        return "gguf" if kernels == "cpu" and is_gguf else "none"
    if quantization != "none" and kernels != "cpu":
        raise SpecdecError(f"quantization: {quantization} needs the CPU kernels (kernels: cpu or auto)")
    if quantization == "gguf" and not is_gguf:
        raise SpecdecError(f"quantization: gguf computes on a GGUF file's blocks, and {config.model} is not a "
                           f"GGUF file; use wint8 or wint4")
    return quantization


def resolve_kernels(config: EngineConfig) -> tuple[str, str]:
    """``(kernels, weight dtype)`` that ``config.kernels`` and ``config.dtype`` come to here.

    ``auto``: on a CUDA device ``triton`` when Triton can run there, else ``paddle``; on the
    CPU ``cpu`` when the CPU kernels build (they take CPU tensors only), else ``paddle``, and
    ``paddle`` with tensor parallelism (which splits the float32 paddle path only).
    ``auto`` dtype is float16 weights with the CPU kernels, float32 with any other (the
    ``paddle`` and ``triton`` paths multiply with paddle's float32 ops)."""
    from specdec.kernels.cpu import KernelUnavailable, load_cpu_ops
    from specdec.kernels.triton import load_triton

    dtype = config.dtype
    if dtype == "bfloat16":
        raise SpecdecError("dtype: bfloat16 is not supported on this build; use float32 or float16")
    kernels = config.kernels
    if kernels == "auto":
        if _on_gpu():
            try:
                load_triton()
                kernels = "triton"
            except KernelUnavailable:
                kernels = "paddle"
        elif config.tensor_parallel_size > 1:
            kernels = "paddle"  # tensor parallelism splits the float32 paddle path only
        else:
            kernels = "cpu"
            try:
                load_cpu_ops()
            except KernelUnavailable:
                if dtype == "float16":
                    raise SpecdecError("dtype: float16 weights need the CPU kernels, which cannot be built "
                                       "here; use dtype: float32") from None
                kernels = "paddle"
    elif kernels == "cpu":
        if config.tensor_parallel_size > 1:
            raise SpecdecError("kernels: cpu does not split over tensor_parallel_size ranks; use paddle (or auto)")
        try:
            load_cpu_ops()
        except KernelUnavailable as exc:
            raise SpecdecError(f"kernels: {exc}; use kernels: paddle") from None
    elif kernels == "triton":
        try:
            load_triton()
        except KernelUnavailable as exc:
            raise SpecdecError(f"kernels: {exc}; use kernels: paddle") from None
    if dtype == "auto":
        dtype = "float16" if kernels == "cpu" else "float32"
    if kernels != "cpu" and dtype != "float32":
        raise SpecdecError(f"dtype: {dtype} weights need the CPU kernels (kernels: cpu or auto)")
    return kernels, dtype


@attrs.define
class BuiltModel:
    """What :func:`build_model` made: the model and what was resolved on the way."""

    kernels: str
    weight_dtype: str
    quantization: str
    backend: str
    attention: Any
    kv_cache_dtype: str
    model_config: Any
    max_model_len: int
    model: Any
    tokenizer: Any
    #: With tensor parallelism, the whole embedding and LM head (numpy) for rank 0's proposers.
    embedding: Any = None
    lm_head: Any = None


def build_model(config: EngineConfig, plugins, progress: bool = True, tensor_parallel=None) -> BuiltModel:
    """Resolve kernels, attention backend, quantization and cache dtype for ``config``, load
    the checkpoint and build the model (one rank's slice with ``tensor_parallel``, as
    :class:`~specdec.model.llama.LlamaModel` takes it). The engine and the tensor-parallel
    workers both build theirs here, so that every rank resolves the same way."""
    from ..model.llama import LlamaModel
    from ..model.quant import QuantizedMatrix
    from ..model.resolve import load_checkpoint

    kernels, weight_dtype = resolve_kernels(config)
    backend = config.attention_backend
    if backend == "auto":
        backend = {"cpu": "cpu", "triton": "triton"}.get(kernels, "paddle")
    attention_cls = plugins.get("attention_backends", backend, "attention_backend")
    quantization = resolve_quantization(config, kernels)
    model_config, weights, tokenizer = load_checkpoint(config.model, progress=progress,
                                                       keep_quantized=quantization == "gguf")
    if config.quantization == "auto" and not any(isinstance(w, QuantizedMatrix) for w in weights.values()):
        quantization = "none"  # a GGUF file of float matrices
    max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                        model_config.max_position_embeddings)
    # Attention backends take no keys from the configuration (yet): their Config's defaults.
    attention = attention_cls(attention_cls.Config() if attention_cls.Config is not None else None, None)
    kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, backend, weight_dtype)
    embedding = lm_head = None
    if tensor_parallel is not None and tensor_parallel[1] == 0:
        embedding = weights["model.embed_tokens.weight"]
        lm_head = embedding if model_config.tie_word_embeddings else weights["lm_head.weight"]
    # Builds the layers and calls attention.setup (which records the cache's shape).
    model = LlamaModel(model_config, weights, attention, max_positions=max_model_len + MAX_SPECULATIVE_TOKENS + 1,
                       kernels=kernels, weight_dtype=weight_dtype, kv_cache_dtype=kv_cache_dtype,
                       quantization=quantization, tensor_parallel=tensor_parallel)
    return BuiltModel(kernels=kernels, weight_dtype=weight_dtype, quantization=quantization, backend=backend,
                      attention=attention, kv_cache_dtype=kv_cache_dtype, model_config=model_config,
                      max_model_len=max_model_len, model=model, tokenizer=tokenizer, embedding=embedding,
                      lm_head=lm_head)


def _rows(logits, pick: np.ndarray):
    """The rows ``pick`` of step logits (numpy, or a paddle tensor on its device)."""
    if isinstance(logits, np.ndarray):
        return logits[pick]
    import paddle

    return paddle.gather(logits, paddle.to_tensor(pick))


@attrs.define(slots=True)
class _StepState:
    """What one step has computed so far, row-aligned with ``plan.decodes``; :meth:`only`
    narrows it to some of its requests (when others failed)."""

    plan: ScheduledStep
    batch: ProposalBatch
    drafts: Optional[Drafts] = None
    #: ``[B, k+1, V]`` numpy logits, or a paddle tensor on the device with the Triton kernels.
    logits: Any = None
    sampling: Optional[BatchSampling] = None
    result: Optional[VerifyResult] = None
    #: ``[T, H]`` last-layer hidden states of the step's packed rows, and each request's first
    #: row among them (by ``id``), when the proposer reads hidden states or a request of the
    #: step captures them for a hand-off.
    hidden: Any = None
    first_rows: dict = attrs.field(factory=dict)

    def only(self, keep: Callable[[Request], bool]) -> "_StepState":
        rows = [i for i, request in enumerate(self.plan.decodes) if keep(request)]
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
        )


class Engine:
    """Owns the model, the plugins chosen by the config, the KV pool and the requests."""

    def __init__(self, config: EngineConfig, plugins=None, progress: bool = True):
        """Load the model and build the plugins ``config`` names.

        :param config: a resolved config, as :func:`specdec.config.build_engine_config` makes
            it (a hand-built ``SpeculativeConfig`` goes through ``.resolved(plugins)`` first).
        :param plugins: the plugin registries (:func:`specdec.plugin_manager.get_plugins` when
            None).
        :raises SpecdecError: for an unresolved config, before any weight is read.
        """
        from ..plugin_manager import get_plugins

        self.plugins = plugins if plugins is not None else get_plugins()
        self.config = config
        # Resolve every plugin before loading weights, so a bad name fails fast.
        self._spec_plugin_classes(config.speculative)
        #: The other tensor-parallel ranks' processes (started here on one machine), if any.
        self.tensor_parallel_workers: list = []
        self._closed = False
        self._on_fatal: Callable[[str], None] = exit_after_failure
        tensor_parallel = watchdog = None
        if config.tensor_parallel_size > 1:
            tensor_parallel, watchdog, environment = self._start_tensor_parallel(config)
        try:
            built = build_model(config, self.plugins, progress, tensor_parallel=tensor_parallel)
            release_free_heap()  # the loader's temporaries, freed by now
            if tensor_parallel is not None:
                from .tensor_parallel import init_process_group

                init_process_group(tensor_parallel[0].paddle, environment)  # after loading: see there
        except BaseException:
            if watchdog is not None:  # the workers fail the same way: that is not news
                watchdog.stop()
                for process in self.tensor_parallel_workers:
                    process.kill()  # silently: paddle prints a C++ trace on SIGTERM
                self._closed = True
            raise
        self.kernels, self.weight_dtype, self.quantization = built.kernels, built.weight_dtype, built.quantization
        self.attention, self.kv_cache_dtype, self.tokenizer = built.attention, built.kv_cache_dtype, built.tokenizer
        self.model_config, self.max_model_len, self.model = built.model_config, built.max_model_len, built.model
        if tensor_parallel is not None:
            from .tensor_parallel import TensorParallelModel

            self.model = TensorParallelModel(built.model, tensor_parallel[0], built.embedding, built.lm_head, watchdog)
        logger.debug("kernels %s, attention backend %s, weights %s (quantization %s), kv cache %s, "
                     "tensor parallel %d", self.kernels, built.backend, self.weight_dtype, self.quantization,
                     self.kv_cache_dtype, config.tensor_parallel_size)
        self.block_size = config.block_size
        self.kv = self._allocate_kv_cache()
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.hidden_states = PendingHiddenStates(self.model.paddle, self.model_config.hidden_size)
        #: The prompt's hidden states of requests that capture them for a hand-off.
        self._captured_hidden = PendingHiddenStates(self.model.paddle, self.model_config.hidden_size)
        #: What the adaptive draft length has learned, per method (see _build_spec_plugins).
        self._adaptive_state: dict[str, tuple[AcceptanceModel, StepCostModel]] = {}
        self._build_spec_plugins(config.speculative)

        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self._eos_array = np.array(sorted(self.eos_token_ids), dtype=np.int64)
        self._ids = itertools.count()

    def _start_tensor_parallel(self, config: EngineConfig):
        """Become rank 0 of the tensor-parallel group: start the other ranks on this machine
        (unless ``paddle.distributed.launch`` started them) and watch them. Returns
        ``((group, 0, world_size), watchdog, rank 0's environment)``; the group is joined once
        the model is built."""
        from ..errors import require_paddle
        from ..model.tensor_parallel import CollectiveGroup
        from .tensor_parallel import Watchdog, launched_rank, start_local_workers, use_rank_device

        paddle = require_paddle()
        world_size = config.tensor_parallel_size
        launched = launched_rank()
        environment = None
        if launched is None:
            self.tensor_parallel_workers, environment = start_local_workers(
                config, world_size, "nccl" if _on_gpu() else "gloo")
        elif launched[1] != world_size:
            raise SpecdecError(f"tensor_parallel_size: {world_size}, but paddle.distributed.launch "
                               f"started {launched[1]} ranks")
        # Watched from here on: a rank that dies while loading ends this process with the
        # reason instead of leaving it waiting at the rendezvous.
        watchdog = Watchdog(self.tensor_parallel_workers, config.tensor_parallel_timeout,
                            lambda message: self._on_fatal(message))
        use_rank_device(paddle, environment)
        atexit.register(self.close)  # before multiprocessing's own exit handler terminates the workers
        return (CollectiveGroup(paddle, 0, world_size), 0, world_size), watchdog, environment

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

    def _spec_plugin_classes(self, spec: SpeculativeConfig) -> list[type]:
        """The proposer, verify strategy and accept policy classes ``spec`` names (in
        :data:`SPECULATIVE_KINDS` order); an unresolved ``spec`` is an error."""
        if not spec.is_resolved(self.plugins):
            raise SpecdecError("the engine takes a resolved speculative config: build it with "
                               "build_speculative_config(data, plugins), or call .resolved(plugins) on it")
        return [self.plugins.get(kind.attr, getattr(spec, kind.config_key), f"speculative_config.{kind.config_key}")
                for kind in SPECULATIVE_KINDS]

    def _build_spec_plugins(self, spec: SpeculativeConfig) -> None:
        proposer_cls, verify_cls, accept_cls = self._spec_plugin_classes(spec)
        proposer = proposer_cls(spec.method_config, spec)
        self._setup_proposer(proposer, spec)
        self.spec: SpeculativeConfig = spec
        self.num_speculative_tokens = spec.num_speculative_tokens or 0
        self.proposer = proposer
        # The adaptive policy's statistics belong to the method (draft classes mean what its
        # proposer says; the step-cost fit needs its multi-row steps, which another method's
        # 1-row steps would drown): switching methods and back resumes them.
        self.acceptance, self.step_costs = self._adaptive_state.setdefault(
            spec.method, (AcceptanceModel(), StepCostModel()))
        self.verifier = verify_cls(spec.verify_config, spec)
        self.accept_policy = accept_cls(spec.accept_config, spec)

    def _setup_proposer(self, proposer, spec: SpeculativeConfig) -> None:
        """``proposer.setup(context)``; what it raises is a one-line error naming the method."""
        from ..proposer_context import ProposerContext, TargetModel

        def create_proposer(context, method: str, keys: dict):
            return self._create_inner_proposer(context, spec, method, keys)

        context = ProposerContext(model_name=self.config.model, model_config=self.model_config,
                                  tokenizer=self.tokenizer, target=TargetModel(self.model), block_size=self.block_size,
                                  num_blocks=self.kv.pool.num_blocks, create_cache_layers=self._create_cache_layers,
                                  create_proposer=create_proposer)
        try:
            proposer.setup(context)
        except SpecdecError as exc:
            raise SpecdecError(f"speculative_config.method: proposer '{spec.method}': {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a plugin's failure, reported in one line
            raise SpecdecError(f"speculative_config.method: proposer '{spec.method}' setup failed: "
                               f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc

    def _create_inner_proposer(self, context, spec: SpeculativeConfig, method: str, keys: dict):
        """``ProposerContext.create_proposer``: ``method`` built from ``spec`` (see its docstring)."""
        from ..config import build_speculative_config

        cls = self.plugins.get("proposers", method, "method")
        data = {"method": method, "num_speculative_tokens": spec.num_speculative_tokens, **keys}
        for key in ("num_model_steps", "model", "quantization"):
            if key in getattr(cls, "USED_MODEL_KEYS", ()):
                data[key] = getattr(spec, key)
        inner = build_speculative_config(data, self.plugins, source=f"proposer '{method}'")
        proposer = cls(inner.method_config, inner)
        proposer.setup(context)
        return proposer

    def _create_cache_layers(self, num_layers: int, *, num_heads: Optional[int] = None,
                             num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None):
        """``ProposerContext.create_cache_layers``: a backend of the engine's kind over the same
        block ids as the target's cache (see its docstring)."""
        from ..model.llama import rope_tables

        c = self.model_config
        head_dim = head_dim or c.head_dim
        backend = type(self.attention)(self.attention.config, None)
        cos, sin = self.attention.rope_cos, self.attention.rope_sin
        if head_dim != c.head_dim:
            cos, sin = rope_tables(attrs.evolve(c, head_dim=head_dim), len(cos))
        backend.setup(num_layers=num_layers, num_heads=num_heads or c.num_heads,
                      num_kv_heads=num_kv_heads or c.num_kv_heads, head_dim=head_dim, dtype=self.kv_cache_dtype,
                      rope_cos=cos, rope_sin=sin)
        backend.init_cache(self.kv.pool.num_blocks, self.block_size)
        self.kv.pool.reset_prefix_cache()  # its cached blocks hold no draft rows
        return backend

    def set_speculative_config(self, spec: SpeculativeConfig) -> None:
        """Switch method, verify strategy or accept policy without reloading the model.

        ``spec`` must be resolved (see :meth:`__init__`). Only between runs: raises if requests
        are queued or running.
        """
        if self.has_unfinished():
            raise SpecdecError("cannot change the speculative config while requests are running")
        self._build_spec_plugins(spec)

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
                    handoff: bool = False, capture_hidden: bool = False) -> Request:
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
        :raises RequestError: for a prompt or sampling values the engine cannot take.
        :raises SpecdecError: for ``handoff`` with tensor parallelism.
        """
        prompt_ids = self._checked_prompt(prompt_token_ids)
        self.check_sampling(sampling, len(prompt_ids))
        if handoff:
            self._check_handoff_supported("add_request(handoff=True)")
        request = self._new_request(prompt_ids, sampling, prompt, request_id)
        request.handoff = handoff
        request.capture_hidden = handoff and capture_hidden
        if request.capture_hidden:
            request.prefix_keys = []  # every position's hidden state must be computed here
        self.scheduler.waiting.append(request)
        return request

    def _new_request(self, prompt_ids: np.ndarray, sampling: SamplingParams, prompt: Optional[str],
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
        )
        if sampling.seed is not None and sampling.temperature > 0 and self.proposer.NEEDS_HIDDEN_STATES:
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

    def _check_handoff_supported(self, what: str) -> None:
        if self.config.tensor_parallel_size > 1:
            raise SpecdecError(f"{what}: handing requests between engines does not work with tensor_parallel_size > 1")

    def import_request(self, state: HandoffState, request_id: Optional[str] = None) -> Request:
        """Continue a request another engine handed off (``add_request(..., handoff=True)``
        there): it produces the tokens that engine alone would have produced (the same greedy
        tokens; a sampled request draws on from the same generator state).

        When the batch has a free seat (fewer than ``max_num_seqs`` running, none waiting) and
        the pool has the blocks, its KV blocks are written into this cache and it joins the
        running batch at once (``request.kv_imported`` True); its full prompt blocks join the
        prefix cache. Otherwise, or when this engine's proposer reads hidden states and the
        state has none, it queues and recomputes its tokens here (``kv_imported`` False):
        the same tokens, later.

        :param request_id: the request's id here (default: a fresh one of this engine's).
        :returns: the request; its ``text`` already holds the handed-off tokens' text, and its
            first-token time is the exporting engine's.
        :raises SpecdecError: one line, when the state's KV layout differs from this engine's
            (:attr:`kv_layout`), its tokens or arrays do not fit, or with tensor parallelism;
            a :class:`RequestError` for a prompt or sampling values this engine cannot take.
        """
        self._check_handoff_supported("import_request")
        mismatch = state.layout.mismatch(self.kv_layout)
        if mismatch is not None:
            raise SpecdecError(f"import_request: the hand-off's KV layout differs from this engine's ({mismatch})")
        prompt_ids = self._checked_prompt(state.prompt_token_ids)
        self.check_sampling(state.sampling, len(prompt_ids))
        output_ids = self._checked_handoff(state, len(prompt_ids))
        request = self._new_request(prompt_ids, state.sampling, None, request_id)
        self._restore(request, state, output_ids)
        if not self._seat_imported(request, state):
            request.context_len = 0  # recomputed, as a preempted request is
            self.scheduler.waiting.append(request)
        return request

    def _checked_handoff(self, state: HandoffState, num_prompt_tokens: int) -> np.ndarray:
        """The state's output ids, after checking that its tokens, positions and arrays fit."""
        vocab = self.model_config.vocab_size
        output_ids = np.asarray(state.output_token_ids, dtype=np.int64)
        if output_ids.ndim != 1 or not 0 < len(output_ids) < state.sampling.max_tokens:
            raise SpecdecError(f"import_request: {output_ids.size} output tokens; a hand-off has from 1 to "
                               f"max_tokens - 1 ({state.sampling.max_tokens - 1})")
        if output_ids.min() < 0 or output_ids.max() >= vocab:
            raise SpecdecError(f"import_request: output token ids must lie in [0, {vocab})")
        num_tokens = num_prompt_tokens + len(output_ids)
        if not 0 < state.num_positions < num_tokens:
            raise SpecdecError(f"import_request: num_positions {state.num_positions} outside [1, {num_tokens - 1}] "
                               f"(the last token is never in the cache)")
        blocks = -(-state.num_positions // self.block_size)
        if len(state.kv) != self.model_config.num_layers or any(len(layer) != blocks for layer in state.kv):
            raise SpecdecError(f"import_request: the KV must be {self.model_config.num_layers} layers of {blocks} "
                               f"blocks for {state.num_positions} positions")
        hidden = state.hidden_states
        if hidden is not None and tuple(hidden.shape) != (state.num_positions, self.model_config.hidden_size):
            raise SpecdecError(f"import_request: hidden states {list(hidden.shape)}; expected "
                               f"[{state.num_positions}, {self.model_config.hidden_size}]")
        return output_ids

    def _restore(self, request: Request, state: HandoffState, output_ids: np.ndarray) -> None:
        """Give a new request the handed-off tokens, text, generator state and times."""
        start = request.num_prompt_tokens
        request.tokens[start: start + len(output_ids)] = output_ids
        request.num_tokens = start + len(output_ids)
        try:
            request.rng.bit_generator.state = state.rng_state
        except (TypeError, ValueError, KeyError) as exc:
            raise SpecdecError(f"import_request: the generator state does not fit numpy's "
                               f"{type(request.rng.bit_generator).__name__}: {exc}") from None
        request.text = request.detokenizer.step(request.generated_ids)
        now = time.perf_counter()
        request.arrival_time = now - state.first_token_s  # first_token_s stays the exporter's
        request.first_token_time = now

    def _seat_imported(self, request: Request, state: HandoffState) -> bool:
        """Put an imported request straight into the running batch with its KV blocks (and
        hidden states) when there is a seat and the blocks for it; False otherwise."""
        scheduler, n = self.scheduler, state.num_positions
        if scheduler.waiting or len(scheduler.running) >= scheduler.max_num_seqs:
            return False
        if self.needs_hidden_states and state.hidden_states is None:
            return False  # the proposer's own cache rows would be missing: recompute them
        # Room for the token the next step feeds too, so that the import does not preempt itself.
        if self.kv.blocks_needed(request, request.num_tokens) > self.kv.pool.num_free:
            return False
        self.kv.grow(request, n)
        try:
            self.attention.import_blocks(request.block_table, state.kv)
        except BaseException:
            self.kv.free(request)
            raise
        self.kv.adopt(request, n)
        request.kv_imported = True
        scheduler.running.append(request)
        if self.needs_hidden_states:
            hidden = self.model.paddle.to_tensor(np.asarray(state.hidden_states, dtype=np.float32))
            self.hidden_states.keep(request, hidden, 0, 0, n)
        self._start(request)
        return True

    def _hand_off(self, request: Request) -> None:
        """End ``request`` (it has its first token) with finish reason ``handoff`` and its
        exported state; its blocks are still held (the caller retires it)."""
        n = request.context_len
        hidden = self._captured_rows(request, n) if request.capture_hidden else None
        request.handoff_state = HandoffState(
            request_id=request.request_id,
            prompt_token_ids=request.tokens[: request.num_prompt_tokens].copy(),
            output_token_ids=request.generated_ids.copy(),
            sampling=request.sampling,
            rng_state=request.rng.bit_generator.state,
            num_positions=n,
            kv=self.attention.export_blocks(request.block_table[: -(-n // self.block_size)]),
            hidden_states=hidden,
            layout=self.kv_layout,
            first_token_s=request.first_token_time - request.arrival_time,
        )
        request.finish_reason = "handoff"

    def _captured_rows(self, request: Request, num_positions: int) -> np.ndarray:
        """``[num_positions, H]`` float32: the hidden states captured for ``request``."""
        states, positions = self._captured_hidden.take(request)
        if not np.array_equal(positions, np.arange(num_positions)):
            raise SpecdecError(f"captured hidden states of {len(positions)} positions, expected 0..{num_positions - 1}")
        return np.asarray(states.numpy(), dtype=np.float32)

    def _checked_prompt(self, prompt_token_ids: Sequence[int]) -> np.ndarray:
        """The prompt as an int64 array, or a :class:`RequestError` naming what is wrong."""
        vocab = self.model_config.vocab_size
        try:
            prompt_ids = np.asarray(prompt_token_ids, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):
            raise RequestError("prompt", f"token ids must be integers in [0, {vocab})") from None
        if prompt_ids.ndim != 1 or len(prompt_ids) == 0:
            raise RequestError("prompt", "must hold at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError("prompt", f"{len(prompt_ids)} tokens do not fit the context of {self.max_model_len} "
                                         f"tokens", code="context_length_exceeded")
        if prompt_ids.min() < 0 or prompt_ids.max() >= vocab:
            raise RequestError("prompt", f"token ids must lie in [0, {vocab})")
        blocks = -(-(len(prompt_ids) + 1) // self.block_size)
        if blocks > self.kv.pool.num_blocks:
            raise RequestError("prompt", f"{len(prompt_ids)} tokens need {blocks} KV blocks; the pool has "
                                         f"{self.kv.pool.num_blocks} (raise num_kv_blocks or kv_cache_memory_gb)")
        return prompt_ids

    def check_sampling(self, sampling: SamplingParams, num_prompt_tokens: int) -> None:
        """Check ``sampling`` against this engine (``SamplingParams`` checked the rest when it
        was built): ``top_k`` within the vocabulary, the stop-string limits, and the context,
        as the OpenAI API counts it (the prompt plus ``max_tokens`` must fit).

        :raises RequestError: naming the field."""
        vocab = self.model_config.vocab_size
        if sampling.top_k > vocab:
            raise RequestError("top_k", f"must be between 0 and {vocab} (the vocabulary size), or -1, "
                                        f"got {sampling.top_k}")
        stops = sampling.stop
        if len(stops) > self.config.max_stop_strings:
            raise RequestError("stop", f"at most {self.config.max_stop_strings} stop strings (max_stop_strings), "
                                       f"got {len(stops)}")
        longest = max(stops, key=len, default="")
        if len(longest) > self.config.max_stop_string_length:
            raise RequestError("stop", f"a stop string may have at most {self.config.max_stop_string_length} "
                                       f"characters (max_stop_string_length), got {len(longest)}")
        if num_prompt_tokens + sampling.max_tokens > self.max_model_len:
            raise RequestError(
                "max_tokens", f"the context holds {self.max_model_len} tokens, but the prompt's {num_prompt_tokens} "
                              f"plus max_tokens {sampling.max_tokens} would need {num_prompt_tokens + sampling.max_tokens};"
                              f" lower max_tokens to at most {self.max_model_len - num_prompt_tokens}",
                code="context_length_exceeded")

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

    def _retire(self, request: Request, reason: Optional[str]) -> None:
        """Take a request out of the engine for good: blocks, proposer state, final text."""
        self.scheduler.remove(request)
        if request.started:
            try:
                self.proposer.on_request_finish(request.request_id)
            except Exception:  # noqa: BLE001 - the request is over either way
                logger.exception("proposer '%s': on_request_finish(%s) failed", self.spec.method, request.request_id)
        self.acceptance.forget(request.request_id)
        self.hidden_states.drop(request)
        self._captured_hidden.drop(request)
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
        k = self.num_speculative_tokens
        if request.sampling.num_speculative_tokens is not None:
            k = min(k, request.sampling.num_speculative_tokens)
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
            self.hidden_states.drop(request)
            self._captured_hidden.drop(request)
        for request in plan.admitted:
            if not request.started:  # not a preempted request coming back
                self._start(request)
        touched = {id(r): r for r in (*plan.exhausted, *plan.admitted, *plan.requests)}
        plan = plan.keeping(lambda r: not r.finished)
        if plan.num_requests:
            self._run_step(plan)
        return [request for request in touched.values() if request.finished]

    def _proposal_request(self, request: Request, max_draft_len: int) -> ProposalRequest:
        """What the proposer sees of ``request`` this step (with the hidden states kept for
        it, handed over once, when the proposer reads them)."""
        proposal = ProposalRequest(request.request_id, request.token_ids, request.num_prompt_tokens, max_draft_len,
                                   sampling=request.sampling, rng=request.rng)
        if self.proposer.NEEDS_HIDDEN_STATES:
            proposal.hidden_states, proposal.hidden_positions = self.hidden_states.take(request)
            proposal.block_table = np.asarray(request.block_table, dtype=np.int32)
            proposal.block_table.flags.writeable = False
        return proposal

    def _start(self, request: Request) -> None:
        """Tell the proposer a request starts (its prompt), and for an imported request the
        tokens generated elsewhere (one ``on_step``); a failure ends that request alone."""
        request.started = True
        prompt = request.tokens[: request.num_prompt_tokens]
        try:
            self.proposer.on_request_start(ProposalRequest(request.request_id, prompt, request.num_prompt_tokens, 0))
            if request.num_generated:
                before = ProposalRequest(request.request_id, prompt, request.num_prompt_tokens, 0,
                                         sampling=request.sampling, rng=request.rng)
                if self.proposer.NEEDS_HIDDEN_STATES:
                    before.block_table = np.asarray(request.block_table, dtype=np.int32)
                self.proposer.on_step(ProposalBatch([before]), [request.generated_ids.copy()])
        except Exception as exc:  # noqa: BLE001 - fails this request alone
            self._fail(request, f"proposer '{self.spec.method}' on_request_start", exc)

    def _run_step(self, plan: ScheduledStep) -> None:
        """Propose, pack and forward, verify, accept and update for the requests of ``plan``;
        each phase narrows the step to the requests that have not failed."""
        state = _StepState(plan, ProposalBatch([
            self._proposal_request(r, max_draft_len) for r, max_draft_len in zip(plan.decodes, plan.max_draft_lens)
        ]))
        decoding = lambda s: s.plan.decodes  # noqa: E731 - the members of the decode-only phases
        # propose: proposer.propose, then the caps and the adaptive draft length
        state, state.drafts = self._isolated(f"proposer '{self.spec.method}'", state,
                                             lambda s: self._propose(s.batch, s.plan), decoding)
        if state.drafts is None:  # every decoding request failed; prefill chunks go on
            state.drafts = Drafts.empty(0)
        # pack and forward: one model call for every row of the step
        state, state.logits = self._isolated("model forward", state, self._forward, lambda s: s.plan.requests)
        for request, rows in state.plan.chunks:
            if state.hidden is not None:
                self._keep_hidden(state, request, request.context_len, rows)
            request.context_len += rows
            self.kv.register_computed(request)
        if not state.plan.decodes:
            return
        # verify: verify_strategy.verify on [B, k+1, V] logits
        state.sampling = self._sampling(state.plan.decodes, state.drafts)
        state, state.result = self._isolated(
            f"verify strategy '{self.spec.verify_strategy}'", state,
            lambda s: self._checked_result(self.verifier.verify(self._verify_inputs(s)), s),
            decoding)
        if not state.plan.decodes:
            return
        # accept: accept_policy.apply
        state, state.result = self._isolated(
            f"accept policy '{self.spec.accept_policy}'", state,
            lambda s: self._checked_result(self.accept_policy.apply(s.result, s.drafts), s), decoding)
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

    def _propose(self, batch: ProposalBatch, plan) -> Drafts:
        max_draft_lens = np.fromiter((r.max_draft_len for r in batch.requests), dtype=np.int64, count=len(batch))
        if not max_draft_lens.any() and not self.proposer.NEEDS_HIDDEN_STATES:
            return Drafts.empty(len(batch))
        drafts = self.proposer.propose(batch)
        if drafts.batch_size != len(batch):
            raise SpecdecError(
                f"proposer '{self.spec.method}' returned {drafts.batch_size} drafts for {len(batch)} requests"
            )
        if drafts.classes is not None:
            classes = valid_draft_classes(drafts.classes, len(batch))
            if classes is None:
                raise SpecdecError(f"proposer '{self.spec.method}' returned draft classes that are not "
                                   f"{len(batch)} non-negative integer labels")
            drafts.classes = classes
        if self.spec.adaptive_draft_length and drafts.lengths.any():
            max_draft_lens = self._adapt_draft_lengths(plan, batch, np.minimum(drafts.lengths, max_draft_lens),
                                                       drafts.classes)
        if (drafts.lengths > max_draft_lens).any() or drafts.width > max_draft_lens.max():
            drafts = drafts.clipped(max_draft_lens)
        return drafts

    def _adapt_draft_lengths(self, plan, batch: ProposalBatch, lengths: np.ndarray,
                             classes: Optional[np.ndarray]) -> np.ndarray:
        """The adaptive policy (``adaptive.py``): cut drafts that would not pay for their rows.

        A seeded sampled request keeps its drafts: its tokens then depend on its seed alone,
        not on what else shares the batch (which drafts are verified changes which samples a
        lossless strategy draws, though not their distribution).

        The bar is what this batch earns in a plain decode step: one row per request. Prompt
        rows (prefill chunks, or a prompt's last chunk before its first token) emit no token
        this step, but they are work the engine owes anyway: counted as the step's base they
        made its tokens per second look poor and every draft look cheap, so the steps that
        prefilled a batch of 64 prompts verified every draft and the run lost 10%."""
        base_rows = len(plan.decodes)
        fixed, per_row = self.step_costs.costs()
        chances = self.acceptance.chances([r.request_id for r in batch.requests], classes, int(lengths.max()))
        chosen = choose_draft_lengths(lengths, chances, base_rows, len(batch), fixed, per_row)
        keep = np.fromiter((r.sampling.seed is not None and r.sampling.temperature > 0 for r in plan.decodes),
                           dtype=bool, count=len(plan.decodes))
        return np.where(keep, lengths, chosen)

    def _forward(self, state: _StepState) -> np.ndarray:
        """Pack every scheduled request's rows (``batch.py``), run the model, return the
        ``[B, k+1, V]`` logits of the decoding requests (prefill chunks need none). For a
        proposer that reads hidden states, or a request that captures them for its hand-off,
        ``state.hidden`` gets every row's."""
        plan = state.plan
        packed = pack_step(
            [SequenceRows(r.tokens[r.context_len: r.num_tokens], r.context_len, r.block_table) for r in plan.decodes],
            state.drafts,
            [SequenceRows(r.tokens[r.context_len: r.context_len + rows], r.context_len, r.block_table)
             for r, rows in plan.chunks],
            self.block_size)
        started = time.perf_counter()
        # The fused verify kernels read the logits where the model left them.
        options = {"device_logits": True} if self.kernels == "triton" else {}
        if self.proposer.NEEDS_HIDDEN_STATES or any(r.capture_hidden for r in plan.requests):
            logits, state.hidden = self.model.forward(packed.token_ids, packed.meta, packed.logit_rows,
                                                      return_hidden=True, **options)
            starts = packed.meta.cu_seqlens_q
            state.first_rows = {id(r): int(starts[i]) for i, r in enumerate(plan.requests)}
        else:
            logits = self.model.forward(packed.token_ids, packed.meta, packed.logit_rows, **options)
        if packed.is_decode_only:
            # Only decode steps feed the cost model: a prefill row also attends over its
            # whole prompt, which would make every draft row look dearer than it is.
            self.step_costs.observe(packed.meta.num_rows, time.perf_counter() - started)
        return packed.verify_logits(logits)

    @staticmethod
    def _verify_inputs(state: _StepState) -> VerifyInputs:
        """The verify strategy's inputs; device logits stay on the device (the strategy copies
        them to the host only if it has no fused kernel)."""
        if isinstance(state.logits, np.ndarray):
            return VerifyInputs(state.logits, state.drafts, state.sampling)
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
        self.acceptance.record([r.request_id for r in decodes], drafts.classes, drafts.lengths, accepted)
        appended_by_request = {}
        for b, request in enumerate(decodes):
            try:
                count = int(counts[b])
                if state.hidden is not None:  # the fed rows and the accepted drafts' rows
                    self._keep_hidden(state, request, request.context_len, request.num_uncomputed + int(accepted[b]))
                request.context_len = request.num_tokens + int(accepted[b])
                appended = self._append(request, result.output_tokens[b, :count], reasons[b])
                self.kv.register_computed(request)
                request.metrics.record_step(int(drafts.lengths[b]), int(accepted[b]), count)
                appended_by_request[id(request)] = appended
                self._check_stop_strings(request)
                if request.handoff and not request.finished:
                    self._hand_off(request)
            except Exception as exc:  # noqa: BLE001 - a detokenizer failure, say: this request only
                self._fail(request, "update", exc)
        return state.only(lambda r: id(r) in appended_by_request and r.error is None), appended_by_request

    def _keep_hidden(self, state: _StepState, request: Request, first_position: int, count: int) -> None:
        """Keep ``count`` rows of the step's hidden states of ``request`` from ``first_position``:
        for the proposer when it reads them, and for the request's hand-off when it captures them."""
        first_row = state.first_rows[id(request)]
        if self.proposer.NEEDS_HIDDEN_STATES:
            self.hidden_states.keep(request, state.hidden, first_row, first_position, count)
        if request.capture_hidden:
            self._captured_hidden.keep(request, state.hidden, first_row, first_position, count)

    def _emitted_counts(self, decodes, output_tokens: np.ndarray, accepted: np.ndarray):
        """How many of each request's ``accepted + 1`` output tokens it keeps, and why it stops
        (``stop`` at an EOS, ``length`` at max_tokens or the context end, else ``None``)."""
        counts = accepted + 1
        reasons = np.full(len(decodes), None, dtype=object)
        eos_ok = np.fromiter((not r.sampling.ignore_eos for r in decodes), dtype=bool, count=len(decodes))
        if self._eos_array.size and eos_ok.any():
            positions = np.arange(output_tokens.shape[1])[None, :]
            is_eos = np.isin(output_tokens, self._eos_array) & (positions < counts[:, None]) & eos_ok[:, None]
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
