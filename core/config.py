"""Configuration: the engine and speculative configs, parsed strictly, with one-line errors.

Users write the speculative config as FastDeploy does, one flat JSON object::

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 5, "max_ngram_size": 4}'

The core keys (``method``, ``num_speculative_tokens``, ...) are the fields of
:class:`SpeculativeConfig`; every other key belongs to the attrs ``Config`` class of the chosen
proposer, verify strategy or accept policy, and is structured into that class. A YAML file
(``--config``) holds the engine keys at its top level plus a ``speculative_config`` mapping.

One cattrs converter structures everything. It forbids unknown keys, and its scalar hooks are
strict: an ``int`` field takes only an int (not ``2.0``, not ``true``), a ``float`` field takes
an int or a float, a ``str`` field only a string, a ``bool`` field only ``true``/``false``.
Every problem becomes a :class:`~specdec.errors.ConfigError` whose message is one line:
``<key path>: <problem>``, e.g.
``--speculative-config.num_speculative_tokens: expected int, got float 2.9``.
docs/config.md lists every key and every message form.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TypeVar

import attrs
import cattrs
import yaml
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.cols import (
    homogenous_tuple_structure_factory,
    is_mapping,
    is_mutable_sequence,
    is_sequence,
    list_structure_factory,
    mapping_structure_factory,
)
from cattrs.gen import make_dict_structure_fn

from .errors import ConfigError, PluginError, SpecdecError, did_you_mean
from .plugin_kinds import SPECULATIVE_KINDS
# above and multiple_of are also read from here by older plugin code (specdec.sdk is their home).
from .validators import InvalidValue, above, in_range, multiple_of, one_of, range_problem  # noqa: F401

T = TypeVar("T")

#: Where a speculative config written on the command line comes from (the error path root).
SPECULATIVE_SOURCE = "--speculative-config"
#: Where the YAML config file comes from (the error path root of its keys).
CONFIG_SOURCE = "--config"

MAX_SPECULATIVE_TOKENS = 32
#: ``num_speculative_tokens`` of a drafting method when the config leaves it out.
DEFAULT_SPECULATIVE_TOKENS = 5
MAX_MODEL_STEPS = 8
MAX_NUM_SEQS = 256
DTYPES = ("auto", "float32", "float16", "bfloat16")
KERNELS = ("auto", "cpu", "paddle", "triton")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("auto", "none", "wint8", "wint4", "gguf")


# --- values described the way users wrote them ------------------------------------------------


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def describe(value: Any) -> str:
    """``float 2.9``, ``str 'abc'``, ``bool True``, ``null``, ``list``: a value in an error."""
    if value is None or isinstance(value, (list, tuple, dict, set)):
        return _type_name(value)
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _join(items) -> str:
    return ", ".join(str(item) for item in items)


# --- the converter ----------------------------------------------------------------------------


def _structure_int(value: Any, _type: type) -> int:
    if type(value) is int:  # not bool, not float: 2.0 is a float
        return value
    raise TypeError(f"expected int, got {describe(value)}")


def _structure_float(value: Any, _type: type) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"expected float, got {describe(value)}")


def _structure_str(value: Any, _type: type) -> str:
    if isinstance(value, str):
        return value
    raise TypeError(f"expected str, got {describe(value)}")


def _structure_bool(value: Any, _type: type) -> bool:
    if isinstance(value, bool):
        return value
    raise TypeError(f"expected bool, got {describe(value)}")


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_structure_hook(int, _structure_int)
    conv.register_structure_hook(float, _structure_float)
    conv.register_structure_hook(str, _structure_str)
    conv.register_structure_hook(bool, _structure_bool)

    def attrs_class_hook(cls: type) -> Callable:
        # cattrs' generated function, behind a check that the value is a mapping at all.
        structure_fields = make_dict_structure_fn(cls, conv)

        def structure_class(value: Any, type_: type) -> Any:
            if not isinstance(value, Mapping):
                raise TypeError(f"expected a mapping, got {_type_name(value)}")
            return structure_fields(value, type_)

        return structure_class

    def sequence_hook(type_: Any) -> Callable:
        # A string is iterable, but "12" is no list of ints.
        if is_mutable_sequence(type_):
            structure_items = list_structure_factory(type_, conv)
        else:
            structure_items = homogenous_tuple_structure_factory(type_, conv)

        def structure_sequence(value: Any, type_: Any) -> Any:
            if not isinstance(value, (list, tuple)):
                raise TypeError(f"expected list, got {describe(value)}")
            return structure_items(value, type_)

        return structure_sequence

    def mapping_hook(type_: Any) -> Callable:
        structure_items = mapping_structure_factory(type_, conv)

        def structure_mapping(value: Any, type_: Any) -> Any:
            if not isinstance(value, Mapping):
                raise TypeError(f"expected a mapping, got {_type_name(value)}")
            return structure_items(value, type_)

        return structure_mapping

    conv.register_structure_hook_factory(is_sequence, sequence_hook)
    conv.register_structure_hook_factory(is_mapping, mapping_hook)
    conv.register_structure_hook_factory(attrs.has, attrs_class_hook)
    return conv


#: The one converter of specdec: strict scalars, unknown keys forbidden.
converter = _make_converter()


def _leaf_errors(exc: BaseException, parts: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], BaseException]]:
    """Yield ``(path parts, exception)`` for each leaf of a cattrs error tree, in field order.

    A part is ``name`` for an attribute or mapping key and ``[i]`` for a list index.
    """
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        for sub in exc.exceptions:
            part = None
            for note in getattr(sub, "__notes__", ()):
                if isinstance(note, AttributeValidationNote):
                    part = note.name
                    break
                if isinstance(note, IterableValidationNote):
                    part = f"[{note.index}]" if isinstance(note.index, int) else str(note.index)
                    break
            yield from _leaf_errors(sub, parts if part is None else parts + (part,))
    else:
        yield parts, exc


# attrs' own validators word their errors "'name' must be >= 1: 0"; the comparison ones are
# reworded to match ours ("must be >= 1, got 0").
_ATTRS_MESSAGE = re.compile(r"'([A-Za-z_][A-Za-z0-9_]*)' (.+)", re.DOTALL)
_ATTRS_COMPARISON = re.compile(r"(must be [<>]=? \S+): (.+)", re.DOTALL)


def _leaf_message(parts: tuple[str, ...], exc: BaseException) -> tuple[tuple[str, ...], str]:
    """Turn one leaf exception into ``(path parts, problem)``."""
    if isinstance(exc, InvalidValue):
        return parts + (exc.name,), exc.problem
    if isinstance(exc, ForbiddenExtraKeysError):
        key = sorted(map(str, exc.extra_fields))[0]
        names = [a.name for a in attrs.fields(exc.cl)] if attrs.has(exc.cl) else []
        return parts, _unknown_key_problem(key, names)
    if isinstance(exc, KeyError) and exc.args:
        # A required field (no default) that the mapping lacks: cattrs notes the field name.
        return parts, "required key is missing"
    message = str(exc.args[0]) if exc.args else type(exc).__name__
    match = _ATTRS_MESSAGE.fullmatch(message) if isinstance(exc, (ValueError, TypeError)) else None
    if match:  # move the field name into the path
        problem = _ATTRS_COMPARISON.sub(r"\1, got \2", match.group(2))
        return parts + (match.group(1),), problem
    return parts, message


def _child(path: str, part: str) -> str:
    return path + part if part.startswith("[") else f"{path}.{part}"


def _unknown_key_problem(key: Any, valid: list[str], hint: str = "") -> str:
    """``unknown key 'x'`` + the hint (who owns it), else did-you-mean, else the valid keys."""
    if hint:
        return f"unknown key '{key}' ({hint})"
    suggestion = did_you_mean(str(key), valid)
    if suggestion:
        return f"unknown key '{key}'{suggestion}"
    return f"unknown key '{key}'; valid keys: {_join(sorted(valid))}"


def _one_line(message: str) -> str:
    return " ".join(message.splitlines())


def _conversion_error(exc: BaseException, root: str, label: Callable[[str], str]) -> ConfigError:
    """The first problem of a cattrs / validator error as ``<path>: <problem>``."""
    parts, leaf = next(_leaf_errors(exc, ()))
    parts, problem = _leaf_message(parts, leaf)
    path = root
    if parts:
        path = label(parts[0])
        for part in parts[1:]:
            path = _child(path, part)
    return ConfigError(_one_line(f"{path}: {problem}"))


_CONVERSION_ERRORS = (ClassValidationError, IterableValidationError, ForbiddenExtraKeysError,
                      ValueError, TypeError, KeyError)


def structure(data: Any, cls: type[T], source: str, label: Callable[[str], str] | None = None) -> T:
    """Structure the mapping ``data`` into the attrs class ``cls`` with the strict converter.

    Errors are one-line ConfigErrors naming the first problem in field order.
    ``source`` is the path of ``data`` itself (``--speculative-config``); ``label(key)`` gives the
    path of a top-level key (default ``f"{source}.{key}"``).
    """
    _mapping(data, source)
    try:
        return converter.structure(data, cls)
    except _CONVERSION_ERRORS as exc:
        raise _conversion_error(exc, source, label or (lambda key: _child(source, key))) from None


def _structure_value(value: Any, type_: Any, path: str) -> Any:
    """Structure one value; ``path`` names it in the error."""
    try:
        return converter.structure(value, type_)
    except _CONVERSION_ERRORS as exc:
        raise _conversion_error(exc, path, lambda part: _child(path, part)) from None


# --- the config classes -----------------------------------------------------------------------


@attrs.define(frozen=True, kw_only=True)
class SpeculativeConfig:
    """How the engine speculates: the method, how many drafts, how they are verified.

    Build it with :func:`build_speculative_config`, which resolves the names through the
    plugin registries, fills ``num_speculative_tokens`` from the method and structures each
    plugin's own ``Config``. A config constructed by hand has ``num_speculative_tokens=None``
    and no plugin configs until :meth:`resolved` is called.

    :ivar method: the proposer's ``NAME`` (``naive`` drafts nothing: plain decoding).
    :ivar num_speculative_tokens: the most drafts per request and step; ``None`` means the
        method default (5, or 0 for a method that drafts nothing).
    :ivar num_model_steps: forward steps of an MTP head per step (a draft model drafts
        ``num_speculative_tokens``).
    :ivar model: path of a draft or MTP model (methods that have none ignore it).
    :ivar quantization: quantization of the draft model.
    :ivar verify_strategy: the verify strategy's ``NAME``.
    :ivar accept_policy: the accept policy's ``NAME``.
    :ivar adaptive_draft_length: draft and verify only where it pays: each step the engine
        keeps a draft when its expected acceptance (learned per draft class and position,
        shared across requests and per request) raises the batch's expected tokens per
        second, given the measured cost of a verified row, and stops calling the proposer for
        a request whose drafts do not earn their rows and the proposer's measured time
        (probing now and then); off, the proposer runs for every request every step and every
        draft up to ``num_speculative_tokens`` is verified.
    :ivar method_config: the proposer's structured ``Config`` (``None`` if it declares none).
    :ivar verify_config: the verify strategy's structured ``Config``.
    :ivar accept_config: the accept policy's structured ``Config``.
    :ivar notices: lines for the user (the CLI prints each as ``notice: ...``), such as a
        ``num_speculative_tokens`` forced to 0. Not part of equality.
    """

    method: str = "naive"
    num_speculative_tokens: int | None = attrs.field(default=None, validator=in_range(0, MAX_SPECULATIVE_TOKENS))
    num_model_steps: int = attrs.field(default=1, validator=in_range(1, MAX_MODEL_STEPS))
    model: str | None = None
    quantization: str | None = None
    verify_strategy: str = "rejection"
    accept_policy: str = "normal"
    adaptive_draft_length: bool = True
    method_config: Any = None
    verify_config: Any = None
    accept_config: Any = None
    notices: tuple[str, ...] = attrs.field(default=(), eq=False, repr=False)

    @property
    def mtp_strategy(self) -> str:
        """Deprecated: ``mtp_strategy`` is the mtp and hybrid methods' own key now (their
        ``method_config.mtp_strategy``); this reads it from there for one more release."""
        import warnings

        warnings.warn("SpeculativeConfig.mtp_strategy moved to the method's Config (method_config.mtp_strategy); "
                      "the old name goes in the next release", DeprecationWarning, stacklevel=2)
        return getattr(self.method_config, "mtp_strategy", "default")

    def to_dict(self) -> dict[str, Any]:
        """The flat form users write: core keys, then each plugin Config's fields."""
        data = {name: getattr(self, name) for name in SPECULATIVE_KEYS}
        for plugin_config in (self.method_config, self.verify_config, self.accept_config):
            if plugin_config is not None:
                data.update(converter.unstructure(plugin_config))
        return data

    def resolved(self, plugins, source: str = "speculative_config") -> "SpeculativeConfig":
        """Validate a hand-built config against ``plugins`` and fill in what it left open."""
        return build_speculative_config(self.to_dict(), plugins, source)

    def is_resolved(self, plugins) -> bool:
        """Whether this config is as :func:`build_speculative_config` leaves it for ``plugins``:
        ``num_speculative_tokens`` filled in, every plugin name registered, and each plugin's
        config an instance of its ``Config`` (``None`` for one that declares none)."""
        if self.num_speculative_tokens is None:
            return False
        for kind in SPECULATIVE_KINDS:
            try:
                cls = getattr(plugins, kind.attr).get(getattr(self, kind.config_key))
            except PluginError:
                return False
            config_cls = getattr(cls, "Config", None)
            plugin_config = getattr(self, kind.config_field)
            if (config_cls is None) != (plugin_config is None):
                return False
            if config_cls is not None and not isinstance(plugin_config, config_cls):
                return False
        return True


#: The core keys that only model-based methods read (MTP heads, draft models, third-party
#: EAGLE or Medusa heads alike; FastDeploy's names). Given a value other than the default
#: with a method that does not list them in ``USED_MODEL_KEYS``, they are a config error
#: rather than silently ignored.
MODEL_KEYS = ("num_model_steps", "model", "quantization")

#: The core keys of ``--speculative-config``, in documentation order.
SPECULATIVE_KEYS = (
    "method", "num_speculative_tokens", "num_model_steps", "model", "quantization",
    "verify_strategy", "accept_policy", "adaptive_draft_length",
)


@attrs.define(frozen=True, kw_only=True)
class EngineConfig:
    """Everything an engine is built from.

    :ivar model: the target model: a name the model loader knows, or a path.
    :ivar max_model_len: the longest sequence (prompt + output); ``None`` = the model's own
        context length.
    :ivar attention_backend: the attention backend's ``NAME``; ``auto`` picks ``cpu`` with the
        CPU kernels, ``triton`` with the Triton kernels, else ``paddle``.
    :ivar kernels: ``auto`` (on a CUDA device the Triton kernels when triton imports, else
        plain paddle; on the CPU the CPU kernels when they build here, else plain paddle),
        ``cpu``, ``triton`` (paddle matmuls with Triton attention and fused verification; on
        the CPU only under ``TRITON_INTERPRET=1``, for tests) or ``paddle`` (the reference
        path: plain paddle ops only).
    :ivar dtype: how weights are stored (activations are float32): ``auto`` is ``float16`` with
        the CPU kernels (half the memory traffic) and ``float32`` on the reference path.
    :ivar seed: the engine seed (each request's generator derives from it).
    :ivar max_num_seqs: the most requests running at once (the batch size).
    :ivar max_num_batched_tokens: the most token rows one step feeds the model (decode rows,
        draft rows and prefill chunks together); long prompts are prefilled in chunks so
        that they never stall the requests that are decoding.
    :ivar block_size: positions per KV cache block (a multiple of 8).
    :ivar num_kv_blocks: blocks in the KV cache pool; ``None`` sizes the pool from
        ``kv_cache_memory_gb``.
    :ivar kv_cache_memory_gb: the KV cache budget in GiB when ``num_kv_blocks`` is not set.
    :ivar quantization: weight-only quantization of the target: ``none`` (float weights, as
        ``dtype`` says), ``wint8`` (int8 per output channel), ``wint4`` (int4 in groups of 32),
        ``gguf`` (compute on a GGUF file's quantized blocks as stored, no dequantized copy);
        ``auto`` is ``gguf`` for a GGUF file with quantized matrices when the CPU kernels are
        in use, else ``none``. The quantized paths need the CPU kernels.
    :ivar kv_cache_dtype: how cached keys and values are stored: ``auto`` follows the weights
        (``float16``) with the ``cpu`` attention backend and is ``float32`` with any other;
        ``float16`` halves the cache's memory and the bytes attention reads per step;
        ``bfloat16`` needs the ``triton`` backend.
    :ivar tensor_parallel_size: ranks the model is split over (Megatron-style; docs/deployment.md):
        one process per rank, which the engine starts itself on one machine. More than 1
        runs the float32 ``paddle`` path (``kernels: paddle`` on CPUs, ``triton`` on GPUs)
        and needs at least one KV head per rank.
    :ivar tensor_parallel_timeout: seconds a tensor-parallel step may wait on the other ranks
        before the engine gives up on them, fails the requests in flight and exits (gloo
        gives up on its own after 30 s, so on CPUs a longer timeout has no effect).
    :ivar enable_prefix_caching: requests whose prompts share leading full blocks (a common
        system prompt) share those blocks instead of computing them again.
    :ivar max_stop_strings: the most stop strings one request may give.
    :ivar max_stop_string_length: the most characters of one stop string (each step searches
        the new text for every stop string, so these bound what one request costs the others).
    :ivar speculative: the speculative config.
    """

    model: str = "smollm2-135m-instruct"
    max_model_len: int | None = attrs.field(default=None, validator=in_range(1))
    attention_backend: str = "auto"
    kernels: str = attrs.field(default="auto", validator=one_of(*KERNELS))
    dtype: str = attrs.field(default="auto", validator=one_of(*DTYPES))
    quantization: str = attrs.field(default="auto", validator=one_of(*QUANTIZATIONS))
    seed: int = attrs.field(default=0, validator=in_range(0))
    max_num_seqs: int = attrs.field(default=MAX_NUM_SEQS, validator=in_range(1, MAX_NUM_SEQS))
    max_num_batched_tokens: int = attrs.field(default=2048, validator=in_range(1, 1 << 20))
    block_size: int = attrs.field(default=16, validator=[in_range(8, 1024), multiple_of(8)])
    num_kv_blocks: int | None = attrs.field(default=None, validator=in_range(1))
    kv_cache_memory_gb: float = attrs.field(default=4.0, validator=in_range(0.001))
    kv_cache_dtype: str = attrs.field(default="auto", validator=one_of(*KV_CACHE_DTYPES))
    tensor_parallel_size: int = attrs.field(default=1, validator=in_range(1, 64))
    tensor_parallel_timeout: float = attrs.field(default=30.0, validator=in_range(1.0))
    enable_prefix_caching: bool = True
    max_stop_strings: int = attrs.field(default=16, validator=in_range(0, 1 << 16))
    max_stop_string_length: int = attrs.field(default=256, validator=in_range(1, 1 << 16))
    speculative: SpeculativeConfig = attrs.field(factory=SpeculativeConfig)

    def to_dict(self) -> dict[str, Any]:
        """The YAML layout: engine keys, then ``speculative_config`` in its flat form."""
        data = {name: getattr(self, name) for name in ENGINE_KEYS}
        data["speculative_config"] = self.speculative.to_dict()
        return data


#: The engine keys of the YAML file (and of the matching CLI flags), in documentation order.
ENGINE_KEYS = ("model", "max_model_len", "attention_backend", "kernels", "dtype", "quantization", "seed",
               "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks", "kv_cache_memory_gb", "kv_cache_dtype",
               "tensor_parallel_size", "tensor_parallel_timeout",
               "enable_prefix_caching", "max_stop_strings", "max_stop_string_length")


# --- reading JSON and YAML --------------------------------------------------------------------


class _DuplicateKey(Exception):
    pass


class _NotJSON(Exception):
    pass


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    data: dict = {}
    for key, value in pairs:
        if key in data:
            raise _DuplicateKey(key)
        data[key] = value
    return data


def _reject_constant(name: str) -> Any:
    raise _NotJSON(name)  # NaN and Infinity are Python's extension, not JSON


def _read_text(path: str, source: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: cannot read {path}: not UTF-8 text ({exc.reason})") from None


def parse_json_text(text: str, source: str = SPECULATIVE_SOURCE) -> dict:
    """Parse a JSON object given on the command line; ``@path.json`` reads it from a file."""
    where = ""
    if text.lstrip().startswith("@"):
        path = text.lstrip()[1:]
        text = _read_text(path, source)
        where = f" in {path}"
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{source}: invalid JSON{where} at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
    except _DuplicateKey as exc:
        raise ConfigError(f"{source}: invalid JSON{where}: duplicate key '{exc.args[0]}'") from None
    except _NotJSON as exc:
        raise ConfigError(f"{source}: invalid JSON{where}: {exc.args[0]} is not allowed") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {_type_name(data)}")
    return data


class _StrictLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key written twice in one mapping."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key '{key}'", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml_file(path: str | Path, source: str = CONFIG_SOURCE) -> dict:
    """Read a ``--config`` YAML file: a mapping (an empty file is an empty mapping)."""
    text = _read_text(str(path), source)
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "syntax error"
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(_one_line(f"{source}: invalid YAML in {path}{at}: {problem}")) from None
    except yaml.YAMLError as exc:
        raise ConfigError(_one_line(f"{source}: invalid YAML in {path}: {exc}")) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping in {path}, got {_type_name(data)}")
    return data


# --- building the configs ---------------------------------------------------------------------


def _lookup(registry, name: str, path: str) -> type:
    try:
        return registry.get(name, key=path)
    except PluginError as exc:
        raise ConfigError(str(exc)) from None


def _config_class(cls: type, slot: str, name: str) -> type | None:
    """The plugin's attrs ``Config`` class, or None; a malformed one is the plugin's error."""
    config_cls = getattr(cls, "Config", None)
    if config_cls is None:
        return None
    if not attrs.has(config_cls):
        raise PluginError(f"{slot} '{name}': {cls.__qualname__}.Config is not an attrs class")
    for field in attrs.fields(config_cls):
        if field.name in SPECULATIVE_KEYS:
            raise PluginError(
                f"{slot} '{name}': {cls.__qualname__}.Config field '{field.name}' "
                "shadows a core speculative config key"
            )
    return config_cls


def _config_fields(cls: type) -> list[str]:
    config_cls = getattr(cls, "Config", None)
    return [a.name for a in attrs.fields(config_cls)] if attrs.has(config_cls) else []


def _mapping(data: Any, source: str) -> Mapping:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping, got {_type_name(data)}")
    return data


def _unknown_key(source: str, key: Any, valid: list[str], hint: str = "") -> ConfigError:
    return ConfigError(f"{source}: {_unknown_key_problem(key, valid, hint)}")


def _is_unselecting_default(key: Any, value: Any, plugins) -> bool:
    """Whether ``key`` is one of the keys some method's ``ALSO_SELECTED_BY`` spelling selects it
    by (``mtp_strategy``), and ``value`` is that key's default in every method Config that
    declares it (``default``): a seed-system config written out in full, which must load."""
    proposers = list(_registered(plugins.proposers))
    if not any(key in spelling for _, cls in proposers for spelling in getattr(cls, "ALSO_SELECTED_BY", ())):
        return False
    defaults = [attrs.fields_dict(cls.Config)[key].default for _, cls in proposers
                if attrs.has(getattr(cls, "Config", None)) and key in attrs.fields_dict(cls.Config)]
    return bool(defaults) and all(type(default) is type(value) and default == value for default in defaults)


def _owner_hint(key: str, plugins, chosen: dict[str, str]) -> str:
    """Name the unselected plugins whose Config declares ``key``: ``it belongs to method 'ngram'...``."""
    owners, slots = [], []
    for kind in SPECULATIVE_KINDS:
        slot, registry = kind.config_key, getattr(plugins, kind.attr)
        for name, cls in _registered(registry):
            if name != chosen[slot] and key in _config_fields(cls):
                owners.append(f"{slot} '{name}'")
                if slot not in slots:
                    slots.append(slot)
    if not owners:
        return ""
    selected = _join(f"{slot} is '{chosen[slot]}'" for slot in slots)
    return f"it belongs to {_join(owners)}; {selected}"


def build_speculative_config(data: Mapping, plugins, source: str = SPECULATIVE_SOURCE) -> SpeculativeConfig:
    """Validate the flat speculative config ``data`` against ``plugins``; return it structured.

    ``plugins`` has the registries ``proposers``, ``verify_strategies`` and ``accept_policies``.
    Keys that are not core keys go to the ``Config`` of the chosen method, verify strategy or
    accept policy that declares them (to each of them, should two declare the same key).
    """
    data = _mapping(data, source)
    defaults = attrs.fields_dict(SpeculativeConfig)

    # 1. Which plugins: their names must be strings the registries know.
    chosen: dict[str, str] = {}
    classes: dict[str, type] = {}
    config_classes: dict[str, type | None] = {}
    data = _method_of_alias(data, plugins.proposers)
    for kind in SPECULATIVE_KINDS:
        slot = kind.config_key
        path = f"{source}.{slot}"
        name = _structure_value(data.get(slot, defaults[slot].default), str, path)
        chosen[slot] = name
        classes[slot] = _lookup(getattr(plugins, kind.attr), name, path)
        config_classes[slot] = _config_class(classes[slot], slot, name)

    # 2. Every key is a core key or a field of a chosen plugin's Config; a key that selects
    # another method (``mtp_strategy``) at its default is ignored, as FastDeploy does.
    owners: dict[str, list[str]] = {}
    for slot, config_cls in config_classes.items():
        for field in attrs.fields(config_cls) if config_cls is not None else ():
            owners.setdefault(field.name, []).append(slot)
    valid = list(SPECULATIVE_KEYS) + list(owners)
    for key in list(data):
        if key in SPECULATIVE_KEYS or key in owners:
            continue
        if _is_unselecting_default(key, data[key], plugins):
            data = {k: v for k, v in data.items() if k != key}
            continue
        raise _unknown_key(source, key, valid, _owner_hint(str(key), plugins, chosen))

    # 3. num_speculative_tokens depends on the method: forced to 0 for one that drafts nothing.
    path = f"{source}.num_speculative_tokens"
    num_tokens = _structure_value(data.get("num_speculative_tokens"), int | None, path)
    notices = []
    if getattr(classes["method"], "DRAFTS_NOTHING", False):
        if num_tokens not in (None, 0):
            notices.append(f"{path}: method '{chosen['method']}' drafts nothing; {num_tokens} forced to 0")
        num_tokens = 0
    elif num_tokens is None:
        num_tokens = DEFAULT_SPECULATIVE_TOKENS
    elif not 1 <= num_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"{path}: {range_problem(1, MAX_SPECULATIVE_TOKENS, num_tokens)}")

    # 4. The core keys, then each plugin's Config from its own keys.
    core = {key: data[key] for key in SPECULATIVE_KEYS if key in data}
    core["num_speculative_tokens"] = num_tokens
    config = structure(core, SpeculativeConfig, source)
    _check_model_keys(config, classes["method"], plugins, source)
    steps = config.num_model_steps
    if "num_model_steps" in getattr(classes["method"], "USED_MODEL_KEYS", ()) and num_tokens < steps:
        # As FastDeploy does: a model that runs num_model_steps substeps drafts as many tokens.
        notices.append(f"{path}: method '{chosen['method']}' drafts num_model_steps ({steps}) tokens; "
                       f"{num_tokens} raised to {steps}")
        config = attrs.evolve(config, num_speculative_tokens=steps)
    plugin_configs = {}
    for kind in SPECULATIVE_KINDS:
        config_cls = config_classes[kind.config_key]
        if config_cls is not None:
            own = {key: value for key, value in data.items() if kind.config_key in owners.get(key, ())}
            plugin_configs[kind.config_field] = structure(own, config_cls, source)
    config = attrs.evolve(config, notices=tuple(notices), **plugin_configs)
    check = getattr(classes["method"], "check_config", None)
    if check is not None:
        try:
            check(config)
        except SpecdecError as exc:
            raise ConfigError(f"{source}.{exc}") from None
    return config


def _method_of_alias(data: Mapping, proposers) -> Mapping:
    """``data`` with ``method`` replaced by the proposer whose ``ALSO_SELECTED_BY`` spelling it
    matches (FastDeploy writes hybrid as ``method: mtp`` with ``mtp_strategy: with_ngram``)."""
    for name, cls in _registered(proposers):
        for spelling in getattr(cls, "ALSO_SELECTED_BY", ()):
            if all(key in data and data[key] == value for key, value in spelling.items()):
                return {**data, "method": name}
    return data


def _registered(registry) -> Iterator[tuple[str, type]]:
    """``(name, class)`` of every name ``registry`` can resolve (a contested name cannot)."""
    for name in registry.names():
        try:
            yield name, registry.get(name)
        except PluginError:
            continue


def _check_model_keys(config: SpeculativeConfig, proposer_cls: type, plugins, source: str) -> None:
    """Refuse a model-based key (:data:`MODEL_KEYS`) set for a method that does not read it."""
    defaults = attrs.fields_dict(SpeculativeConfig)
    for key in MODEL_KEYS:
        if getattr(config, key) == defaults[key].default or key in getattr(proposer_cls, "USED_MODEL_KEYS", ()):
            continue
        users = [f"'{name}'" for name, cls in _registered(plugins.proposers)
                 if key in getattr(cls, "USED_MODEL_KEYS", ())]
        used_by = (f"method{'s' if len(users) > 1 else ''} {_join(users)}" if users
                   else "model-based methods such as 'mtp' (none is installed)")
        raise ConfigError(f"{source}.{key}: method '{config.method}' does not use it; it is read by {used_by}")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def build_engine_config(
    yaml_data: Mapping | None,
    overrides: Mapping[str, Any],
    spec_data: Mapping | None,
    plugins,
    *,
    yaml_source: str = CONFIG_SOURCE,
    spec_source: str = SPECULATIVE_SOURCE,
) -> EngineConfig:
    """Merge the YAML file < CLI overrides, and build the whole engine config.

    :param yaml_data: the ``--config`` file (:func:`load_yaml_file`), or None.
    :param overrides: engine keys from CLI flags the user gave explicitly (``None`` values are
        skipped, as not given); an error names the flag, ``--max-num-seqs``.
    :param spec_data: the ``--speculative-config`` object (:func:`parse_json_text`), or None. When
        given it replaces the YAML's ``speculative_config`` as a whole.
    :param plugins: the registries (``attention_backends`` besides the three speculative ones).
    """
    yaml_data = dict(_mapping(yaml_data or {}, yaml_source))
    yaml_spec = yaml_data.pop("speculative_config", None)
    for key in yaml_data:
        if key not in ENGINE_KEYS:
            hint = "it belongs under speculative_config" if key in SPECULATIVE_KEYS else ""
            raise _unknown_key(yaml_source, key, [*ENGINE_KEYS, "speculative_config"], hint)
    given = {key: value for key, value in overrides.items() if value is not None}
    for key in given:
        if key not in ENGINE_KEYS:
            raise ConfigError(f"{_flag(key)}: not an engine option; engine options: {_join(ENGINE_KEYS)}")

    def label(key: str) -> str:
        return _flag(key) if key in given else f"{yaml_source}.{key}"

    engine = structure({**yaml_data, **given}, EngineConfig, yaml_source, label)
    if engine.attention_backend != "auto":
        _lookup(plugins.attention_backends, engine.attention_backend, label("attention_backend"))

    if spec_data is not None:
        speculative = build_speculative_config(spec_data, plugins, spec_source)
    elif yaml_spec is not None:
        speculative = build_speculative_config(yaml_spec, plugins, f"{yaml_source}.speculative_config")
    else:
        speculative = build_speculative_config({}, plugins, spec_source)
    return attrs.evolve(engine, speculative=speculative)
