"""Structured output: grammars that constrain what a request may generate (``response_format``,
tool calls), and the tool-call format (Hermes / Qwen2.5 ``<tool_call>`` JSON) rendered into
prompts and parsed back out of the output.

- :mod:`.grammar`: compiles a JSON schema or a tool-call grammar with ``llguidance``, off the
  engine thread and in bounded time, into a matcher factory.
- :mod:`.processor`: :class:`GrammarProcessor`, the row processor that masks the target's
  logits at every verified position, so that a draft token the grammar forbids is rejected
  like any other mismatch.
- :mod:`.tool_calls`: tool definitions, ``tool_choice``, rendering tool use into the chat
  template, and parsing (whole or streamed) ``<tool_call>`` blocks back into ``tool_calls``.
"""
