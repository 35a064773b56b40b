"""Chat templates: the Jinja2 templates that Hugging Face models ship, rendered the way
``transformers`` renders them (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``tojson``, ``strftime_now``, the ``loopcontrols`` extension).

A template error of any kind (syntax, ``raise_exception`` from the template, a sandbox violation,
a missing key) becomes a one-line :class:`specdec.SpecdecError`.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

from ..errors import SpecdecError

__all__ = ["ChatTemplate", "pick_chat_template", "end_of_turn_tokens", "END_OF_TURN_TOKENS"]

# Special tokens that end an assistant turn in the chat formats we know of. A tokenizer adds the
# ones that are special tokens of its vocabulary *and* appear in its chat template to its stop set
# (llama.cpp keeps a similar list for its "end of generation" tokens).
END_OF_TURN_TOKENS = (
    "<|im_end|>",          # ChatML: SmolLM2, Qwen, ...
    "<|eot_id|>",          # Llama 3
    "<|eom_id|>",          # Llama 3.1 tool calls
    "<|end|>",             # Phi-3
    "<end_of_turn>",       # Gemma
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|end_of_turn|>",
    "<EOT>",
    "<｜end▁of▁sentence｜>",  # DeepSeek
    "<|return|>",
)


def end_of_turn_tokens(source: str) -> list[str]:
    """The known end-of-turn token strings that a chat template's source writes."""
    return [t for t in END_OF_TURN_TOKENS if t in source]


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class _TemplateRaised(Exception):
    """Raised by ``raise_exception`` inside a template."""


def _raise_exception(message):
    raise _TemplateRaised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: unlike jinja2's built-in it does not HTML-escape, and keeps unicode.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def pick_chat_template(value: Any) -> str | None:
    """Normalize the ``chat_template`` entry of a ``tokenizer_config.json``.

    It is either a string or a list of ``{"name": ..., "template": ...}``; from a list the one named
    ``default`` is taken (else the first). Anything empty gives ``None``.
    """
    if value is None:
        return None
    if isinstance(value, str):
        return value or None
    if isinstance(value, Mapping):
        if "template" in value:
            return pick_chat_template(value["template"])
        value = [{"name": k, "template": v} for k, v in value.items()]
    if isinstance(value, Sequence):
        named = {str(t.get("name")): t.get("template") for t in value if isinstance(t, Mapping)}
        if "default" in named:
            return named["default"] or None
        for template in named.values():
            if template:
                return template
        return None
    raise SpecdecError(f"chat_template must be a string or a list of {{name, template}}, got {type(value).__name__}")


class ChatTemplate:
    """A compiled chat template.

    ``render(messages, add_generation_prompt=True, **extra)`` returns the prompt text. The special
    token strings given at construction (``bos_token``, ``eos_token``, ...) are template variables,
    as in ``transformers``; ``extra`` (``tools=``, ``documents=``, any template-specific flag) is
    passed through.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None):
        if not isinstance(source, str) or not source:
            raise SpecdecError("chat template is empty")
        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        try:
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as exc:  # pragma: no cover - jinja2 is a dependency
            raise SpecdecError("jinja2 is not installed: pip install jinja2") from exc
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise SpecdecError(f"chat template does not compile: {_one_line(exc.message)} (line {exc.lineno})") from exc

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **extra: Any) -> str:
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
            raise SpecdecError("chat messages must be a list of {'role': ..., 'content': ...} dicts")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message:
                raise SpecdecError(f"chat message {i} must be a dict with a 'role' (and usually 'content')")
        variables = dict(self.special_tokens)
        variables.update(extra)
        variables["messages"] = [dict(m) for m in messages]
        variables["add_generation_prompt"] = bool(add_generation_prompt)
        try:
            return self._template.render(**variables)
        except _TemplateRaised as exc:
            raise SpecdecError(f"chat template rejected the messages: {_one_line(exc)}") from exc
        except SpecdecError:
            raise
        except Exception as exc:  # jinja2 UndefinedError, SecurityError, TypeError in the template, ...
            raise SpecdecError(f"chat template failed: {type(exc).__name__}: {_one_line(exc)}") from exc

    def end_of_turn_tokens(self) -> list[str]:
        """The known end-of-turn token strings that this template writes."""
        return end_of_turn_tokens(self.source)
