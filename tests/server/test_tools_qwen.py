"""Tools on Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), whose own chat template renders them, through
the official ``openai`` client against a real server.

The default model cannot follow a tool template on its own (it answers in text unless
``tool_choice`` makes the grammar write the call: tests/server/test_structured_output.py);
this one decides by itself. Its calls come as ``<tool_call>`` blocks, as fenced JSON or as bare
objects (Qwen2.5-Coder writes all three): each is parsed as a call.

``make test-qwen`` fetches the model and its draft model, Qwen2.5-Coder-0.5B-Instruct (1.6 GB
in all, ``benchmarks/fetch_qwen_coder.py``), and runs these tests; ``make test`` (CI) leaves them
out (marker ``qwen``), as the download and the model's speed would add minutes to every run.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from agent_loop import run_agent_loop
from server_harness import MODEL_NAME, SPECULATIVE, running_server, speculative_method

pytestmark = [pytest.mark.qwen, pytest.mark.slow]

#: Where benchmarks/fetch_qwen_coder.py puts the model and its draft model.
MODELS = Path.home() / ".cache" / "specdec" / "models"
QWEN = MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_DRAFT = MODELS / "qwen2.5-coder-0.5b-instruct.gguf"
#: The methods that run on this target (no MTP head is trained for it), each with the keys it
#: needs besides its defaults; every draft verified so that drafts meet every turn.
METHODS = {"naive": {}, "ngram": {}, "suffix": {}, "draft_model": {"model": str(QWEN_DRAFT)}}
EVERY_DRAFT = {"adaptive_draft_length": False, "num_speculative_tokens": 3}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in one city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TEMPERATURES = {"Oslo": 4, "Paris": 12, "Rome": 18, "Tokyo": 15, "Lima": 22, "Cairo": 30}
TASK = ("I need the weather in six cities: Oslo, Paris, Rome, Tokyo, Lima, Cairo. Call get_weather for each "
        "city, one at a time. After all six, tell me the warmest city.")


@pytest.fixture(scope="module")
def qwen_server():
    for path in (QWEN, QWEN_DRAFT):
        if not path.is_file():
            pytest.fail(f"{path} is missing: `make test-qwen` fetches it (benchmarks/fetch_qwen_coder.py [--draft])")
    with running_server(SPECULATIVE, model=str(QWEN), max_num_seqs=4) as server:
        yield server


def _weather(name: str, arguments: dict) -> str:
    assert name == "get_weather"
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    return f"{arguments['city']}: {TEMPERATURES.get(arguments['city'], 10)} C, clear"


def test_an_auto_agent_loop_calls_six_times_answers_and_is_the_same_with_every_method(qwen_server):
    transcripts = {}
    for method in METHODS:
        with speculative_method(qwen_server, method, **METHODS[method], **EVERY_DRAFT):
            transcript, accepted = run_agent_loop(
                qwen_server.openai(), [{"role": "user", "content": TASK}], ["auto"] * 9, _weather, model=MODEL_NAME,
                tools=[WEATHER_TOOL], max_tokens=100, temperature=0, parallel_tool_calls=False)
        cities = [arguments["city"] for _, calls, _ in transcript for _, arguments in calls]
        assert cities == list(TEMPERATURES), (method, transcript)
        content, calls, finish_reason = transcript[-1]
        assert not calls and finish_reason == "stop" and "Cairo" in content, (method, transcript[-1])
        if method != "naive":
            assert accepted > 0, f"{method}: no draft accepted in the loop"
        transcripts[method] = transcript
    for method in list(METHODS)[1:]:
        assert transcripts[method] == transcripts["naive"], method


def test_required_and_named_tool_choice_write_calls_in_qwens_format(qwen_server):
    client = qwen_server.openai()
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        choice = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Is it raining in Lima?"}], tools=[WEATHER_TOOL],
            tool_choice=tool_choice, max_tokens=40, temperature=0).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Lima"}
