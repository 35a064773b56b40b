"""The FastAPI app: the OpenAI endpoints over an :class:`~specdec.server.engine_loop.EngineLoop`.

``build_app(engine_loop, served_model_name=...)`` returns the app; its lifespan starts the engine
thread and, at shutdown, stops it (aborting whatever still runs). Handlers tokenize in a worker
thread, submit to the engine loop, and wait on the request's queue: the event loop never runs
the model. A client that disconnects cancels its request, which frees its KV cache.

The app enforces the limits of :class:`~specdec.server.limits.ServerLimits` that an app can
see (the request body, the prompt's characters, the capacity before tokenizing) and
``--allowed-hosts`` (:mod:`~specdec.server.hosts`); the connection limits are uvicorn's part
(``specdec.server.serve.uvicorn_config``). Every size check of a request runs before the
request reaches the engine thread, which runs every stream's steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
import typing
from contextlib import asynccontextmanager
from typing import AsyncIterator, Optional, Sequence

import attrs
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

import attrs

from .. import __version__
from ..errors import RequestError, SpecdecError
from ..structured.grammar import DEFAULT_COMPILE_TIMEOUT_S, GrammarCompiler
from ..structured.tool_calls import tag_tokens
from ..sampling import MAX_SEED, SamplingParams
from ..model.tokenizer import TooManyTokens
from .engine_loop import EngineLoop, EngineStopped, Finished, QueueFull, RequestRejected, RequestStream
from .errors import APIError, as_400, validation_error
from .generation_defaults import GenerationDefaults
from .hosts import AllowedHostsMiddleware
from .limits import BodyLimitMiddleware, ServerLimits, default_max_prompt_chars
from .metrics import ServerMetrics
from .playground import add_playground
from .protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    GenerationRequest,
    ModelCard,
    ModelList,
    ServedSpeculation,
)
from .responses import ChatShape, CompletionShape, Shape, StreamGroup, event_stream, sse_events
from .structured import CompiledGrammar, Structured, chat_prompt_chars, plan_chat, response_format_grammar
from .tenant import tenant_of
from .tokenization import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, detokenize, tokenize

logger = logging.getLogger("specdec.server")

#: The request model of each endpoint (for did-you-mean on unknown fields).
_BODY_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
#: Paths outside ``/v1/`` that need the API key too (vLLM's tokenizer endpoints).
_KEYED_PATHS = ("/tokenize", "/detokenize")
#: Prompts longer than this (characters) tokenize at most ``_BIG_PROMPTS`` at a time: a maximal
#: prompt takes up to about a second of a core, and a few hundred MB, while it is tokenized.
_BIG_PROMPT_CHARS = 65536
_BIG_PROMPTS = 2


def build_app(engine_loop: EngineLoop, *, served_model_name: str, api_key: Optional[str] = None,
              limits: Optional[ServerLimits] = None, enable_docs: bool = False,
              metrics_require_key: bool = False, allowed_hosts: Optional[Sequence[str]] = None,
              cluster=None, hide_speculative_usage: bool = False,
              generation_defaults: Optional[GenerationDefaults] = None,
              grammar_compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S) -> FastAPI:
    """The server's FastAPI app.

    :param engine_loop: runs the engine; the app's lifespan starts and stops it. Its
        ``metrics`` (created here when None) feed ``GET /metrics``.
    :param served_model_name: the one model name requests may ask for (``model``).
    :param api_key: when set, every ``/v1/`` request needs ``Authorization: Bearer <api_key>``.
    :param limits: the server's limits (default: ``ServerLimits()``); kept as ``app.state.limits``
        for the connection limits of ``serve.uvicorn_config``.
    :param enable_docs: serve ``/docs``, ``/redoc`` and ``/openapi.json`` (off: 404).
    :param metrics_require_key: ``/metrics`` needs the API key too (``api_key`` must be set).
    :param allowed_hosts: the host patterns a request's ``Host`` may name (see
        :mod:`~specdec.server.hosts`; ``serve`` passes ``--allowed-hosts`` or its default);
        None: any.
    :param cluster: a :class:`specdec.cluster.Cluster` built over ``engine_loop``, or None. The
        lifespan starts and stops it, and requests are routed through it with their tenant,
        grammar and token sources (the jobs it runs compile their grammars with this app's
        compiler).
    :param hide_speculative_usage: leave ``usage.speculative`` out of responses: how many
        drafts a request had accepted tells how much its text matched earlier requests' (with
        the ``suffix`` method's global tree, other tenants').
    :param generation_defaults: the sampling values of the fields a request leaves out
        (:mod:`~specdec.server.generation_defaults`; ``specdec serve`` loads them per
        ``--generation-config``); None: the OpenAI API's (temperature 1, no top-k/top-p).
    :param grammar_compile_timeout: seconds a request's grammar (``response_format``, a
        constrained ``tool_choice``) may take to compile before the request is refused (400);
        the compiler is ``app.state.grammar_compiler``.
    """
    if metrics_require_key and not api_key:
        raise ValueError("metrics_require_key needs an api_key")
    limits = limits or ServerLimits()
    if engine_loop.metrics is None:
        engine_loop.metrics = ServerMetrics(served_model_name)
    metrics: ServerMetrics = engine_loop.metrics
    metrics.watch(engine_loop.snapshot)
    max_prompt_chars = limits.max_prompt_chars or default_max_prompt_chars(engine_loop.max_model_len,
                                                                           engine_loop.tokenizer)
    # The llguidance tokenizer is built at the first structured request (~1 s), not here.
    grammar_compiler = GrammarCompiler(engine_loop.tokenizer, engine_loop.vocab_size,
                                       timeout_s=grammar_compile_timeout)
    if cluster is not None:
        cluster.grammar_compiler = grammar_compiler  # the jobs it runs share the compiler's cache and bound
        submit = cluster.submit  # routes the request, its tenant, grammar and token sources with it
    else:
        def submit(prompt_ids, sampling, request_id, streaming, tenant=None, grammar=None, token_sources=False):
            # streaming is the cluster's concern
            return engine_loop.submit(prompt_ids, sampling, request_id, tenant=tenant,
                                      row_processors=grammar.processors() if grammar else (),
                                      token_sources=token_sources)
    handlers = _Handlers(engine_loop, served_model_name, max_prompt_chars, submit, hide_speculative_usage,
                         generation_defaults or GenerationDefaults(), grammar_compiler)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        if cluster is not None:
            await cluster.start()
        try:
            yield
        finally:
            if cluster is not None:
                await cluster.stop()
            await asyncio.to_thread(engine_loop.stop)

    docs = {"docs_url": "/docs", "redoc_url": "/redoc", "openapi_url": "/openapi.json"}
    app = FastAPI(title="specdec", version=__version__, lifespan=lifespan,
                  **(docs if enable_docs else dict.fromkeys(docs)))
    app.state.engine_loop = engine_loop
    app.state.limits = limits
    app.state.max_prompt_chars = max_prompt_chars
    app.state.grammar_compiler = grammar_compiler
    # The last added runs first: the Host, then the key are checked before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=limits.max_body_bytes, read_timeout=limits.read_timeout,
                       body_timeout=limits.body_timeout, on_reject=metrics.request_rejected)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, on_reject=metrics.request_rejected,
                           also=_KEYED_PATHS + (("/metrics",) if metrics_require_key else ()))
    if allowed_hosts is not None:
        app.add_middleware(AllowedHostsMiddleware, allowed_hosts=allowed_hosts, on_reject=metrics.request_rejected)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        metrics.request_rejected(exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        names = _field_names(_BODY_MODELS.get(request.url.path), errors[0]["loc"] if errors else ())
        return await api_error(request, validation_error(errors, names))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return await api_error(request, APIError(exc.status_code, f"{message}: {request.method} {request.url.path}"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # The exception's text is for the log: it may hold internals, and it is no help to a client.
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return await api_error(request, APIError(500, "internal error; the server log has the details",
                                                 code="internal_error"))

    add_playground(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 with the engine state while the engine loop can serve; else 503, with the
        reason (the engine thread died, a step stalled past --step-timeout, the loop stopped)
        for the orchestrator that restarts the process."""
        problem = engine_loop.problem
        body = {"status": "ok" if problem is None else "unhealthy", **dataclasses.asdict(engine_loop.snapshot())}
        if problem is not None:
            body["reason"] = problem
        if cluster is not None:
            body["cluster"] = cluster.status()
        return JSONResponse(body, status_code=200 if problem is None else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return handlers.model_list()

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> CompletionResponse | Response:
        return await handlers.completion(body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> ChatCompletionResponse | Response:
        return await handlers.chat_completion(body, request)

    @app.post("/tokenize")
    async def tokenize_endpoint(body: TokenizeRequest) -> TokenizeResponse:
        handlers._check_model(body.model)
        return await tokenize(body, engine_loop.tokenizer, engine_loop.max_model_len, max_prompt_chars,
                              handlers._big_prompts, _BIG_PROMPT_CHARS)

    @app.post("/detokenize")
    async def detokenize_endpoint(body: DetokenizeRequest) -> DetokenizeResponse:
        handlers._check_model(body.model)
        return await detokenize(body, engine_loop.tokenizer)

    return app


class _Handlers:
    """What the two generation endpoints do, apart from FastAPI's plumbing."""

    def __init__(self, engine_loop: EngineLoop, served_model_name: str, max_prompt_chars: int, submit,
                 hide_speculative_usage: bool = False, generation_defaults: GenerationDefaults = GenerationDefaults(),
                 grammar_compiler: Optional[GrammarCompiler] = None):
        self.engine_loop = engine_loop
        self.grammars = grammar_compiler
        self.generation_defaults = generation_defaults
        self.hide_speculative_usage = hide_speculative_usage
        self.submit = submit  # the engine loop's, or the cluster's (which routes)
        self.model_name = served_model_name
        self.max_prompt_chars = max_prompt_chars
        self.created = int(time.time())
        self._tokenizing = 0  # requests between the capacity check and submit
        self._big_prompts = asyncio.Semaphore(_BIG_PROMPTS)
        tokenizer = engine_loop.tokenizer
        #: The call tags the tokenizer has as one token each (what tool-call grammars allow).
        self._tool_tags = tag_tokens(lambda text: tokenizer.encode(text, add_special_tokens=False))

    def model_list(self) -> ModelList:
        speculative = ServedSpeculation(method=self.engine_loop.method,
                                        num_speculative_tokens=self.engine_loop.num_speculative_tokens)
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created,
                                         max_model_len=self.engine_loop.max_model_len, speculative=speculative,
                                         generation_defaults=self.generation_defaults.values)])

    # -- the endpoints -----------------------------------------------------------------------

    async def completion(self, body: CompletionRequest, request: Request) -> CompletionResponse | Response:
        self._check_model(body.model)
        self._check_token_sources(body)
        if isinstance(body.prompt, str):
            prompt_ids = await self._tokenize_prompt(self.engine_loop.tokenizer.encode, body.prompt,
                                                     len(body.prompt), "prompt")
        else:
            prompt_ids = body.prompt
        # Without max_tokens a completion gets OpenAI's 16 tokens, or what room the context has.
        default_max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, self._room(prompt_ids))
        sampling = await self._with_prediction(body, lambda: body.sampling_params(
            default_max_tokens, self.engine_loop.num_speculative_tokens, self.generation_defaults))
        structured = as_400(lambda: Structured(response_format_grammar(body.response_format)))
        grammar = await self._compiled_grammar(structured)
        shape = CompletionShape(self.model_name, self.hide_speculative_usage, self._token_text)
        return await self._generate(body, request, prompt_ids, sampling, shape, grammar)

    async def chat_completion(self, body: ChatCompletionRequest, request: Request) -> ChatCompletionResponse | Response:
        self._check_model(body.model)
        self._check_token_sources(body)
        body.resolve_max_tokens()
        self._check_num_messages(len(body.messages))
        tokenizer = self.engine_loop.tokenizer
        messages, extra, structured = as_400(lambda: plan_chat(
            [message.to_template() for message in body.messages], body.tools, body.tool_choice,
            body.parallel_tool_calls, body.response_format, tokenizer.chat_template, self._tool_tags))
        prompt_ids = await self._tokenize_prompt(functools.partial(tokenizer.encode_chat, **extra), messages,
                                                 chat_prompt_chars(messages, extra), "messages")
        # Without max_tokens the answer may run to the end of the context.
        sampling = await self._with_prediction(body, lambda: body.sampling_params(
            self._room(prompt_ids), self.engine_loop.num_speculative_tokens, self.generation_defaults))
        grammar = await self._compiled_grammar(structured)
        shape = ChatShape(self.model_name, self.hide_speculative_usage, self._token_text, tools=structured.tools,
                          max_calls=structured.max_calls)
        return await self._generate(body, request, prompt_ids, sampling, shape, grammar)

    async def _compiled_grammar(self, structured: Structured) -> Optional[CompiledGrammar]:
        """The request's grammar compiled once (off the engine thread, in bounded time: see
        :class:`~specdec.structured.grammar.GrammarCompiler`), which gives each choice its row
        processors; None without a grammar. A grammar that does not compile is a 400 naming
        the field. On a cluster it is compiled here too, whichever instance runs the request:
        this is where a bad schema is refused, before any job is sent."""
        if structured.grammar is None:
            return None
        try:
            return await structured.compile(self.grammars)
        except RequestError as exc:
            raise APIError(400, str(exc), param=exc.param, code=exc.code) from None

    def _token_text(self, token_id: int) -> str:
        """One token's text, as ``logprobs`` show it."""
        return self.engine_loop.tokenizer.decode([token_id], skip_special_tokens=False)

    def _room(self, prompt_ids) -> int:
        """The most tokens the context has room for after the prompt (at least 1: a prompt that
        fills the context is refused by the engine, with its own message)."""
        return max(1, self.engine_loop.max_model_len - len(prompt_ids))

    # -- tokenizing --------------------------------------------------------------------------

    async def _tokenize_prompt(self, encode, prompt, num_chars: int, param: str) -> list[int]:
        """``encode(prompt)`` (see :func:`_tokenize`), checked first against
        ``--max-prompt-chars`` (400) and the capacity (503: a full server tokenizes nothing;
        requests being tokenized count towards ``max_pending`` with those in the engine loop).
        At most ``_BIG_PROMPTS`` prompts over ``_BIG_PROMPT_CHARS`` are tokenized at once.
        """
        loop = self.engine_loop
        if num_chars > self.max_prompt_chars:
            what = "characters" if param == "prompt" else "characters in all messages (roles, names, contents)"
            raise APIError(400, f"{param}: {num_chars} {what} is more than this server takes ({self.max_prompt_chars}, "
                                f"--max-prompt-chars; the context holds {loop.max_model_len} tokens)",
                           param=param, code="context_length_exceeded")
        if loop.num_pending + self._tokenizing >= loop.max_pending:
            raise APIError(503, f"the server is at capacity ({loop.max_pending} requests in flight); retry later",
                           code="queue_full")
        self._tokenizing += 1
        try:
            if num_chars <= _BIG_PROMPT_CHARS:
                return await _tokenize(param, encode, prompt, loop.max_model_len)
            async with self._big_prompts:
                return await _tokenize(param, encode, prompt, loop.max_model_len)
        finally:
            self._tokenizing -= 1

    async def _with_prediction(self, body: GenerationRequest, make_sampling):
        """``make_sampling()`` with the tokens of the request's ``prediction`` (Predicted
        Outputs), if it has one: the text alone, without special tokens, held to
        ``--max-prompt-chars``. The prediction is checked first: with ``n`` > 1 it names itself."""
        text = body.prediction_text()
        sampling = make_sampling()
        if text is None:
            return sampling
        if len(text) > self.max_prompt_chars:
            raise APIError(400, f"prediction.content: {len(text)} characters is more than this server takes "
                                f"({self.max_prompt_chars}, --max-prompt-chars)", param="prediction.content",
                           code="context_length_exceeded")
        encode = functools.partial(self.engine_loop.tokenizer.encode, add_special_tokens=False)
        if len(text) <= _BIG_PROMPT_CHARS:
            ids = await _tokenize("prediction.content", encode, text, self.engine_loop.max_model_len)
        else:
            async with self._big_prompts:
                ids = await _tokenize("prediction.content", encode, text, self.engine_loop.max_model_len)
        return attrs.evolve(sampling, prediction=ids)

    # -- helpers -----------------------------------------------------------------------------

    def _check_num_messages(self, num_messages: int) -> None:
        """More messages than the context has tokens cannot fit (each renders to a token at
        least); refused before the chat template renders them all, holding the GIL."""
        max_model_len = self.engine_loop.max_model_len
        if num_messages >= max_model_len:
            raise APIError(400, f"messages: {num_messages} messages do not fit the context of {max_model_len} tokens",
                           param="messages", code="context_length_exceeded")

    def _check_token_sources(self, body: GenerationRequest) -> None:
        """``include_token_sources`` tells which tokens were accepted drafts: refused where
        ``usage.speculative`` is hidden (it tells as much)."""
        if body.include_token_sources and self.hide_speculative_usage:
            raise APIError(400, "include_token_sources: this server hides how speculation went "
                                "(--hide-speculative-usage)", param="include_token_sources", code="unsupported_value")

    def _check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model: '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    async def _generate(self, body: GenerationRequest, request: Request, prompt_ids, sampling,
                        shape: Shape, grammar: Optional[CompiledGrammar] = None) -> BaseModel | Response:
        """Run the request's choices (``n`` engine requests sharing the prompt, whose KV the
        prefix cache shares); answer with server-sent events, or the whole response at the end."""
        group = StreamGroup([])
        try:
            for choice_sampling in choice_samplings(sampling, body.num_choices):
                group.streams.append(await self._submit(prompt_ids, choice_sampling, f"{shape.request_id}-{len(group.streams)}"
                                                        if body.num_choices > 1 else shape.request_id,
                                                        shape.prompt_param, bool(body.stream), tenant_of(request),
                                                        grammar, body.include_token_sources))
        except BaseException:
            group.abort()
            raise
        logprobs = sampling.logprobs is not None
        if body.stream:
            return event_stream(sse_events(group, shape, body.include_usage, logprobs), group)
        finals = []
        for stream in group.streams:
            try:
                final = await _wait_final(stream, request)
            except BaseException:
                group.abort()
                raise
            if final is None:
                group.abort()
                return Response(status_code=499)  # the client has gone; nobody reads this
            finals.append(final)
        return shape.response(finals, logprobs)

    async def _submit(self, prompt_ids, sampling, request_id: str, prompt_param: str,
                      streaming: bool, tenant: Optional[str] = None, grammar: Optional[CompiledGrammar] = None,
                      token_sources: bool = False) -> RequestStream:
        """Check the request against the engine, hand it to the engine loop (or the cluster)
        and wait until an engine has taken it.

        The checks run here, on the event loop, so that nothing oversized reaches the engine
        thread: converting a prompt of millions of ids there would pause every stream."""
        try:
            self.engine_loop.check_request(prompt_ids, sampling)
            stream = self.submit(prompt_ids, sampling, request_id, streaming=streaming, tenant=tenant,
                                 grammar=grammar, token_sources=token_sources)
        except RequestRejected as exc:
            raise _rejected(exc, prompt_param) from None
        except QueueFull as exc:
            raise APIError(503, str(exc), code="queue_full") from None
        except EngineStopped as exc:
            raise APIError(503, str(exc), code="unavailable") from None
        try:
            await stream.admitted()
        except RequestRejected as exc:
            raise _rejected(exc, prompt_param) from None
        except EngineStopped as exc:
            raise APIError(503, str(exc), code="unavailable") from None
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream


def choice_samplings(sampling: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling of each of ``n`` choices: choice ``i`` of a seeded request draws from seed
    ``seed + i`` (mod 2**64), so every choice is reproducible and none repeats another; without
    a seed each gets the engine's own stream for it."""
    if n == 1 or sampling.seed is None:
        return [sampling] * n
    return [attrs.evolve(sampling, seed=(sampling.seed + i) % (MAX_SEED + 1)) for i in range(n)]


def _rejected(exc: RequestRejected, prompt_param: str) -> APIError:
    """The 400 of a request the engine refuses, naming the field."""
    param = exc.param or "prompt"
    message = str(exc)
    if param == "prompt" and prompt_param != "prompt":  # a chat's prompt is its messages
        param, message = prompt_param, prompt_param + message[len("prompt"):]
    return APIError(400, message, param=param, code=exc.code or "invalid_value")


async def _tokenize(param: str, encode, text, max_model_len: int):
    """``encode(text)`` in a worker thread; a tokenizer or chat-template failure is a 400
    naming ``param`` (the exception's text goes to the log, not to the client).

    The tokenizer releases the GIL, so the event loop and the engine go on meanwhile. A prompt
    of more tokens than the context holds is a 400 without its ids ever being built (for a
    maximal prompt that list, and the engine's check of it, would hold the GIL for tens of
    milliseconds).
    """
    try:
        return await asyncio.to_thread(encode, text, max_tokens=max_model_len - 1)
    except TooManyTokens as exc:
        raise APIError(400, f"{param}: {exc.num_tokens} tokens do not fit the context of {max_model_len} tokens",
                       param=param, code="context_length_exceeded") from None
    except SpecdecError as exc:  # no chat template, or the template rejected the messages
        raise APIError(400, f"{param}: {exc}", param=param, code="invalid_value") from None
    except Exception as exc:  # noqa: BLE001 - whatever the tokenizer chokes on is the input's fault
        logger.warning("tokenizing %s failed", param, exc_info=exc)
        raise APIError(400, f"{param}: the tokenizer cannot encode this text", param=param,
                       code="invalid_value") from None


async def _wait_final(stream: RequestStream, request: Request) -> Optional[Finished]:
    """The request's result, or None when the client disconnected first (the request is then
    aborted). An engine failure is an APIError 500."""
    result = asyncio.ensure_future(stream.final())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        client_gone = not result.done()
        if client_gone:
            result.cancel()
            stream.abort()
    if client_gone:
        return None
    final = result.result()
    if final.error:
        raise APIError(500, final.error, code="engine_error")
    return final


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- authentication --------------------------------------------------------------------------


class APIKeyMiddleware:
    """Refuses ``/v1/`` requests, and those to the paths in ``also`` (``/metrics`` with
    ``--metrics-require-key``), without ``Authorization: Bearer <api_key>`` (401), before the
    body is read. ``/health`` and ``/version`` stay open."""

    def __init__(self, app, api_key: str, on_reject=None, also: tuple[str, ...] = ()):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.on_reject = on_reject
        self.also = frozenset(also)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"].startswith("/v1/") or scope["path"] in self.also):
            given = dict(scope["headers"]).get(b"authorization")
            if given is None or not secrets.compare_digest(given, self.expected):
                problem = "missing" if given is None else "wrong"
                error = APIError(401, f"authorization: {problem} API key; send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                if self.on_reject is not None:
                    self.on_reject(401)
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- small helpers ---------------------------------------------------------------------------


def _field_names(model: Optional[type], loc) -> list[str]:
    """The field names of the model that holds the field at ``loc`` (for did-you-mean)."""
    if model is None:
        return []
    for part in list(loc)[1:-1]:  # skip "body" and the field itself
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        model = _model_in(field.annotation) if field is not None else None
        if model is None:
            return []
    return list(model.model_fields)


def _model_in(annotation) -> Optional[type]:
    """The pydantic model inside ``Optional[list[Model]]`` and the like."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
