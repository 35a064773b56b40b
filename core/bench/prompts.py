"""The prompts of a benchmark, each one a chat conversation (a list of ``{"role", "content"}``).

A workload is a built-in name (``code-edit``, ``chat``: :mod:`specdec.workloads`), a JSONL file
(one object a line, ``{"prompt": "..."}`` or ``{"messages": [...]}``), or a JSON file: a list of
strings, or ShareGPT's format, ``[{"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}]}]``, of which each conversation's first human turn is the prompt
(as vLLM's and SGLang's benchmarks take it).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SpecdecError
from ..workloads import chat_prompts, code_edit_prompts

BUILT_IN = {"code-edit": code_edit_prompts, "chat": chat_prompts}
_HUMAN = ("human", "user")

Conversation = list[dict]


def user_message(text: str) -> Conversation:
    return [{"role": "user", "content": text}]


def load_workload(workload: str, count: int) -> list[Conversation]:
    """``count`` conversations of ``workload`` (a file's first ``count``, or all it has when
    fewer). A file that cannot be read or parsed is a :class:`SpecdecError` naming the line."""
    if workload in BUILT_IN:
        return [user_message(text) for text in BUILT_IN[workload](count)]
    path = Path(workload)
    if not path.is_file():
        raise SpecdecError(f"--workload: {workload!r} is neither a built-in ({', '.join(BUILT_IN)}) nor a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecdecError(f"--workload: cannot read {path}: {exc}") from None
    conversations = _parse_json(text, path) if text.lstrip().startswith("[") else _parse_jsonl(text, path)
    if not conversations:
        raise SpecdecError(f"--workload: {path} holds no prompt")
    return conversations[:count]


def _parse_json(text: str, path: Path) -> list[Conversation]:
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecdecError(f"--workload: {path}: invalid JSON at line {exc.lineno}, column {exc.colno}: "
                           f"{exc.msg}") from None
    conversations = []
    for number, record in enumerate(records, 1):
        if isinstance(record, str):
            conversations.append(user_message(record))
        elif isinstance(record, dict) and isinstance(record.get("conversations"), list):
            first = next((turn for turn in record["conversations"]
                          if isinstance(turn, dict) and turn.get("from") in _HUMAN), None)
            if first is not None and isinstance(first.get("value"), str) and first["value"].strip():
                conversations.append(user_message(first["value"]))  # ShareGPT: skip those without one
        else:
            raise SpecdecError(f"--workload: {path}: item {number}: expected a string or a ShareGPT record "
                               '({"conversations": [{"from": "human", "value": ...}, ...]})')
    return conversations


def _parse_jsonl(text: str, path: Path) -> list[Conversation]:
    conversations = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecdecError(f"--workload: {path}: line {number}: invalid JSON at column {exc.colno}: "
                               f"{exc.msg}") from None
        if isinstance(record, dict) and isinstance(record.get("prompt"), str):
            conversations.append(user_message(record["prompt"]))
        elif isinstance(record, dict) and _is_conversation(record.get("messages")):
            conversations.append(record["messages"])
        else:
            raise SpecdecError(f'--workload: {path}: line {number}: expected {{"prompt": "..."}} or '
                               '{"messages": [{"role": ..., "content": ...}, ...]}')
    return conversations


def _is_conversation(messages) -> bool:
    return (isinstance(messages, list) and bool(messages)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages))
