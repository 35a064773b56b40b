"""``POST /tokenize`` and ``POST /detokenize``, as vLLM serves them.

Agents count tokens before they send a request (does the conversation still fit? how much of
the context is left?) and turn token ids from logs back into text; with the server's own
tokenizer and chat template the counts are exact. The request and response fields are vLLM's:

- ``/tokenize`` takes ``prompt`` (a string; ``add_special_tokens`` default true) or
  ``messages`` (a chat, with ``tools`` if it offers any, rendered as a chat request renders
  them: past tool calls, tool results and the tools through the chat template or this
  server's preamble; ``add_generation_prompt`` default true, ``add_special_tokens`` default
  false) and answers ``count``, ``max_model_len``, ``tokens`` (and ``token_strs`` with
  ``return_token_strs``). For a chat, ``count`` is the ``prompt_tokens`` a chat request with
  the same messages and tools is billed.
- ``/detokenize`` takes ``tokens`` and answers ``prompt``.

They sit behind the API key and the body, prompt-size and host limits like the ``/v1/``
endpoints; tokenizing runs in a worker thread, never on the event loop. A bad token id is a
400 naming ``tokens``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Optional

from pydantic import BaseModel, Field, field_validator

from ..config import describe
from ..structured.tool_calls import parse_tools, render_chat
from .errors import APIError, as_400
from .protocol import ChatMessage, _Strict, check_text
from .structured import chat_prompt_chars


class TokenizeRequest(_Strict):
    """``POST /tokenize``: one of ``prompt`` (text) and ``messages`` (a chat)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    #: The tools a chat offers (as in a chat request): they are part of its prompt.
    tools: Any = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Optional[str]) -> Optional[str]:
        return value if value is None else check_text(value)

    def checked(self) -> None:
        """A 400 naming the field for a combination this server does not take."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "prompt: give either prompt or messages", param="prompt")
        if self.messages is None and self.tools is not None:
            raise APIError(400, "tools: only with messages", param="tools")
        if self.messages is None and not self.add_generation_prompt:
            raise APIError(400, "add_generation_prompt: only with messages", param="add_generation_prompt")
        for i, message in enumerate(self.messages or ()):
            message.check_unsupported_fields(i)
        if self.continue_final_message:
            raise APIError(400, "continue_final_message: not supported by this server", param="continue_final_message",
                           code="unsupported_value")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(_Strict):
    """``POST /detokenize``: token ids back to text."""

    model: Optional[str] = None
    tokens: Any

    @field_validator("tokens", mode="before")
    @classmethod
    def _check_tokens(cls, value: Any) -> Any:
        if not isinstance(value, list) or not all(type(t) is int for t in value):
            raise ValueError(f"expected a list of token ids, got {describe(value)}")
        return value


class DetokenizeResponse(BaseModel):
    prompt: str


async def tokenize(body: TokenizeRequest, tokenizer, max_model_len: int, max_prompt_chars: int,
                   big_prompts: asyncio.Semaphore, big_prompt_chars: int) -> TokenizeResponse:
    """The tokens of ``body``'s prompt or chat (see the module's docstring). Texts over
    ``big_prompt_chars`` take ``big_prompts`` while they are tokenized (the generation
    endpoints' semaphore: few long texts at once)."""
    body.checked()
    if body.prompt is not None:
        param, text, num_chars = "prompt", body.prompt, len(body.prompt)
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
    else:
        messages, extra = as_400(lambda: render_chat([message.to_template() for message in body.messages],
                                                     parse_tools(body.tools), tokenizer.chat_template))
        param, num_chars = "messages", chat_prompt_chars(messages, extra)
        add_special = bool(body.add_special_tokens)
    if num_chars > max_prompt_chars:
        raise APIError(400, f"{param}: {num_chars} characters is more than this server takes ({max_prompt_chars}, "
                            "--max-prompt-chars)", param=param, code="context_length_exceeded")

    def encode() -> list[int]:
        source = text if body.prompt is not None else \
            tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, **extra)
        return tokenizer.encode(source, add_special_tokens=add_special)

    async with big_prompts if num_chars > big_prompt_chars else contextlib.nullcontext():
        try:
            tokens = await asyncio.to_thread(encode)
        except Exception as exc:  # noqa: BLE001 - no chat template, or the template refused the messages
            raise APIError(400, f"{param}: cannot tokenize: {' '.join(str(exc).split())[:200]}", param=param) from None
    token_strs = [tokenizer.id_to_token(t) or "" for t in tokens] if body.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=max_model_len, tokens=tokens, token_strs=token_strs)


async def detokenize(body: DetokenizeRequest, tokenizer) -> DetokenizeResponse:
    """The text of ``body.tokens``; an id outside the vocabulary is a 400 naming ``tokens``."""
    vocab_size = tokenizer.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens: token ids must be between 0 and {vocab_size - 1}, got {body.tokens[bad]} "
                            f"at index {bad}", param="tokens")
    text = await asyncio.to_thread(tokenizer.decode, body.tokens)
    return DetokenizeResponse(prompt=text)
