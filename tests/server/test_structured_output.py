"""Structured output and tool calls through the official ``openai`` client, on the real server
(the session's, default model), with every speculative method.

- ``response_format`` ``json_schema``: every output of the schemas of
  ``tests/fixtures/json_schemas.json`` (nested objects, arrays, enums, numbers, anyOf, $ref),
  and a ``json_object`` one, parses and validates (``jsonschema``), with naive, ngram, suffix,
  mtp, hybrid and the draft model, sent at once; the texts are the same with every method (the mask applies at every verified
  position, and drafts were accepted under it).
- An agent loop of 6 tool-call turns (call, result, next call; ``tool_choice`` ``required``:
  the model picks the tool and its arguments) and a last turn it may answer (``auto``),
  streamed and not in turns: the same transcript with every method, drafts accepted in it.
  (tests/server/test_tools_qwen.py runs one with ``auto`` throughout on Qwen2.5-Coder, which
  writes its calls itself: ``make test-qwen``.)
- Bad input is a 400 naming the field (a schema llguidance cannot compile names the path of
  the subschema), and a grammar that takes long to compile is refused in bounded time while
  other requests go on.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import jsonschema
import pytest
from agent_loop import accepted_drafts, run_agent_loop
from server_harness import MODEL_NAME, speculative_method

pytestmark = pytest.mark.slow

SCHEMAS = json.loads((Path(__file__).parents[1] / "fixtures" / "json_schemas.json").read_text())
#: Each method and the keys it needs besides its defaults: the draft model is the default model
#: drafting for itself through int4 kernels (tests/e2e/test_draft_model.py's).
METHODS = {"naive": {}, "ngram": {}, "suffix": {}, "mtp": {}, "hybrid": {},
           "draft_model": {"model": "smollm2-135m-instruct", "quantization": "wint4"}}
#: Every draft verified (no adaptive draft length), so that drafts meet the grammar's mask.
EVERY_DRAFT = {"adaptive_draft_length": False, "num_speculative_tokens": 3}
SCHEMA_MAX_TOKENS = 48

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers and return the sum.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                   "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}
NOTE_TOOL = {"type": "function", "function": {
    "name": "note", "description": "Write a short note.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 20}},
                   "required": ["text"], "additionalProperties": False}}}
TOOLS = {"add": ADD_TOOL, "note": NOTE_TOOL}
AGENT_TURNS = 6


def _response_format(entry: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": entry["name"], "schema": entry["schema"], "strict": True}}


#: ``response_format`` ``json_object``, sent along with the schemas: any JSON object.
JSON_OBJECT = {"name": "json_object", "prompt": "Give the point x 1, y 2.", "schema": {"type": "object"},
               "response_format": {"type": "json_object"}}


async def _schema_outputs(server, entries) -> list[tuple[str, str, int]]:
    client = server.async_openai()
    async with client:
        async def one(entry):
            response = await client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": entry["prompt"] + " Answer in JSON."}],
                max_tokens=SCHEMA_MAX_TOKENS, temperature=0,
                response_format=entry.get("response_format") or _response_format(entry))
            accepted = accepted_drafts(response.usage)
            return response.choices[0].message.content, response.choices[0].finish_reason, accepted

        return await asyncio.gather(*(one(entry) for entry in entries))


def test_every_schema_validates_with_every_method(server):
    assert len(SCHEMAS) >= 20
    entries = [*SCHEMAS, JSON_OBJECT]
    texts = {}
    for method in METHODS:
        with speculative_method(server, method, **METHODS[method], **EVERY_DRAFT):
            outputs = asyncio.run(_schema_outputs(server, entries))
        problems = []
        for entry, (text, finish_reason, _) in zip(entries, outputs):
            try:
                jsonschema.validate(json.loads(text), entry["schema"])
            except (ValueError, jsonschema.ValidationError) as exc:
                problems.append(f"{method} {entry['name']} ({finish_reason}): {text!r}: {str(exc)[:200]}")
        assert not problems, "\n".join(problems)
        if method != "naive":
            assert sum(accepted for *_, accepted in outputs) > 0, f"{method}: no draft accepted under the grammar"
        texts[method] = [text for text, *_ in outputs]
    for method in list(METHODS)[1:]:
        assert texts[method] == texts["naive"], f"{method} differs from naive at temperature 0"


def test_completions_and_chat_stream_a_schema(server):
    entry = SCHEMAS[0]
    chunks = server.openai().completions.create(
        model=MODEL_NAME, prompt="A person, as JSON: ", max_tokens=SCHEMA_MAX_TOKENS, temperature=0, stream=True,
        extra_body={"response_format": _response_format(entry)})
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), entry["schema"])
    options = dict(model=MODEL_NAME, messages=[{"role": "user", "content": entry["prompt"] + " Answer in JSON."}],
                   max_tokens=SCHEMA_MAX_TOKENS, temperature=0, response_format=_response_format(entry))
    whole = server.openai().chat.completions.create(**options).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in server.openai().chat.completions.create(
        stream=True, **options) if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), entry["schema"])


# -- tools --------------------------------------------------------------------------------------


def _run_tool(name: str, arguments: dict) -> str:
    jsonschema.validate(arguments, TOOLS[name]["function"]["parameters"])
    return str(arguments["a"] + arguments["b"]) if name == "add" else "noted"


def test_agent_loop_is_the_same_with_every_method(server):
    """Six turns in which the model must call a tool (it picks which, and the arguments), each
    result going back, then a turn in which it may answer; streamed and whole in turns."""
    messages = [{"role": "user", "content": "Start at 5. Add 7, then keep adding 7 to the last result. "
                                            "Note the result when it passes 40."}]
    choices = ["required"] * AGENT_TURNS + ["auto"]
    transcripts = {}
    for method in METHODS:
        with speculative_method(server, method, **METHODS[method], **EVERY_DRAFT):
            transcript, accepted = run_agent_loop(server.openai(), messages, choices, _run_tool, model=MODEL_NAME,
                                                  tools=list(TOOLS.values()), max_tokens=40, temperature=0,
                                                  parallel_tool_calls=False)
        assert len(transcript) == AGENT_TURNS + 1 and all(len(calls) == 1 for _, calls, _ in transcript[:-1]), \
            (method, transcript)
        if method != "naive":
            assert accepted > 0, f"{method}: no draft accepted in the loop"
        transcripts[method] = transcript
    for method in list(METHODS)[1:]:
        assert transcripts[method] == transcripts["naive"], f"{method}: {transcripts[method]} != {transcripts['naive']}"


def test_tool_choice_none_answers_in_text(server):
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]
    choice = server.openai().chat.completions.create(model=MODEL_NAME, messages=messages, tools=[ADD_TOOL],
                                                     tool_choice="none", max_tokens=6, temperature=0).choices[0]
    assert choice.message.tool_calls is None and choice.message.content and choice.finish_reason != "tool_calls"


def test_required_tool_choice_gives_valid_calls_of_the_offered_tools(server):
    response = server.openai().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Write a note saying hello."}],
        tools=[ADD_TOOL, NOTE_TOOL], tool_choice="required", parallel_tool_calls=False, max_tokens=40, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    tool = {"add": ADD_TOOL, "note": NOTE_TOOL}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


# -- bad input ----------------------------------------------------------------------------------


def _post_chat(server, **fields):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    return server.http.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"age": {"type": "integer"}, "tags": {"type": "array", "items": {
            "type": "string", "pattern": "(unclosed"}}}}}}},
     "response_format.json_schema.schema.properties.tags.items"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}},
     "response_format.json_schema.schema.properties.a"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
     "response_format.json_schema.name"),
    ({"tools": [ADD_TOOL], "tool_choice": {"type": "function", "function": {"name": "multiply"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "format": "no-such-format"}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters.properties.x"),
    ({"messages": [{"role": "tool", "content": "4"}]}, "messages[0].tool_call_id"),
])
def test_bad_structured_input_is_a_400_naming_the_field(server, fields, param):
    response = _post_chat(server, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_a_slow_grammar_is_refused_in_bounded_time_while_others_run(server):
    """A 50,000-value enum (a 1.1 MB body) takes llguidance ~0.1 s to compile on a 2-core AMD
    Zen 5, more elsewhere; with a 0.01 s bound the request is a 400 soon after, and a plain
    request sent meanwhile is served."""
    compiler = server.uvicorn_server.config.app.state.grammar_compiler
    slow_schema = {"enum": [f"value_{i}_{'x' * (i % 13)}" for i in range(50_000)]}
    saved, compiler.timeout_s = compiler.timeout_s, 0.01

    async def both():
        client = server.async_openai()
        async with client:
            async def slow():
                started = time.monotonic()
                with pytest.raises(Exception) as caught:
                    await client.chat.completions.create(
                        model=MODEL_NAME, messages=[{"role": "user", "content": "Pick one."}], max_tokens=4,
                        response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": slow_schema}})
                return caught.value, time.monotonic() - started

            async def plain():
                await asyncio.sleep(0.1)
                response = await client.chat.completions.create(
                    model=MODEL_NAME, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0)
                return response.choices[0].finish_reason

            return await asyncio.gather(slow(), plain())

    try:
        (error, seconds), finish_reason = asyncio.run(both())
    finally:
        compiler.timeout_s = saved
    assert getattr(error, "status_code", None) == 400, error
    assert error.body["code"] == "grammar_too_complex" and error.body["param"] == "response_format.json_schema.schema"
    assert seconds < 5, seconds
    assert finish_reason in ("stop", "length")
