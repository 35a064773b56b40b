"""From a request's engine events to OpenAI responses: whole, or as server-sent events.

Completions and chat completions differ only in the shape of their objects
(:class:`CompletionShape`, :class:`ChatShape`); :func:`sse_events` streams either. A chat
request that offers tools has its output parsed for ``<tool_call>`` blocks
(:class:`~specdec.structured.tool_calls.ToolCallParser`): streamed, each call comes as OpenAI
streams one (a delta with its index, id, type and function name, then its arguments), and the
finish reason is ``tool_calls``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator, Optional, Union

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from ..structured.tool_calls import FunctionTool, ToolCall, ToolCallParser, parse_output
from .engine_loop import Finished, RequestStream
from .errors import APIError
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    Usage,
)


class _ResponseShape:
    """What one request's responses share: the id (``<id_prefix>-...``), model and time."""

    id_prefix = ""
    prompt_param = ""  #: the field an error about the prompt names

    def __init__(self, model_name: str, hide_speculative: bool = False):
        self.request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.model_name = model_name
        self.created = int(time.time())
        self.hide_speculative = hide_speculative  # leave usage.speculative out

    def usage_of(self, final: Finished) -> Usage:
        return usage_of(final, self.hide_speculative)


class CompletionShape(_ResponseShape):
    """``/v1/completions``: ``text_completion`` objects, for chunks too."""

    id_prefix = "cmpl"
    prompt_param = "prompt"

    def _make(self, choices: list, usage: Optional[Usage] = None) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model_name, choices=choices,
                                  usage=usage)

    def opening(self) -> list[BaseModel]:
        return []

    def text(self, text: str) -> list[BaseModel]:
        return [self._make([CompletionChoice(text=text)])]

    def finish(self, finish_reason: str) -> list[BaseModel]:
        return [self._make([CompletionChoice(text="", finish_reason=finish_reason)])]

    def usage(self, final: Finished) -> BaseModel:
        return self._make([], self.usage_of(final))

    def response(self, final: Finished) -> CompletionResponse:
        return self._make([CompletionChoice(text=final.text, finish_reason=final.finish_reason)],
                          self.usage_of(final))


class ChatShape(_ResponseShape):
    """``/v1/chat/completions``: ``chat.completion`` and ``chat.completion.chunk`` objects.
    With ``tools``, calls to them are parsed out of the text."""

    id_prefix = "chatcmpl"
    prompt_param = "messages"

    def __init__(self, model_name: str, hide_speculative: bool = False, tools: tuple[FunctionTool, ...] = ()):
        super().__init__(model_name, hide_speculative)
        self.tools = list(tools)
        self._parser = ToolCallParser(frozenset(t.name for t in tools)) if tools else None
        self._num_calls_sent = 0

    def _chunk(self, choices: list, usage: Optional[Usage] = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model_name, choices=choices,
                                   usage=usage)

    def opening(self) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])]

    def text(self, text: str) -> list[BaseModel]:
        if self._parser is None:
            return [self._chunk([ChatChunkChoice(delta=ChatDelta(content=text))])]
        return self._events(self._parser.feed(text))

    def finish(self, finish_reason: str) -> list[BaseModel]:
        chunks = self._events(self._parser.finish()) if self._parser is not None else []
        if self._parser is not None and self._parser.num_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return chunks + [self._chunk([ChatChunkChoice(delta=ChatDelta(), finish_reason=finish_reason)])]

    def _events(self, events: list) -> list[BaseModel]:
        """Chunks for parser events: content as it is; a call as its opening delta (index, id,
        type, name, empty arguments), then its arguments."""
        chunks = []
        for event in events:
            if isinstance(event, ToolCall):
                index, self._num_calls_sent = self._num_calls_sent, self._num_calls_sent + 1
                opening = {"index": index, "id": event.id, "type": "function",
                           "function": {"name": event.name, "arguments": ""}}
                chunks.append(self._chunk([ChatChunkChoice(delta=ChatDelta(tool_calls=[opening]))]))
                arguments = {"index": index, "function": {"arguments": event.arguments}}
                chunks.append(self._chunk([ChatChunkChoice(delta=ChatDelta(tool_calls=[arguments]))]))
            else:
                chunks.append(self._chunk([ChatChunkChoice(delta=ChatDelta(content=event))]))
        return chunks

    def usage(self, final: Finished) -> BaseModel:
        return self._chunk([], self.usage_of(final))

    def response(self, final: Finished) -> ChatCompletionResponse:
        content, calls = parse_output(final.text, self.tools) if self.tools else (final.text, [])
        finish_reason = "tool_calls" if calls and final.finish_reason == "stop" else final.finish_reason
        message = AssistantMessage(content=content, tool_calls=[c.to_openai() for c in calls] or None)
        choice = ChatChoice(message=message, finish_reason=finish_reason)
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model_name,
                                      choices=[choice], usage=self.usage_of(final))


Shape = Union[CompletionShape, ChatShape]


async def sse_events(stream: RequestStream, shape: Shape, include_usage: bool) -> AsyncIterator[str]:
    """The events of one request: its text as it comes, the finish reason, the usage (when
    asked for), ``[DONE]``."""
    for chunk in shape.opening():
        yield _sse(chunk)
    async for event in stream:
        if event.text:
            for chunk in shape.text(event.text):
                yield _sse(chunk)
        if isinstance(event, Finished):
            if event.error:
                yield _sse_error(event.error)
                break
            for chunk in shape.finish(event.finish_reason):
                yield _sse(chunk)
            if include_usage:
                yield _sse(shape.usage(event))
    yield "data: [DONE]\n\n"


def event_stream(chunks: AsyncIterator[str], stream: RequestStream) -> StreamingResponse:
    """The response that sends ``chunks`` as server-sent events. When the client disconnects, starlette cancels the iteration and the
    request is aborted (its KV cache freed)."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            stream.abort()  # no-op when it finished

    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(chunk: BaseModel) -> str:
    data = chunk.model_dump(mode="json", exclude_none=True)
    for choice in data.get("choices", ()):
        choice.setdefault("finish_reason", None)  # OpenAI chunks say null until the last one
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _sse_error(message: str) -> str:
    """The error event that ends a stream whose request failed in the engine (a client cannot
    get a 500 once the 200 and the first chunks are sent)."""
    return f"data: {json.dumps(APIError(500, message, code='engine_error').body())}\n\n"


def usage_of(final: Finished, hide_speculative: bool = False) -> Usage:
    """The usage of a finished request (without ``speculative`` when ``hide_speculative``)."""
    return Usage.of(final.num_prompt_tokens, final.num_generated, None if hide_speculative else final.metrics)
