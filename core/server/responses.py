"""From a request's engine events to OpenAI responses: whole, or as server-sent events.

Completions and chat completions differ only in the shape of their objects
(:class:`CompletionShape`, :class:`ChatShape`); :func:`sse_events` streams either.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator, Optional, Union

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

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

    def text(self, text: str, token_sources: Optional[list[dict]] = None) -> BaseModel:
        return self._make([CompletionChoice(text=text, token_sources=token_sources)])

    def finish(self, finish_reason: str) -> BaseModel:
        return self._make([CompletionChoice(text="", finish_reason=finish_reason)])

    def usage(self, final: Finished) -> BaseModel:
        return self._make([], self.usage_of(final))

    def response(self, final: Finished) -> CompletionResponse:
        return self._make([CompletionChoice(text=final.text, finish_reason=final.finish_reason,
                                            token_sources=final.token_sources)], self.usage_of(final))


class ChatShape(_ResponseShape):
    """``/v1/chat/completions``: ``chat.completion`` and ``chat.completion.chunk`` objects."""

    id_prefix = "chatcmpl"
    prompt_param = "messages"

    def _chunk(self, choices: list, usage: Optional[Usage] = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model_name, choices=choices,
                                   usage=usage)

    def opening(self) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])]

    def text(self, text: str, token_sources: Optional[list[dict]] = None) -> BaseModel:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(content=text), token_sources=token_sources)])

    def finish(self, finish_reason: str) -> BaseModel:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(), finish_reason=finish_reason)])

    def usage(self, final: Finished) -> BaseModel:
        return self._chunk([], self.usage_of(final))

    def response(self, final: Finished) -> ChatCompletionResponse:
        choice = ChatChoice(message=AssistantMessage(content=final.text), finish_reason=final.finish_reason,
                            token_sources=final.token_sources)
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model_name,
                                      choices=[choice], usage=self.usage_of(final))


Shape = Union[CompletionShape, ChatShape]


async def sse_events(stream: RequestStream, shape: Shape, include_usage: bool) -> AsyncIterator[str]:
    """The events of one request: its text as it comes (with its token sources, when asked
    for: a chunk of tokens without text too, such as the end-of-sequence token), the finish
    reason, the usage (when asked for), ``[DONE]``."""
    for chunk in shape.opening():
        yield _sse(chunk)
    async for event in stream:
        if event.text or event.token_sources:
            yield _sse(shape.text(event.text, event.token_sources))
        if isinstance(event, Finished):
            if event.error:
                yield _sse_error(event.error)
                break
            yield _sse(shape.finish(event.finish_reason))
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
    return Usage.of(final.num_prompt_tokens, final.num_generated, final.metrics, hide_speculative)
