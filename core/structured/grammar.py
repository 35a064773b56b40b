"""Grammars compiled with ``llguidance``, off the engine thread and in bounded time.

Why llguidance (rather than xgrammar): it is a self-contained Rust wheel with no Python
dependencies (xgrammar's wheel requires torch, which a PaddlePaddle install has no use for),
it builds its token trie straight from the ``tokenizers`` JSON that specdec already holds for
GGUF and Hugging Face models, it computes a mask lazily from an Earley parser (no
per-schema precompilation of every state, so a large schema costs little up front), it can
validate and roll back tokens (what checking a draft needs), and it bounds its own work
(:class:`llguidance.LLParserLimits`: grammar size, lexer fuel per compile and per token).

A grammar is compiled into an ``LLMatcher`` for one request by :class:`GrammarCompiler`:
its ``compile_async`` runs the build in a worker thread (llguidance drops the GIL meanwhile)
with at most ``max_concurrent`` builds at once and a wall-clock bound, so a schema that takes
long to compile delays only its own request, never the engine thread or other requests. A
schema or grammar llguidance cannot compile is a :class:`~specdec.errors.RequestError` naming
the request field and, for JSON schemas, the path of the offending subschema.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from typing import Any, Iterator, Optional

from ..errors import RequestError, SpecdecError

#: Seconds a grammar may take to compile before the request is refused (400).
DEFAULT_COMPILE_TIMEOUT_S = 10.0
#: Grammar builds that may run at once (each takes a worker thread and up to a core).
DEFAULT_MAX_CONCURRENT_COMPILES = 2
#: Compiled grammars kept for reuse (a request with the same schema copies the built matcher).
_CACHE_SIZE = 64
#: Subschemas tried alone when looking for the one that fails (a bound on the search's time).
_MAX_SUBSCHEMAS_SEARCHED = 200
#: JSON as the model writes it: compact (no whitespace between tokens), so that a small model
#: cannot wander into endless spaces and newlines; separators as ``json.dumps`` writes them.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise SpecdecError("structured output needs llguidance: pip install llguidance") from exc
    return llguidance


def parser_limits():
    """The bounds on llguidance's work for one grammar (its defaults, verbose errors off:
    they would copy grammar internals into the client's error message)."""
    return _llguidance().LLParserLimits(verbose_errors=False)


def json_schema_grammar(schema: Any, param: str) -> str:
    """The llguidance grammar of a JSON schema (compact JSON). RequestError naming ``param``
    when ``schema`` is no JSON object."""
    if not isinstance(schema, dict):
        raise RequestError(param, f"expected a JSON schema object, got {type(schema).__name__}")
    try:
        return _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=dict(JSON_OPTIONS))
    except (ValueError, TypeError) as exc:
        raise RequestError(param, f"not a valid JSON schema: {_one_line(exc)}") from None


def lark_grammar(source: str) -> str:
    """The llguidance grammar of a Lark-syntax grammar (``%json {...}`` embeds a JSON schema)."""
    return _llguidance().LLMatcher.grammar_from_lark(source)


class GrammarCompiler:
    """Builds ``LLMatcher`` objects over one model's tokenizer.

    :param tokenizer: the model's :class:`~specdec.model.tokenizer.Tokenizer`; its token
        bytes come from its ``tokenizers`` JSON, and every id in ``eos_token_ids`` is an
        end of sequence for the grammar (allowed where the grammar is complete).
    :param vocab_size: the width of the model's logits (may exceed the tokenizer's vocabulary).
    """

    def __init__(self, tokenizer, vocab_size: int, *, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 max_concurrent: int = DEFAULT_MAX_CONCURRENT_COMPILES):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.timeout_s = timeout_s
        self.max_concurrent = max_concurrent
        self._ll_tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self._slots: Optional[asyncio.Semaphore] = None

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(self.tokenizer.eos_token_ids)

    def ll_tokenizer(self):
        """The llguidance tokenizer (built once, ~1 s for a 50k vocabulary; thread-safe)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                llg = _llguidance()
                self._ll_tokenizer = llg.LLTokenizer(self.tokenizer.hf_tokenizer.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=self.eos_token_ids)
            return self._ll_tokenizer

    def compile(self, grammar: str, param: str, schemas: Optional[dict[str, Any]] = None):
        """A fresh matcher for ``grammar`` (blocking: call it off the engine thread).
        RequestError naming ``param`` when llguidance cannot build it; ``schemas`` (request
        field -> the JSON schema it holds) are the schemas the grammar embeds: the error then
        names the field and the path of the subschema that fails (``...schema.properties.age``)."""
        cached = self._cached(grammar)
        if cached is None:
            llg = _llguidance()
            cached = llg.LLMatcher(self.ll_tokenizer(), grammar, log_level=0, limits=parser_limits())
            if cached.is_error():
                raise self._compile_error(cached.get_error(), param, schemas or {})
            with self._cache_lock:
                self._cache[grammar] = cached
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return cached.deep_copy()

    def _cached(self, grammar: str):
        """The matcher built for ``grammar`` before (marked as just used), or None."""
        with self._cache_lock:
            cached = self._cache.get(grammar)
            if cached is not None:
                self._cache.move_to_end(grammar)
            return cached

    async def compile_async(self, grammar: str, param: str, schemas: Optional[dict[str, Any]] = None):
        """:meth:`compile` in a worker thread, at most ``max_concurrent`` at once, within
        ``timeout_s`` seconds (a RequestError after that; the build then finishes in the
        background, bounded by llguidance's own limits, and is dropped). A grammar already
        built (an agent sends the same tools or schema every turn) is copied at once, without
        waiting for a slot: slow builds of other grammars cannot hold it up."""
        cached = self._cached(grammar)
        if cached is not None:
            return cached.deep_copy()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_concurrent)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        too_slow = RequestError(param, f"the grammar took longer than {self.timeout_s:g} s to compile; "
                                       "simplify the schema", code="grammar_too_complex")
        try:
            await asyncio.wait_for(self._slots.acquire(), self.timeout_s)
        except asyncio.TimeoutError:
            raise too_slow from None
        # The slot is held until the build ends, even one whose request has given up on it:
        # a thread cannot be stopped, and the bound on concurrent builds must hold.
        build = asyncio.ensure_future(asyncio.to_thread(self.compile, grammar, param, schemas))
        build.add_done_callback(lambda _: self._slots.release())
        try:
            return await asyncio.wait_for(asyncio.shield(build), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            raise too_slow from None

    def _compile_error(self, message: str, param: str, schemas: dict[str, Any]) -> RequestError:
        path = param
        for field, schema in schemas.items():
            if isinstance(schema, dict):
                sub = self._failing_subschema(schema)
                if sub is not None:
                    path = field + sub
                    break
        return RequestError(path, f"cannot be compiled: {_one_line(message)}")

    def _failing_subschema(self, schema: dict) -> Optional[str]:
        """The path (``.properties.age``) of the deepest subschema that fails to compile on its
        own, when there is one (a subschema with a ``$ref`` outside itself may not compile
        alone: then the deepest one that does say what fails is taken)."""
        llg = _llguidance()
        found = None
        for n, (path, sub) in enumerate(_subschemas(schema, "")):
            if n >= _MAX_SUBSCHEMAS_SEARCHED:
                break
            if not isinstance(sub, dict):
                continue
            try:
                grammar = llg.LLMatcher.grammar_from_json_schema(sub, defaults=dict(JSON_OPTIONS))
            except (ValueError, TypeError):
                found = path
                continue
            error = llg.LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
            if error and (not path or "$ref" not in json.dumps(sub)) and (found is None or path.startswith(found)):
                found = path
        return found


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def _subschemas(schema: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Every subschema of ``schema`` with its path, depth first, the schema itself first."""
    yield path, schema
    if not isinstance(schema, dict):
        return
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield from _subschemas(sub, f"{path}.{key}.{name}")
    for key in _SCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                yield from _subschemas(sub, f"{path}.{key}[{i}]")
    for key in _SCHEMA_ONE:
        if isinstance(schema.get(key), dict):
            yield from _subschemas(schema[key], f"{path}.{key}")


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())[:500]
