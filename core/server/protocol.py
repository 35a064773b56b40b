"""The OpenAI wire format: request and response models, and requests turned into engine input.

Requests are parsed strictly, like the CLI config: unknown fields are an error (with a
did-you-mean), and a value must have the field's type (``"5"`` is no int, ``2.0`` is no int,
``1`` is no bool). Two fields go beyond the OpenAI API:

- ``speculative``: per-request speculation, ``{"num_speculative_tokens": 0}`` turns it off for
  this request, a smaller k limits it. Validated with the config's strict converter.
- ``ignore_eos``: generate past EOS (as vLLM has it), for benchmarks and exact token counts.
- ``include_token_sources``: each choice (of a response, or of a streamed chunk) gets
  ``token_sources``, its text cut into its tokens, each with how it came: ``draft`` (a draft
  the target accepted), ``bonus`` (the target's own token that ends a speculative step) or
  ``decode`` (a step without drafts). See :mod:`specdec.server.token_sources`. A field that
  OpenAI clients do not know, and ignore.

``repetition_penalty``, ``min_p`` and ``stop_token_ids`` are vLLM's extensions, checked like
the OpenAI fields. ``n`` (1 to 128) asks for that many choices of one prompt.
``prediction`` (OpenAI's Predicted Outputs, ``{"type": "content", "content": "..."}``) is
accepted by both endpoints: the predicted text drafts for that request alone
(``specdec.engine.prediction``), and ``usage.completion_tokens_details`` counts its accepted
and rejected tokens.

Every other field of the OpenAI request schemas is accepted at its default value (``null``,
or the value OpenAI documents as the default: ``presence_penalty: 0``, ``logit_bias: {}``,
``functions: []``, ...), because common clients send them on every request; any other value is a 400
naming the field (``unsupported_value``), since specdec would ignore it. ``UNSUPPORTED_FIELDS``
lists them.

The sampling values (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``)
are checked by :class:`specdec.SamplingParams` and the engine, the same rules as the CLI and
the Python API. Text fields must be valid Unicode (JSON's ``\\ud800`` escapes can make a lone
surrogate, which no tokenizer can encode).

Structured output (``response_format``, on both endpoints) and tool use (``tools``,
``tool_choice``, ``parallel_tool_calls``, tool calls and tool results in ``messages``) are
checked and turned into grammars and prompts by :mod:`specdec.server.structured`.

Responses carry the speculative figures of each request in ``usage.speculative`` (left out on a
server run with ``--hide-speculative-usage``).
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal, Optional

import attrs
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from ..config import MAX_SPECULATIVE_TOKENS, describe, structure
from ..validators import in_range
from ..errors import ConfigError, RequestError
from ..metrics import SpecMetrics
from ..sampling import MAX_LOGPROBS, SamplingParams
from .errors import APIError
from .generation_defaults import GenerationDefaults

#: ``max_tokens`` of a completion when the request leaves it out (as the OpenAI API has it).
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: The most choices one request may ask for (``n``), as the OpenAI API bounds it.
MAX_N = 128


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def check_text(value: str) -> str:
    """``value`` when it is valid Unicode, else ValueError naming where (a lone surrogate)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {exc.start}") from None
    return value


#: Fields of the OpenAI request schemas that specdec does not act on, with the values it
#: accepts for them: the defaults (``None``, JSON null, is always accepted). Any other value is
#: a 400 ``unsupported_value`` naming the field.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "functions": ([],),  # the deprecated form of tools
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
    "audio": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "verbosity": (),
    "store": (False,),
}
#: Fields that only describe the request to the provider (tracking, caching, routing hints):
#: accepted with any value of their type, with no effect on the output.
INFORMATIONAL_FIELDS = ("user", "metadata", "service_tier", "prompt_cache_key", "safety_identifier")


#: The same for the fields of a chat message.
MESSAGE_UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "function_call": (),
    "audio": (),
}


def _check_default(param: str, value: Any, allowed: tuple[Any, ...]) -> None:
    """A 400 ``unsupported_value`` naming ``param`` unless ``value`` is one of its defaults."""
    if not _is_default(value, allowed):
        accepted = " or ".join(["null", *(json.dumps(v) for v in allowed)])
        raise APIError(400, f"{param}: not supported by this server; accepted only at its default "
                            f"({accepted}), got {describe(value)}", param=param, code="unsupported_value")


def _is_default(value: Any, allowed: tuple[Any, ...]) -> bool:
    """``value`` is null or one of ``allowed``, of the same JSON type (``false`` is not ``0``)."""
    if value is None:
        return True
    for default in allowed:
        numbers = isinstance(default, (int, float)) and not isinstance(default, bool)
        same_type = (isinstance(value, (int, float)) and not isinstance(value, bool)) if numbers \
            else type(value) is type(default)
        if same_type and value == default:
            return True
    return False


# -- requests --------------------------------------------------------------------------------


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk holding the usage."""

    include_usage: bool = False


@attrs.define(frozen=True, kw_only=True)
class RequestSpeculation:
    """The ``speculative`` field of a request: what one request may change of the server's
    speculative config. Structured with the strict config converter (``specdec.config``)."""

    num_speculative_tokens: Optional[int] = attrs.field(default=None,
                                                        validator=in_range(0, MAX_SPECULATIVE_TOKENS))


class GenerationRequest(_Strict):
    """The fields both endpoints share (the bounds of the sampling values are
    :class:`~specdec.SamplingParams`' and the engine's)."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: Optional[Any] = None
    n: Optional[int] = Field(None, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    speculative: Optional[dict[str, Any]] = None
    include_token_sources: bool = False
    #: Predicted Outputs: checked by :func:`prediction_text` (``None``: no prediction).
    prediction: Optional[Any] = None
    # Informational: any value of the type is fine.
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    # The logits controls, checked by SamplingParams (``repetition_penalty``, ``min_p`` and
    # ``stop_token_ids`` go beyond the OpenAI API, as vLLM has them).
    frequency_penalty: Optional[Any] = None
    presence_penalty: Optional[Any] = None
    repetition_penalty: Optional[Any] = None
    min_p: Optional[Any] = None
    logit_bias: Optional[Any] = None
    stop_token_ids: Optional[Any] = None
    logprobs: Optional[Any] = None
    # Accepted at their defaults only (UNSUPPORTED_FIELDS): checked in sampling_params().
    store: Optional[Any] = None

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value is None:
            return value
        if isinstance(value, str):
            return check_text(value)
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return [check_text(s) for s in value]
        raise ValueError(f"expected a string or a list of strings, got {describe(value)}")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def sampling_params(self, default_max_tokens: int, max_speculative_tokens: int,
                        defaults: GenerationDefaults = GenerationDefaults()) -> SamplingParams:
        """The engine's ``SamplingParams`` for this request (``APIError`` 400 when invalid).

        ``max_speculative_tokens`` is the server's k: ``speculative.num_speculative_tokens``
        may lower it, not raise it. The sampling fields the request leaves out take their
        value from ``defaults`` (the server's generation config).
        """
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")
        self._check_unsupported_fields()
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        stop = () if self.stop is None else self.stop
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=defaults.value("temperature", self.temperature),
                top_p=defaults.value("top_p", self.top_p),
                top_k=defaults.value("top_k", self.top_k),
                min_p=defaults.value("min_p", self.min_p),
                repetition_penalty=defaults.value("repetition_penalty", self.repetition_penalty),
                presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
                frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
                logit_bias=self._logit_bias(),
                stop_token_ids=self._stop_token_ids(),
                logprobs=self.num_logprobs(),
                seed=self.seed,
                stop=stop,
                ignore_eos=self.ignore_eos,
                num_speculative_tokens=self._num_speculative_tokens(max_speculative_tokens),
            )
        except RequestError as exc:
            raise APIError(400, str(exc), param=exc.param, code=exc.code) from None

    def num_logprobs(self) -> Optional[int]:
        """How many top log-probabilities per token the request asks for (None: no logprobs)."""
        if self.logprobs is None:
            return None
        if type(self.logprobs) is not int or not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs: must be an integer between 0 and {MAX_LOGPROBS}, got "
                                f"{describe(self.logprobs)}", param="logprobs", code="invalid_value")
        return self.logprobs

    def _logit_bias(self):
        if self.logit_bias is None:
            return ()
        if not isinstance(self.logit_bias, dict):
            raise APIError(400, f"logit_bias: expected an object mapping token ids to numbers, got "
                                f"{describe(self.logit_bias)}", param="logit_bias", code="invalid_value")
        return self.logit_bias

    def _stop_token_ids(self):
        if self.stop_token_ids is None:
            return ()
        if not isinstance(self.stop_token_ids, list):
            raise APIError(400, f"stop_token_ids: expected a list of token ids, got {describe(self.stop_token_ids)}",
                           param="stop_token_ids", code="invalid_value")
        return self.stop_token_ids
    def prediction_text(self) -> Optional[str]:
        """The predicted text of ``prediction`` (``None`` without one; an empty prediction is
        none either); a 400 naming the part of the field that is wrong."""
        value = self.prediction
        if value is None:
            return None
        if not isinstance(value, dict):
            raise APIError(400, f'prediction: expected an object {{"type": "content", "content": ...}}, '
                                f"got {describe(value)}", param="prediction")
        unknown = sorted(set(value) - {"type", "content"})
        if unknown:
            raise APIError(400, f"prediction.{unknown[0]}: unknown field (expected type and content)",
                           param=f"prediction.{unknown[0]}")
        if value.get("type") != "content":
            raise APIError(400, f'prediction.type: must be "content", got {describe(value.get("type"))}',
                           param="prediction.type")
        if self.n not in (None, 1):
            raise APIError(400, "prediction: not supported with n > 1", param="prediction", code="unsupported_value")
        content = value.get("content")
        if isinstance(content, list):
            texts = []
            for i, part in enumerate(content):
                if not isinstance(part, dict) or set(part) != {"type", "text"} or part["type"] != "text" \
                        or not isinstance(part["text"], str):
                    raise APIError(400, f'prediction.content[{i}]: expected a text part {{"type": "text", '
                                        f'"text": "..."}}, got {describe(part)}', param=f"prediction.content[{i}]")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise APIError(400, "prediction.content: expected a string or a list of text parts, got "
                                f"{describe(content)}", param="prediction.content")
        try:
            check_text(content)
        except ValueError as exc:
            raise APIError(400, f"prediction.content: {exc}", param="prediction.content") from None
        return content or None

    def _check_unsupported_fields(self) -> None:
        for name, allowed in UNSUPPORTED_FIELDS.items():
            if name in type(self).model_fields:
                _check_default(name, getattr(self, name), allowed)
        for i, message in enumerate(getattr(self, "messages", ())):
            message.check_unsupported_fields(i)

    def _num_speculative_tokens(self, server_k: int) -> Optional[int]:
        if self.speculative is None:
            return None
        try:
            options = structure(self.speculative, RequestSpeculation, "speculative")
        except ConfigError as exc:
            raise APIError(400, str(exc), param=str(exc).split(":")[0], code="invalid_value") from None
        k = options.num_speculative_tokens
        if k is not None and k > server_k:
            param = "speculative.num_speculative_tokens"
            raise APIError(400, f"{param}: must be between 0 and {server_k} (the server's num_speculative_tokens), "
                                f"got {k}", param=param, code="invalid_value")
        return k


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: ``prompt`` is a string, or a list of token ids (one prompt)."""

    prompt: Any
    #: Structured output, as on chat completions (an extension of the completions API, as vLLM has it).
    response_format: Optional[Any] = None
    best_of: Optional[Any] = None
    echo: Optional[Any] = None
    suffix: Optional[Any] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]  # a batch of one
        if isinstance(value, str):
            return check_text(value)
        if isinstance(value, list) and value and all(type(t) is int for t in value):
            return value
        if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
            raise ValueError(f"one prompt per request is supported, got {len(value)}")
        raise ValueError(f"expected a string or a list of token ids, got {describe(value)}")


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class MessageToolCall(_Strict):
    """A call an earlier assistant turn made (``messages[i].tool_calls[j]``)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    """One message: ``role`` and ``content``, a string or a list of text parts
    (``[{"type": "text", "text": "..."}]``; other part types are not supported). An assistant
    message may hold the ``tool_calls`` it made, a ``tool`` message the result of one
    (``tool_call_id``)."""

    role: str
    content: Optional[Any] = None
    name: Optional[str] = None
    refusal: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = None
    tool_call_id: Optional[str] = None
    # The deprecated function call and audio, which specdec does not do: accepted at their defaults only.
    function_call: Optional[Any] = None
    audio: Optional[Any] = None

    @field_validator("role", "name", "refusal")
    @classmethod
    def _check_unicode(cls, value: Optional[str]) -> Optional[str]:
        return value if value is None else check_text(value)

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        if value is None:
            return value
        if isinstance(value, str):
            return check_text(value)
        if isinstance(value, list):
            texts = []
            for i, part in enumerate(value):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"part {i}: only text parts are supported: "
                                     '{"type": "text", "text": "..."}')
                texts.append(check_text(part["text"]))
            return "".join(texts)
        raise ValueError(f"expected a string or a list of text parts, got {describe(value)}")

    def check_unsupported_fields(self, index: int) -> None:
        """A 400 naming ``messages[index].<field>`` for an unsupported field that is set, or a
        tool field on a message of another role."""
        for name, allowed in MESSAGE_UNSUPPORTED_FIELDS.items():
            _check_default(f"messages[{index}].{name}", getattr(self, name), allowed)
        if self.tool_calls and self.role != "assistant":
            raise APIError(400, f"messages[{index}].tool_calls: only assistant messages make tool calls",
                           param=f"messages[{index}].tool_calls", code="invalid_value")
        if self.role == "tool" and not self.tool_call_id:
            raise APIError(400, f"messages[{index}].tool_call_id: a tool message needs the id of the call it answers",
                           param=f"messages[{index}].tool_call_id", code="invalid_value")

    def to_template(self) -> dict:
        """The message as the chat template takes it (tool calls in the OpenAI form)."""
        message = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` is the newer name of
    ``max_tokens``; without either, the answer may run to the end of the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    top_logprobs: Optional[Any] = None
    tools: Optional[Any] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[Any] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    response_format: Optional[Any] = None
    modalities: Optional[Any] = None
    audio: Optional[Any] = None
    reasoning_effort: Optional[Any] = None
    web_search_options: Optional[Any] = None
    verbosity: Optional[Any] = None

    def num_logprobs(self) -> Optional[int]:
        """Chat asks with ``logprobs: true`` and ``top_logprobs: N`` (0 to 20)."""
        if self.logprobs is not None and type(self.logprobs) is not bool:
            raise APIError(400, f"logprobs: expected true or false, got {describe(self.logprobs)}", param="logprobs", code="invalid_value")
        top = self.top_logprobs
        if top is not None and (type(top) is not int or not 0 <= top <= MAX_LOGPROBS):
            raise APIError(400, f"top_logprobs: must be an integer between 0 and {MAX_LOGPROBS}, got {describe(top)}",
                           param="top_logprobs", code="invalid_value")
        if not self.logprobs:
            if top:
                raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs", code="invalid_value")
            return None
        return top or 0

    def resolve_max_tokens(self) -> None:
        """Fold ``max_completion_tokens`` into ``max_tokens``."""
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise APIError(400, "max_completion_tokens: give max_tokens or max_completion_tokens, not both",
                               param="max_completion_tokens")
            self.max_tokens = self.max_completion_tokens


# -- responses -------------------------------------------------------------------------------


class SpeculativeUsage(BaseModel):
    """``usage.speculative``: what speculation did for this request."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float
    mean_acceptance_length: float
    accepted_per_position: list[int]
    #: Decode steps in which the drafting controller did not call the proposer for this
    #: request (its drafts did not pay: docs/config.md, "Adaptive draft length").
    num_proposer_off_steps: int = 0

    @classmethod
    def from_metrics(cls, metrics: SpecMetrics) -> "SpeculativeUsage":
        data = metrics.to_dict()
        del data["num_steps"]
        return cls(**data)


class CompletionTokensDetails(BaseModel):
    """``usage.completion_tokens_details`` (OpenAI's shape): of the tokens drafted from the
    request's ``prediction``, how many the model's output accepted and how many it rejected
    (both 0 without a prediction)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    """Token counts of one request, exactly as the engine counted them."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)
    #: None (left out of the JSON) on a server run with ``--hide-speculative-usage``.
    speculative: Optional[SpeculativeUsage] = None

    @model_serializer(mode="wrap")
    def _without_hidden(self, handler) -> dict:
        data = handler(self)
        if self.speculative is None:
            data.pop("speculative", None)
        return data

    @classmethod
    def of(cls, num_prompt_tokens: int, num_generated: int, metrics: Optional[SpecMetrics],
           hide_speculative: bool = False) -> "Usage":
        """The usage of a request with the figures ``metrics``; ``hide_speculative`` leaves
        ``speculative`` out (the prediction counts stay: they are about the caller's own text)."""
        details = CompletionTokensDetails()
        if metrics is not None:
            details = CompletionTokensDetails(accepted_prediction_tokens=metrics.num_prediction_accepted,
                                              rejected_prediction_tokens=metrics.num_prediction_rejected)
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_generated,
                   total_tokens=num_prompt_tokens + num_generated, completion_tokens_details=details,
                   speculative=None if metrics is None or hide_speculative else SpeculativeUsage.from_metrics(metrics))


class TokenSource(BaseModel):
    """One entry of ``token_sources``: a generated token (``index``: its place in the output,
    from 0), its text (or the part of it in this chunk) and how it came."""

    index: int
    text: str
    source: Literal["decode", "draft", "bonus"]


class _WithTokenSources(BaseModel):
    """A choice that carries ``token_sources`` when the request asked (``include_token_sources``);
    the field is left out of the JSON otherwise."""

    token_sources: Optional[list[TokenSource]] = None

    @model_serializer(mode="wrap")
    def _without_sources(self, handler) -> dict:
        data = handler(self)
        if self.token_sources is None:
            data.pop("token_sources", None)
        return data


class CompletionLogprobs(BaseModel):
    """A completion choice's ``logprobs`` (the legacy shape): per token its text, its
    log-probability, the ``logprobs`` most likely tokens there (``{text: logprob}``) and where
    its text starts in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_WithTokenSources):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    """A completion (``stream: false``), or one chunk of one (``object`` the same, as OpenAI
    has it; chunks hold the new text, and the usage only in the last one)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class AssistantMessage(BaseModel):
    """The reply: its text, and the tool calls parsed out of it (then ``content`` is the text
    around them, null when there is none)."""

    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    tool_calls: Optional[list[dict]] = None


class TopLogprob(BaseModel):
    """One candidate token: its text, log-probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    """One generated token, with the most likely tokens at its position (``top_logprobs``)."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's ``logprobs``: one entry per generated token."""

    content: list[ChatTokenLogprob]


class ChatChoice(_WithTokenSources):
    index: int = 0
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """A streamed piece: text, or tool-call deltas (``{"index", "id", "type", "function":
    {"name", "arguments"}}`` first, then ``{"index", "function": {"arguments"}}`` pieces)."""

    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[dict]] = None


class ChatChunkChoice(_WithTokenSources):
    index: int = 0
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class ServedSpeculation(BaseModel):
    """``speculative`` of a model card: the server's method and its k, the most a request's
    ``speculative.num_speculative_tokens`` may ask for (the method is the server's for every
    request)."""

    method: str
    num_speculative_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdec"
    max_model_len: int
    speculative: ServedSpeculation
    #: The sampling values a request gets for the fields it leaves out (``--generation-config``).
    generation_defaults: dict[str, float] = Field(default_factory=dict)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
