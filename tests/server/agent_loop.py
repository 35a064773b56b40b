"""An agent loop through the official ``openai`` client, as the tool tests run it: each turn
the model is asked with the tools, its calls are run and their results go back, until it
answers without a call. Turns alternate between a streamed and a whole response, each
assembled the way a client does.

(A plain module rather than conftest.py, so that test modules can import it by name.)
"""

from __future__ import annotations

import json
from typing import Callable, Sequence


def accepted_drafts(usage) -> int:
    """The drafts accepted for one response (``usage.speculative``; 0 without it)."""
    return ((usage.model_extra or {}).get("speculative") or {}).get("num_accepted_tokens", 0) if usage else 0


def streamed_message(stream) -> tuple[dict, str, int]:
    """The assistant message a stream of chunks makes, assembled as a client does, its finish
    reason and the drafts accepted. Checks the deltas' shape: the first delta of each call has
    its id, type and name, the later ones only arguments."""
    content, calls, finish_reason, accepted = "", {}, None, 0
    for chunk in stream:
        accepted += accepted_drafts(chunk.usage)
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            if delta.index not in calls:
                assert delta.id and delta.type == "function" and delta.function.name, delta
                calls[delta.index] = {"id": delta.id, "type": "function",
                                      "function": {"name": delta.function.name, "arguments": ""}}
            else:
                assert delta.id is None and delta.function.name is None, delta
            calls[delta.index]["function"]["arguments"] += delta.function.arguments or ""
        finish_reason = choice.finish_reason or finish_reason
    message = {"role": "assistant", "content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}
    return message, finish_reason, accepted


def assistant_turn(client, stream: bool, **options) -> tuple[dict, str, int]:
    """One chat completion, streamed or whole: the assistant message (``tool_calls`` a list,
    empty without calls), its finish reason and the drafts accepted."""
    if stream:
        return streamed_message(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                               **options))
    response = client.chat.completions.create(**options)
    choice = response.choices[0]
    message = choice.message.model_dump(include={"role", "content", "tool_calls"})
    message["tool_calls"] = [{k: c[k] for k in ("id", "type", "function")} for c in message["tool_calls"] or ()]
    return message, choice.finish_reason, accepted_drafts(response.usage)


def run_agent_loop(client, messages: list, tool_choices: Sequence, run_tool: Callable[[str, dict], str],
                   **options) -> tuple[list, int]:
    """Turns with ``tool_choices[i]`` as turn ``i``'s ``tool_choice`` (odd turns streamed),
    until one answers without a call or the choices run out. Every call's id must be a
    ``call_`` id and its arguments JSON; ``run_tool(name, arguments)`` gives its result.
    ``options`` go to every request (model, tools, max_tokens, ...). Returns the transcript,
    ``(content, [(name, arguments), ...], finish_reason)`` per turn, and the drafts accepted."""
    messages = list(messages)
    transcript, accepted = [], 0
    for turn, tool_choice in enumerate(tool_choices):
        message, finish_reason, drafts = assistant_turn(client, turn % 2 == 1, messages=messages,
                                                        tool_choice=tool_choice, **options)
        accepted += drafts
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
        transcript.append((message["content"], calls, finish_reason))
        if not calls:
            break
        assert finish_reason == "tool_calls", (turn, message, finish_reason)
        assert all(c["id"].startswith("call_") for c in message["tool_calls"]), message
        messages.append(message)
        for call, (name, arguments) in zip(message["tool_calls"], calls):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": run_tool(name, arguments)})
    return transcript, accepted
