"""From a request's engine events to OpenAI responses: whole, or as server-sent events.

Completions and chat completions differ only in the shape of their objects
(:class:`CompletionShape`, :class:`ChatShape`); :func:`sse_events` streams either, for every
choice of a request (``n``) at once (:class:`StreamGroup`). A chat request that offers tools has
each choice's output parsed for calls (``<tool_call>`` blocks, or fenced JSON ones:
:class:`~specdec.structured.tool_calls.ToolCallParser`): streamed, each call comes as OpenAI
streams one (a delta with its index, id, type and function name, then its arguments), and the
finish reason is ``tool_calls``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Callable, Optional, Sequence, Union

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from ..engine.logprobs import TokenLogprob
from ..metrics import SpecMetrics
from ..structured.tool_calls import FunctionTool, ToolCall, ToolCallParser, parse_output
from .engine_loop import Delta, Finished, RequestStream
from .errors import APIError
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)


class _ResponseShape:
    """What one request's responses share: the id (``<id_prefix>-...``), model and time, and
    how its tokens are shown in ``logprobs`` (``token_text(id)``)."""

    id_prefix = ""
    prompt_param = ""  #: the field an error about the prompt names

    def __init__(self, model_name: str, hide_speculative: bool = False,
                 token_text: Optional[Callable[[int], str]] = None):
        self.request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.model_name = model_name
        self.created = int(time.time())
        self.hide_speculative = hide_speculative  # leave usage.speculative out
        self.token_text = token_text or str

    def usage_of(self, finals: Sequence[Finished]) -> Usage:
        return usage_of(finals, self.hide_speculative)


class CompletionShape(_ResponseShape):
    """``/v1/completions``: ``text_completion`` objects, for chunks too."""

    id_prefix = "cmpl"
    prompt_param = "prompt"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._offsets: dict[int, int] = {}  # per choice: characters of token text so far (text_offset)

    def _make(self, choices: list, usage: Optional[Usage] = None) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model_name, choices=choices,
                                  usage=usage)

    def _logprobs(self, index: int, entries: Sequence[TokenLogprob]) -> CompletionLogprobs:
        tokens, offsets = [], []
        offset = self._offsets.get(index, 0)
        for entry in entries:
            text = self.token_text(entry.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[e.logprob for e in entries], text_offset=offsets,
            top_logprobs=[{self.token_text(t): lp for t, lp in e.top} for e in entries])

    def opening(self, num_choices: int) -> list[BaseModel]:
        return []

    def text(self, index: int, text: str, logprobs: Optional[Sequence[TokenLogprob]],
             token_sources: Optional[list[dict]] = None) -> list[BaseModel]:
        return [self._make([CompletionChoice(index=index, text=text, token_sources=token_sources,
                                             logprobs=None if logprobs is None else self._logprobs(index, logprobs))])]

    def finish(self, index: int, finish_reason: str) -> list[BaseModel]:
        return [self._make([CompletionChoice(index=index, text="", finish_reason=finish_reason)])]

    def usage(self, finals: Sequence[Finished]) -> BaseModel:
        return self._make([], self.usage_of(finals))

    def response(self, finals: Sequence[Finished], logprobs: bool) -> CompletionResponse:
        return self._make([CompletionChoice(index=i, text=final.text, finish_reason=final.finish_reason,
                                            logprobs=self._logprobs(i, final.logprobs) if logprobs else None,
                                            token_sources=final.token_sources)
                           for i, final in enumerate(finals)], self.usage_of(finals))


class ChatShape(_ResponseShape):
    """``/v1/chat/completions``: ``chat.completion`` and ``chat.completion.chunk`` objects.
    With ``tools``, calls to them are parsed out of each choice's text, at most ``max_calls``
    of them (None: any number), the text after the last one dropped."""

    id_prefix = "chatcmpl"
    prompt_param = "messages"

    def __init__(self, model_name: str, hide_speculative: bool = False,
                 token_text: Optional[Callable[[int], str]] = None, tools: Sequence[FunctionTool] = (),
                 max_calls: Optional[int] = None):
        super().__init__(model_name, hide_speculative, token_text)
        self.tools = list(tools)
        self.max_calls = max_calls
        self._parsers: dict[int, ToolCallParser] = {}  # per choice, when there are tools
        self._calls_sent: dict[int, int] = {}

    def _parser(self, index: int) -> Optional[ToolCallParser]:
        if not self.tools:
            return None
        if index not in self._parsers:
            self._parsers[index] = ToolCallParser(frozenset(t.name for t in self.tools), self.max_calls)
        return self._parsers[index]

    def _chunk(self, choices: list, usage: Optional[Usage] = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model_name, choices=choices,
                                   usage=usage)

    def _top(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
        return ChatLogprobs(content=[
            ChatTokenLogprob(**self._top(e.token_id, e.logprob), top_logprobs=[self._top(t, lp) for t, lp in e.top])
            for e in entries])

    def opening(self, num_choices: int) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                for i in range(num_choices)]

    def text(self, index: int, text: str, logprobs: Optional[Sequence[TokenLogprob]],
             token_sources: Optional[list[dict]] = None) -> list[BaseModel]:
        logprobs = None if logprobs is None else self._logprobs(logprobs)
        parser = self._parser(index)
        if parser is None:
            return [self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=text), logprobs=logprobs,
                                                 token_sources=token_sources)])]
        chunks = self._events(index, parser.feed(text))
        # The tokens' logprobs and sources go on the first chunk of their text, or on an empty
        # one when the parser holds all of it back (a tool call in the making).
        if logprobs is not None or token_sources is not None:
            if not chunks:
                chunks = [self._chunk([ChatChunkChoice(index=index, delta=ChatDelta())])]
            chunks[0].choices[0].logprobs = logprobs
            chunks[0].choices[0].token_sources = token_sources
        return chunks

    def finish(self, index: int, finish_reason: str) -> list[BaseModel]:
        parser = self._parser(index)
        chunks = [] if parser is None else self._events(index, parser.finish())
        if parser is not None and parser.num_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return chunks + [self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=finish_reason)])]

    def _events(self, index: int, events: list) -> list[BaseModel]:
        """Chunks for a choice's parser events: content as it is; a call as its opening delta
        (call index, id, type, name, empty arguments), then its arguments."""
        chunks = []
        for event in events:
            if isinstance(event, ToolCall):
                call_index = self._calls_sent.get(index, 0)
                self._calls_sent[index] = call_index + 1
                opening = {"index": call_index, "id": event.id, "type": "function",
                           "function": {"name": event.name, "arguments": ""}}
                arguments = {"index": call_index, "function": {"arguments": event.arguments}}
                for delta in (opening, arguments):
                    chunks.append(self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=[delta]))]))
            else:
                chunks.append(self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=event))]))
        return chunks

    def usage(self, finals: Sequence[Finished]) -> BaseModel:
        return self._chunk([], self.usage_of(finals))

    def _message(self, final: Finished) -> tuple[AssistantMessage, str]:
        """A choice's message, with the calls parsed out of its text, and its finish reason."""
        content, calls = parse_output(final.text, self.tools, self.max_calls) if self.tools else (final.text, [])
        finish_reason = "tool_calls" if calls and final.finish_reason == "stop" else final.finish_reason
        return AssistantMessage(content=content, tool_calls=[c.to_openai() for c in calls] or None), finish_reason

    def response(self, finals: Sequence[Finished], logprobs: bool) -> ChatCompletionResponse:
        choices = [ChatChoice(index=i, message=message, finish_reason=finish_reason,
                              logprobs=self._logprobs(final.logprobs) if logprobs else None,
                              token_sources=final.token_sources)
                   for i, final in enumerate(finals) for message, finish_reason in [self._message(final)]]
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model_name,
                                      choices=choices, usage=self.usage_of(finals))


Shape = Union[CompletionShape, ChatShape]


class StreamGroup:
    """The streams of one request's choices (``n`` of them), aborted together."""

    def __init__(self, streams: Sequence[RequestStream]):
        self.streams = list(streams)

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()

    async def events(self) -> AsyncIterator[tuple[int, Delta | Finished]]:
        """``(choice index, event)`` as the choices produce them, until every one has finished."""
        if len(self.streams) == 1:
            async for event in self.streams[0]:
                yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            async for event in stream:
                queue.put_nowait((index, event))

        tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, event = await queue.get()
                if isinstance(event, Finished):
                    remaining -= 1
                yield index, event
        finally:
            for task in tasks:
                task.cancel()


async def sse_events(group: StreamGroup, shape: Shape, include_usage: bool, logprobs: bool) -> AsyncIterator[str]:
    """The events of one request: each choice's text (with its tokens' logprobs and token
    sources, when asked for: a chunk of tokens without text too, such as the end-of-sequence
    token) as it comes, tagged with the choice's index, its finish reason, then the usage of all
    choices (when asked for), ``[DONE]``."""
    for chunk in shape.opening(len(group.streams)):
        yield _sse(chunk)
    finals = []
    events = group.events()
    try:
        async for index, event in events:
            if event.text or (logprobs and event.logprobs) or event.token_sources:
                for chunk in shape.text(index, event.text, event.logprobs if logprobs else None,
                                        event.token_sources):
                    yield _sse(chunk)
            if isinstance(event, Finished):
                if event.error:
                    yield _sse_error(event.error)
                    break
                finals.append(event)
                for chunk in shape.finish(index, event.finish_reason):
                    yield _sse(chunk)
        else:
            if include_usage:
                yield _sse(shape.usage(finals))
    finally:
        await events.aclose()
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


def usage_of(finals: Sequence[Finished], hide_speculative: bool = False) -> Usage:
    """The usage of a finished request's choices: the prompt counted once (the choices share
    it), the completion tokens and speculative figures of all of them (no ``speculative``
    when ``hide_speculative``)."""
    return Usage.of(finals[0].num_prompt_tokens, sum(final.num_generated for final in finals),
                    SpecMetrics.total(final.metrics for final in finals), hide_speculative)
