"""Tool use in the Hermes / Qwen2.5 format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Three parts, each usable alone:

- the request side: :func:`parse_tools` and :func:`parse_tool_choice` check ``tools`` and
  ``tool_choice`` (a :class:`~specdec.errors.RequestError` naming the field when invalid);
- rendering: :func:`render_chat` hands tools and tool messages to a chat template that knows
  them (Qwen2.5's, whose ``tools`` variable it fills), and for a template that does not
  (SmolLM2's) writes the same thing Qwen2.5's template writes, as a system-message preamble,
  ``<tool_call>`` blocks in the assistant turns and ``<tool_response>`` blocks in user turns;
- parsing: :class:`ToolCallParser` turns the output text, as it streams, into content pieces
  and :class:`ToolCall` objects, from ``<tool_call>`` blocks, and from fenced JSON blocks and
  bare JSON objects (at the output's start or right after a call) holding the same object:
  what Qwen2.5-Coder writes when it may answer in text. A block that is not a JSON object with
  a known ``name`` and an object ``arguments`` stays content: a model's malformed call is
  returned as text, never an error.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Callable, Iterable, Optional, Union

import attrs

from ..errors import RequestError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

#: What Qwen2.5's template writes after the system message when the request has tools.
_PREAMBLE_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_PREAMBLE_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                  "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                  '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


@attrs.frozen
class FunctionTool:
    """One ``{"type": "function", "function": {...}}`` entry of ``tools``; ``parameters`` is
    the JSON schema of its arguments (an object schema)."""

    name: str
    parameters: dict
    description: Optional[str] = None

    def to_openai(self) -> dict:
        """The tool as the OpenAI API writes it (and chat templates read it)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@attrs.frozen
class ToolChoice:
    """``tool_choice``: ``mode`` is ``none``, ``auto``, ``required`` or ``named`` (then
    ``name`` is the function that must be called)."""

    mode: str
    name: Optional[str] = None


@attrs.frozen
class ToolCall:
    """A parsed call: ``arguments`` is the JSON text of the arguments object (as OpenAI has it)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    """A fresh ``call_...`` id (random: ids must differ across the turns of a conversation)."""
    return "call_" + secrets.token_hex(12)


# -- the request side ---------------------------------------------------------------------------


def parse_tools(value: Any) -> list[FunctionTool]:
    """The function tools of ``tools`` (null or ``[]``: none). RequestError naming the entry
    (``tools[1].function.name``) when one is not a function tool with a name and an object
    ``parameters`` schema; duplicate names are refused too (a call could not say which)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError("tools", f"expected a list of tools, got {type(value).__name__}")
    tools: list[FunctionTool] = []
    for i, entry in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise RequestError(f"{where}.type", 'only function tools are supported: {"type": "function", '
                                                '"function": {"name": ..., "parameters": {...}}}')
        unknown = set(entry) - {"type", "function"}
        if unknown:
            raise RequestError(f"{where}.{sorted(unknown)[0]}", "unknown field")
        function = entry.get("function")
        if not isinstance(function, dict):
            raise RequestError(f"{where}.function", "expected an object with a name and parameters")
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise RequestError(f"{where}.function.{sorted(unknown)[0]}", "unknown field")
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(
                c.isascii() and (c.isalnum() or c in "_-") for c in name):
            raise RequestError(f"{where}.function.name", "must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -, "
                                                         f"got {name!r}")
        if any(t.name == name for t in tools):
            raise RequestError(f"{where}.function.name", f"'{name}' is defined twice")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise RequestError(f"{where}.function.description", "expected a string")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise RequestError(f"{where}.function.strict", "expected a boolean")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise RequestError(f"{where}.function.parameters", 'expected an object schema ({"type": "object", ...})')
        tools.append(FunctionTool(name, parameters, description))
    return tools


def parse_tool_choice(value: Any, tools: list[FunctionTool]) -> ToolChoice:
    """``tool_choice`` against ``tools``: OpenAI's default is ``auto`` with tools and ``none``
    without; ``required`` and a named function need tools (and the name must be one of them)."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise RequestError("tool_choice", "'required' needs tools")
        return ToolChoice(value if tools else "none")
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        names = [t.name for t in tools]
        if name not in names:
            raise RequestError("tool_choice.function.name", f"{name!r} is not one of the tools ({', '.join(names) or 'none given'})")
        return ToolChoice("named", name)
    raise RequestError("tool_choice", 'expected "none", "auto", "required" or '
                                      '{"type": "function", "function": {"name": ...}}')


# -- rendering ------------------------------------------------------------------------------------


def template_knows_tools(template_source: Optional[str]) -> bool:
    """Whether a chat template renders tools itself (it reads the ``tools`` variable)."""
    return bool(template_source) and "tools" in template_source


#: The deepest arguments a history call's JSON is read as an object: deeper ones stay text (the
#: template and the preamble write them back with recursive encoders, which a client could
#: otherwise run out of stack).
MAX_ARGUMENTS_DEPTH = 64


#: What :func:`_decoded` gives for text that is no JSON.
_NOT_JSON = object()


def _decoded(text: str) -> Any:
    """``json.loads(text)``, or :data:`_NOT_JSON` for text that is no JSON or nests deeper than
    the decoder goes (a RecursionError, which text from a client or a model must not raise)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _NOT_JSON


def arguments_object(arguments: Any) -> Any:
    """A history tool call's ``arguments`` as an object: OpenAI sends a JSON string, chat
    templates (Qwen2.5's ``arguments | tojson``) expect the object. Text that is no JSON, or
    JSON nested deeper than :data:`MAX_ARGUMENTS_DEPTH`, is kept as it is."""
    if isinstance(arguments, str):
        value = _decoded(arguments)
        return value if value is not _NOT_JSON and _depth(value) <= MAX_ARGUMENTS_DEPTH else arguments
    return arguments


def _depth(value: Any) -> int:
    """How deep lists and dicts nest in a decoded JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def call_block(name: str, arguments: Any) -> str:
    """One ``<tool_call>`` block, written as Qwen2.5's template writes it."""
    return f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n{TOOL_CALL_CLOSE}'


def render_chat(messages: list[dict], tools: list[FunctionTool], template_source: Optional[str]) -> tuple[list[dict], dict]:
    """The messages and the extra template variables that render ``messages`` (OpenAI
    messages, ``tool_calls`` and ``role: tool`` included) with ``tools`` (offered to the model,
    empty for none).

    A template that knows tools gets them as its ``tools`` variable, and the messages with the
    arguments of past calls as objects. For any other template the tool use is written into
    plain messages the way Qwen2.5's template writes it: the tool list as a preamble of the
    system message (one is added when there is none), past calls as ``<tool_call>`` blocks in
    the assistant's content, and tool results as ``<tool_response>`` blocks in a user message.
    """
    if template_knows_tools(template_source):
        rendered = []
        for message in messages:
            message = dict(message)
            if message.get("tool_calls"):
                message["tool_calls"] = [
                    {**call, "function": {**call["function"], "arguments": arguments_object(call["function"].get("arguments"))}}
                    for call in message["tool_calls"]]
            rendered.append(message)
        return rendered, ({"tools": [t.to_openai() for t in tools]} if tools else {})
    rendered: list[dict] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if rendered and rendered[-1].get("_tool_results"):
                rendered[-1]["content"] += "\n" + block
            else:
                rendered.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if role == "assistant" and message.get("tool_calls"):
            blocks = [call_block(c["function"]["name"], arguments_object(c["function"].get("arguments")))
                      for c in message["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        rendered.append({k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
                        | {"content": content})
    for message in rendered:
        message.pop("_tool_results", None)
    if tools:
        preamble = _PREAMBLE_HEAD + "".join("\n" + json.dumps(t.to_openai(), ensure_ascii=False) for t in tools) \
            + _PREAMBLE_TAIL
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": (rendered[0]["content"] + "\n\n" + preamble).lstrip("\n")}
        else:
            rendered.insert(0, {"role": "system", "content": preamble})
    return rendered, {}


# -- parsing --------------------------------------------------------------------------------------


#: The blocks calls are parsed from, as ``(opening, closing)``: Hermes / Qwen2.5's tags, and a
#: fenced JSON block holding the same object, which Qwen2.5-Coder writes instead when it may
#: answer in text (``tool_choice`` ``auto``; llama.cpp's Hermes parser takes it too, and the
#: bare object below).
CALL_BLOCKS = ((TOOL_CALL_OPEN, TOOL_CALL_CLOSE), ("```json\n", "```"))
#: The start of a bare JSON object with a key: at the start of the output, or right after a
#: call, such an object may be a call written without its tags (Qwen2.5-Coder's second call
#: of a conversation often is), and is held back until it is complete.
_BARE_OBJECT = re.compile(r'\{\s*("|$)')
_JSON = json.JSONDecoder()


@attrs.define
class ToolCallParser:
    """Splits output text, fed piece by piece, into content and tool calls.

    ``feed(text)`` and ``finish()`` return a list of events, each a ``str`` (content to show)
    or a :class:`ToolCall`. Text that could be the start of a call block (:data:`CALL_BLOCKS`,
    or a bare object where one may be a call) is held back until it is not; a block is parsed
    when it closes (a bare object, when it is complete JSON). A block that does not
    parse (not JSON, no known ``name``, ``arguments`` not an object), or that never closes,
    comes out as content, tags included: a fenced JSON block that is not a call is content as
    written, only later. Whitespace between calls is dropped. After ``max_calls`` calls (None:
    no limit; 1 with ``parallel_tool_calls`` false) the rest of the output is dropped. Feeding
    the whole text at once gives the same events, joined, as feeding it in pieces.
    """

    tool_names: frozenset
    max_calls: Optional[int] = None
    _buffer: str = ""
    _block: Optional[tuple[str, str]] = None  # the (opening, closing) of the block being read
    _pending_space: str = ""
    _content_since_call: bool = False  # content came out since the last call (or the start)
    num_calls: int = 0
    id_factory: Any = new_call_id

    def feed(self, text: str) -> list[Union[str, ToolCall]]:
        events: list[Union[str, ToolCall]] = []
        if self._done():
            return events
        self._buffer += text
        while True:
            if self._block is not None:
                opening, closing = self._block
                end = self._buffer.find(closing, len(opening))
                if end < 0:
                    return events
                block = self._buffer[: end + len(closing)]
                self._block = None
                if self._took(events, block, self._call_of(_decoded(block[len(opening): -len(closing)]))):
                    return events
                continue
            if not self._content_since_call and _BARE_OBJECT.match(self._buffer.lstrip()):
                whole = self._bare_object()
                if whole is None:  # not complete yet
                    return events
                if self._took(events, *whole):
                    return events
                continue
            starts = [(self._buffer.find(opening), opening, closing) for opening, closing in CALL_BLOCKS]
            starts = [found for found in starts if found[0] >= 0]
            if starts:
                start, opening, closing = min(starts)
                self._content(events, self._buffer[:start])
                self._buffer = self._buffer[start:]
                self._block = (opening, closing)
                continue
            keep = max(_partial_suffix(self._buffer, opening) for opening, _ in CALL_BLOCKS)
            self._content(events, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return events

    def finish(self) -> list[Union[str, ToolCall]]:
        """The rest: an unclosed block, or held-back text, as content."""
        events: list[Union[str, ToolCall]] = []
        rest, self._buffer, self._block = self._buffer, "", None
        if not self._done():
            self._content(events, rest)
        if self._pending_space and not self.num_calls:  # an output of whitespace only
            events.append(self._pending_space)
        self._pending_space = ""
        return events

    def _done(self) -> bool:
        return self.max_calls is not None and self.num_calls >= self.max_calls

    def _took(self, events: list, block: str, call: Optional[ToolCall]) -> bool:
        """Take ``block`` off the buffer's start, as ``call`` or, when it is no call, as content;
        True when that call was the last one taken (the rest is dropped)."""
        self._buffer = self._buffer[len(block):]
        if call is None:
            self._content(events, block)
            return False
        return self._call(events, call)

    def _call(self, events: list, call: ToolCall) -> bool:
        """Add ``call``; True when it was the last one taken (the rest is dropped)."""
        self._pending_space = ""
        self._content_since_call = False
        self.num_calls += 1
        events.append(call)
        if self._done():
            self._buffer = ""
            return True
        return False

    def _bare_object(self) -> Optional[tuple[str, Optional[ToolCall]]]:
        """The buffer's leading JSON object, with the whitespace before it, and the call it is
        (None: not a call); None while it does not decode (incomplete, or not JSON: then it
        comes out as content at the end)."""
        if "}" not in self._buffer:
            return None
        start = len(self._buffer) - len(self._buffer.lstrip())
        try:
            value, end = _JSON.raw_decode(self._buffer, start)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the decoder goes
            return None
        return self._buffer[:end], self._call_of(value)

    def _content(self, events: list, text: str) -> None:
        if not text:
            return
        if not self._content_since_call and not text.strip():
            # whitespace before any content (or after a call): kept only if content follows,
            # so that it does not depend on how the text was split whether a call's leading
            # newline is content
            self._pending_space += text
            return
        events.append(self._pending_space + text)
        self._pending_space = ""
        self._content_since_call = True

    def _call_of(self, call: Any) -> Optional[ToolCall]:
        """The call a decoded JSON value is (an object of a known ``name`` and object
        ``arguments``), else None (:data:`_NOT_JSON` too)."""
        if not isinstance(call, dict) or set(call) - {"name", "arguments"}:
            return None
        name, arguments = call.get("name"), call.get("arguments", {})
        if name not in self.tool_names or not isinstance(arguments, dict):
            return None
        return ToolCall(self.id_factory(), name, json.dumps(arguments, ensure_ascii=False))


def parse_output(text: str, tools: Iterable[FunctionTool],
                 max_calls: Optional[int] = None) -> tuple[Optional[str], list[ToolCall]]:
    """The whole output's content (None when only calls) and calls (see :class:`ToolCallParser`)."""
    parser = ToolCallParser(frozenset(t.name for t in tools), max_calls)
    events = parser.feed(text) + parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e for e in events if isinstance(e, str))
    if calls:
        content = content.strip()
    return (content or None) if calls else content, calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


#: Calls one constrained reply may hold with ``parallel_tool_calls`` (a bound, so that a
#: small model cannot repeat calls until ``max_tokens``).
MAX_PARALLEL_CALLS = 8


def tag_tokens(encode: Callable[[str], list]) -> dict[str, int]:
    """The call tags a tokenizer has as one token each, by their text (``encode``: text to ids,
    no special tokens added): Qwen2.5's ``<tool_call>`` and ``</tool_call>`` are added tokens,
    which the model writes as such, and which llguidance takes for special tokens (not text)."""
    tokens = {}
    for tag in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
        ids = list(encode(tag))
        if len(ids) == 1:
            tokens[tag] = int(ids[0])
    return tokens


def tool_call_grammar(tools: list[FunctionTool], choice: ToolChoice, parallel: bool,
                      json_options: dict, tags: Optional[dict[str, int]] = None) -> Optional[str]:
    """The Lark grammar (llguidance's dialect) that ``tool_choice`` ``required`` or a named
    function imposes: the reply is one ``<tool_call>`` block (up to ``MAX_PARALLEL_CALLS``,
    newline-separated, with ``parallel``) whose JSON names one of the allowed functions and
    whose ``arguments`` follow that function's ``parameters`` schema. A tag the tokenizer has
    as one token (``tags``: :func:`tag_tokens`) may be written as that token or spelled out.
    None for ``auto`` and ``none``, which leave the model free (a call it writes is parsed all
    the same)."""
    if choice.mode not in ("required", "named"):
        return None
    tags = tags or {}

    def tag(text: str) -> str:
        spelled = json.dumps(text)
        return f"{spelled} | <[{tags[text]}]>" if text in tags else spelled

    allowed = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for t in allowed]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": json_options}
    repeat = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
    return (f"start: call{repeat}\n"
            f'call: open "\\n" %json {json.dumps(schema)} "\\n" close\n'
            f"open: {tag(TOOL_CALL_OPEN)}\n"
            f"close: {tag(TOOL_CALL_CLOSE)}\n")
