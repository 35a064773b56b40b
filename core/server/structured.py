"""Structured output on the server: ``response_format``, ``tools`` and ``tool_choice`` turned
into what the engine and the response need.

- :func:`response_format_grammar`: ``{"type": "json_object"}`` and ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` as a grammar (``text`` and null: none);
- :func:`plan_chat`: the tools offered, the messages and template variables that render them,
  and the grammar of ``tool_choice`` ``required`` / a named function;
- :meth:`Structured.compile`: the grammar compiled (off the engine thread, bounded in time:
  :class:`~specdec.structured.grammar.GrammarCompiler`) into a :class:`CompiledGrammar`, which
  gives each choice its :class:`~specdec.structured.processor.GrammarProcessor` (and a cluster
  the grammar's text, which the instance that runs the request compiles again).

Every problem is a :class:`~specdec.errors.RequestError` naming the field, which the app
answers with a 400.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import attrs

from ..errors import RequestError
from ..structured.grammar import JSON_OPTIONS, GrammarCompiler, json_schema_grammar, lark_grammar
from ..structured.tool_calls import (FunctionTool, parse_tool_choice, parse_tools, render_chat,
                                     tool_call_grammar)


@attrs.define
class Grammar:
    """A grammar to compile for one request: the llguidance grammar text, the field an error
    names, and the JSON schemas it embeds by field (for the path of a failing subschema)."""

    text: str
    param: str
    schemas: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class Structured:
    """What one request asks of structured output."""

    grammar: Optional[Grammar] = None
    #: The tools whose calls are parsed out of the output (none: the output is all content).
    tools: list[FunctionTool] = attrs.field(factory=list)
    #: The most calls parsed out of one choice (1 with ``parallel_tool_calls`` false: the
    #: output after the first call is dropped; None: no limit).
    max_calls: Optional[int] = None

    async def compile(self, compiler: GrammarCompiler) -> "CompiledGrammar":
        """The grammar compiled once, for every engine request of this request (one per choice,
        ``n``). RequestError naming the field when it does not compile (in time)."""
        matcher = await compiler.compile_async(self.grammar.text, self.grammar.param, self.grammar.schemas)
        return CompiledGrammar(self.grammar, matcher, compiler.eos_token_ids)


@attrs.frozen
class CompiledGrammar:
    """A request's grammar, compiled: :meth:`processors` for each engine request that runs on
    this instance, :meth:`spec` for one a cluster runs elsewhere (row processors are Python
    objects; the text is what another instance compiles again)."""

    grammar: Grammar
    matcher: Any
    eos_token_ids: list

    def processors(self) -> list:
        """The row processors of one engine request: a fresh matcher each."""
        from ..structured.processor import GrammarProcessor

        return [GrammarProcessor(self.matcher.deep_copy(), self.eos_token_ids)]

    def spec(self) -> dict:
        """``{"text", "param"}``: the grammar as a cluster's job carries it."""
        return {"text": self.grammar.text, "param": self.grammar.param}


def response_format_grammar(value: Any) -> Optional[Grammar]:
    """The grammar of ``response_format`` (None for ``text``, or null)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise RequestError("response_format", 'expected {"type": "text"}, {"type": "json_object"} or '
                                              '{"type": "json_schema", "json_schema": {...}}')
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise RequestError(f"response_format.{sorted(extra)[0]}", "unknown field")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
        return Grammar(json_schema_grammar(schema, "response_format"), "response_format")
    if kind != "json_schema":
        raise RequestError("response_format.type", f"expected text, json_object or json_schema, got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError("response_format.json_schema", 'expected {"name": ..., "schema": {...}, "strict": true}')
    extra = set(spec) - {"name", "description", "schema", "strict"}
    if extra:
        raise RequestError(f"response_format.json_schema.{sorted(extra)[0]}", "unknown field")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise RequestError("response_format.json_schema.name", "expected a non-empty string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise RequestError("response_format.json_schema.strict", "expected a boolean")
    param = "response_format.json_schema.schema"
    schema = spec.get("schema", {"type": "object"})
    return Grammar(json_schema_grammar(schema, param), param, {param: schema})


def chat_prompt_chars(messages: list[dict], extra: dict) -> int:
    """The characters a rendered chat (:func:`plan_chat`'s messages and template variables)
    puts before the template: every string the template writes counts (a role or a name is
    prompt text too, and past calls and the tools offered), for ``--max-prompt-chars``."""
    return sum(len(message["role"]) + len(message["content"]) + len(message.get("name") or "")
               + (len(json.dumps(message["tool_calls"])) if message.get("tool_calls") else 0)
               for message in messages) + (len(json.dumps(extra["tools"])) if "tools" in extra else 0)


def plan_chat(messages: list[dict], tools_value: Any, tool_choice_value: Any, parallel_tool_calls: Any,
              response_format: Any, template_source: Optional[str],
              tags: Optional[dict[str, int]] = None) -> tuple[list[dict], dict, Structured]:
    """The messages and template variables to render, and the request's :class:`Structured`
    (``tags``: the call tags the model's tokenizer has as one token, :func:`tag_tokens`).

    With ``tool_choice`` ``none`` the tools are neither shown to the model nor parsed out of
    its output. ``auto`` shows them and parses what calls the model writes; ``required`` and
    a named function also constrain the output to such calls. A grammar from ``tool_choice``
    and one from ``response_format`` cannot both apply: that is a 400."""
    tools = parse_tools(tools_value)
    choice = parse_tool_choice(tool_choice_value, tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise RequestError("parallel_tool_calls", "expected a boolean")
    offered = tools if choice.mode != "none" else []
    rendered, extra = render_chat(messages, offered, template_source)
    structured = Structured(response_format_grammar(response_format), offered,
                            1 if parallel_tool_calls is False else None)
    tool_grammar = tool_call_grammar(offered, choice, parallel_tool_calls is not False, JSON_OPTIONS, tags)
    if tool_grammar is not None:
        if structured.grammar is not None:
            raise RequestError("response_format", f"cannot be combined with tool_choice {choice.mode!r} "
                                                  "(the reply must then be a tool call)")
        schemas = {f"tools[{i}].function.parameters": t.parameters for i, t in enumerate(tools)
                   if choice.mode == "required" or t.name == choice.name}
        structured.grammar = Grammar(lark_grammar(tool_grammar), "tools", schemas)
    return rendered, extra, structured
