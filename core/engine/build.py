"""Building an engine's parts: resolving kernels, weights, quantization and cache dtype,
loading the model, and wiring the speculative plugins (proposer, verify strategy, accept
policy) to it.

The engine and every tensor-parallel rank build their model with :func:`build_model`, so that
each rank resolves the same way; :func:`build_spec_plugins` runs when an engine starts and
whenever its speculative config changes.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional

import attrs

from ..config import MAX_SPECULATIVE_TOKENS, MODEL_KEYS, EngineConfig, SpeculativeConfig, build_speculative_config
from ..errors import ConfigError, SpecdecError
from ..plugin_kinds import SPECULATIVE_KINDS
from ..proposer_context import ProposerContext



def on_gpu() -> bool:
    """Whether paddle sees a CUDA device."""
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
    return quantization_for(config.model, config.quantization, kernels)


def quantization_for(model: str, quantization: str, kernels: str, key: str = "quantization",
                     model_key: str = "--model") -> str:
    """:func:`resolve_quantization` for any model (the target's, a draft model's), its errors
    naming ``key`` and ``model_key``, the keys the user set them with."""
    from ..model.resolve import is_gguf_file, resolve_model_path

    path = resolve_model_path(model, model_key)
    is_gguf = path.is_file() and is_gguf_file(path)
    if quantization == "auto":
        return "gguf" if kernels == "cpu" and is_gguf else "none"
    if quantization != "none" and kernels != "cpu":
        raise SpecdecError(f"{key}: {quantization} needs the CPU kernels (kernels: cpu or auto)")
    if quantization == "gguf" and not is_gguf:
        raise SpecdecError(f"{key}: gguf computes on a GGUF file's blocks, and {model} is not a "
                           f"GGUF file; use wint8 or wint4")
    return quantization


def kernel_fallback_line(reason: Exception) -> str:
    """The one line a user sees when ``kernels: auto`` cannot use the CPU kernels: what failed,
    what it costs and how to fix it (said without ``--debug``: the paddle path is several times
    slower, and a user would otherwise only see a slow engine)."""
    return (f"warning: CPU kernels unavailable ({' '.join(str(reason).split())[:300]}); falling back to "
            "paddle's float32 ops, several times slower (about 14 tokens/s instead of 100 on the default "
            "model). Fix: install a C++ compiler (apt-get install g++), then run again; --debug shows more")


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
        if on_gpu():
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
            except KernelUnavailable as exc:
                if dtype == "float16":
                    raise SpecdecError("dtype: float16 weights need the CPU kernels, which cannot be built "
                                       "here; use dtype: float32") from None
                print(kernel_fallback_line(exc), file=sys.stderr)
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


def holds_quantized(weights: dict) -> bool:
    """Whether loaded ``weights`` keep a quantized matrix (``auto`` quantization of a GGUF file
    of float matrices comes to ``none``)."""
    from ..model.quant import QuantizedMatrix

    return any(isinstance(w, QuantizedMatrix) for w in weights.values())


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
    from ..model.resolve import load_checkpoint

    kernels, weight_dtype = resolve_kernels(config)
    backend = config.attention_backend
    if backend == "auto":
        backend = {"cpu": "cpu", "triton": "triton"}.get(kernels, "paddle")
    attention_cls = plugins.get("attention_backends", backend, "attention_backend")
    quantization = resolve_quantization(config, kernels)
    model_config, weights, tokenizer = load_checkpoint(config.model, progress=progress,
                                                       keep_quantized=quantization == "gguf")
    if config.quantization == "auto" and not holds_quantized(weights):
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


# --- a proposer's draft model --------------------------------------------------------------------


def load_draft_model(model: str, quantization: Optional[str], *, target_name: str, target_tokenizer,
                     target_vocab_size: int, kernels: str, weight_dtype: str, attention, kv_cache_dtype: str,
                     max_positions: int, num_blocks: int, block_size: int, progress: bool = False):
    """``ProposerContext.load_model``: the draft ``model`` on the target's ``kernels`` and
    weight dtype, its attention backend of the target's kind (``attention``) with a cache of
    ``num_blocks`` blocks of ``block_size`` (the target's block ids), as a
    :class:`~specdec.proposer_context.DraftModel`. Its tokenizer is checked against the
    target's before any weight is read."""
    from ..config import QUANTIZATIONS
    from ..model.llama import LlamaModel
    from ..model.resolve import load_checkpoint, resolve_model_path
    from ..model.tokenizer import Tokenizer, tokenizer_difference
    from ..proposer_context import DraftModel

    if not model:
        raise ConfigError("model: name the draft model (a GGUF file, a checkpoint directory or an alias)")
    requested = "auto" if quantization is None else quantization
    if requested not in QUANTIZATIONS:
        raise ConfigError(f"quantization: must be one of {', '.join(QUANTIZATIONS)} or null, got {quantization!r}")
    try:
        path = resolve_model_path(model, "model")
        resolved = quantization_for(model, requested, kernels, "quantization", "model")
    except SpecdecError as exc:  # both name the key
        raise ConfigError(str(exc)) from None
    tokenizer = Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer.from_gguf(path)
    difference = tokenizer_difference(target_tokenizer, tokenizer)
    if difference is not None:
        raise ConfigError(f"model: the draft model {model} does not tokenize as the target {target_name} does: "
                          f"{difference}")
    config, weights, tokenizer = load_checkpoint(model, progress=progress, keep_quantized=resolved == "gguf")
    if requested == "auto" and not holds_quantized(weights):
        resolved = "none"  # a GGUF file of float matrices
    draft_attention = type(attention)(attention.config, None)
    draft = LlamaModel(config, weights, draft_attention, max_positions=max_positions, kernels=kernels,
                       weight_dtype=weight_dtype, kv_cache_dtype=kv_cache_dtype, quantization=resolved)
    draft_attention.init_cache(num_blocks, block_size)
    return DraftModel(draft, tokenizer, model, target_vocab_size)


# --- the speculative plugins --------------------------------------------------------------------


def spec_plugin_classes(plugins, spec: SpeculativeConfig) -> list[type]:
    """The proposer, verify strategy and accept policy classes ``spec`` names (in
    :data:`SPECULATIVE_KINDS` order); an unresolved ``spec`` is an error."""
    if not spec.is_resolved(plugins):
        raise SpecdecError("the engine takes a resolved speculative config: build it with "
                           "build_speculative_config(data, plugins), or call .resolved(plugins) on it")
    return [plugins.get(kind.attr, getattr(spec, kind.config_key), f"speculative_config.{kind.config_key}")
            for kind in SPECULATIVE_KINDS]


@attrs.define
class SpecPlugins:
    """The plugin objects one speculative config makes, ready for the step loop."""

    spec: SpeculativeConfig
    proposer: Any
    verifier: Any
    accept_policy: Any


def build_spec_plugins(spec: SpeculativeConfig, plugins,
                       make_context: Callable[[Callable], ProposerContext]) -> SpecPlugins:
    """Build the plugins ``spec`` names and set the proposer up with the context
    ``make_context(create_proposer)`` gives (the engine's target, tokenizer and cache)."""
    proposer_cls, verify_cls, accept_cls = spec_plugin_classes(plugins, spec)
    proposer = proposer_cls(spec.method_config, spec)
    context = make_context(functools.partial(create_inner_proposer, plugins, spec))
    try:
        proposer.setup(context)
    except ConfigError as exc:  # names the key at fault ("model: ...")
        raise ConfigError(f"speculative_config.{exc}") from None
    except SpecdecError as exc:
        raise SpecdecError(f"speculative_config.method: proposer '{spec.method}': {exc}") from None
    except (Exception, SystemExit, GeneratorExit) as exc:  # noqa: BLE001 - a plugin's failure, in one line
        raise SpecdecError(f"speculative_config.method: proposer '{spec.method}' setup failed: "
                           f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc
    return SpecPlugins(spec=spec, proposer=proposer, verifier=verify_cls(spec.verify_config, spec),
                       accept_policy=accept_cls(spec.accept_config, spec))


def create_inner_proposer(plugins, spec: SpeculativeConfig, context: ProposerContext, method: str, keys: dict):
    """``ProposerContext.create_proposer``: ``method`` with the composing method's
    ``num_speculative_tokens`` and the model keys it reads, plus ``keys`` (see its docstring)."""
    cls = plugins.get("proposers", method, "method")
    data = {"method": method, "num_speculative_tokens": spec.num_speculative_tokens, **keys}
    for key in MODEL_KEYS:
        if key in getattr(cls, "USED_MODEL_KEYS", ()):
            data[key] = getattr(spec, key)
    inner = build_speculative_config(data, plugins, source=f"proposer '{method}'")
    proposer = cls(inner.method_config, inner)
    proposer.setup(context)
    return proposer


def create_cache_layers(attention, model_config, dtype: str, num_blocks: int, block_size: int, num_layers: int, *,
                        num_heads: Optional[int] = None, num_kv_heads: Optional[int] = None,
                        head_dim: Optional[int] = None):
    """``ProposerContext.create_cache_layers``: a backend of the engine's kind (``attention``)
    with cache dtype ``dtype``, over the same block ids as the target's cache (see its docstring)."""
    from ..model.llama import rope_tables

    c = model_config
    head_dim = head_dim or c.head_dim
    backend = type(attention)(attention.config, None)
    cos, sin = attention.rope_cos, attention.rope_sin
    if head_dim != c.head_dim:
        cos, sin = rope_tables(attrs.evolve(c, head_dim=head_dim), len(cos))
    backend.setup(num_layers=num_layers, num_heads=num_heads or c.num_heads,
                  num_kv_heads=num_kv_heads or c.num_kv_heads, head_dim=head_dim, dtype=dtype,
                  rope_cos=cos, rope_sin=sin)
    backend.init_cache(num_blocks, block_size)
    return backend
