"""Prompts for demos and benchmarks: input-grounded code edits built from the Python standard
library, and plain chat.

A code-edit prompt asks the model to return a function with type hints added: most of the
answer copies the input, which is exactly where lookup-based speculation shines. A chat prompt
(explain a concept, write a short story) gives lookup little to find: model-based methods are
measured there too.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

CODE_EDIT_INSTRUCTION = "Add type hints to this function and return the full code."

# Modules whose source ships with every CPython; functions are picked deterministically.
_SOURCE_MODULES = ("textwrap", "shlex", "fnmatch", "glob", "posixpath", "colorsys", "calendar",
                   "bisect", "heapq", "base64", "string", "html", "statistics", "difflib")


def stdlib_functions(min_lines: int = 8, max_lines: int = 30, modules=_SOURCE_MODULES) -> list[str]:
    """Top-level function sources of ``modules`` (default: the benchmark's, above) with
    ``min_lines..max_lines`` lines."""
    import importlib

    functions = []
    for name in modules:
        try:
            source = inspect.getsource(importlib.import_module(name))
        except (ImportError, OSError, TypeError):
            continue
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                code = ast.get_source_segment(source, node)
                if code and min_lines <= code.count("\n") + 1 <= max_lines:
                    functions.append(textwrap.dedent(code))
    return functions


def code_edit_prompts(count: int, min_lines: int = 8, max_lines: int = 30) -> list[str]:
    """``count`` code-edit prompts (user messages), spread over the candidate functions."""
    functions = stdlib_functions(min_lines, max_lines)
    if not functions:
        raise RuntimeError("no standard-library source found to build prompts from")
    stride = max(1, len(functions) // count)
    chosen = [functions[(i * stride) % len(functions)] for i in range(count)]
    return [f"{CODE_EDIT_INSTRUCTION}\n\n```python\n{code}\n```" for code in chosen]


#: Plain chat prompts (none of them in the shipped MTP head's training prompts).
CHAT_PROMPTS = (
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a lighthouse keeper and a seagull.",
    "Explain what a prime number is, with examples.",
    "Write a short story about a boy who finds a map in his attic.",
    "Explain the difference between a comet and an asteroid.",
    "Write a short poem about the sea at night.",
    "Explain why the sky is blue.",
    "Write a short story about a baker who opens a shop on the moon.",
    "Explain how vaccines train the immune system.",
    "Describe a perfect day in a small mountain village.",
    "Explain what an operating system does.",
    "Write a short story about a clock that runs backwards.",
)


def chat_prompts(count: int) -> list[str]:
    """``count`` plain chat prompts (user messages), cycling through :data:`CHAT_PROMPTS`."""
    return [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(count)]


#: The system prompt of the Predicted Outputs workload: the answer is the whole edited code,
#: so most of it is the original, which the client passes as ``prediction``.
EDIT_SYSTEM_PROMPT = "You are a code editor. Reply with the complete edited code in one ```python block and nothing else."
#: Small edits, as an agent asks for them (``{name}``: the function's name).
EDIT_INSTRUCTIONS = (
    "Rename the function `{name}` to `{name}_v2`.",
    "Add a one-line comment at the top of the function.",
    "Add a docstring to the function `{name}`.",
    "Rename the first parameter of `{name}` to `value`.",
)
#: Modules of the edit tasks: none of them is among the code-edit prompts' modules (held out).
_EDIT_MODULES = ("shutil", "pprint", "gettext", "mimetypes", "quopri", "netrc", "ipaddress", "locale", "csv",
                 "tokenize", "imaplib", "ftplib")


def code_edit_tasks(count: int, min_lines: int = 8, max_lines: int = 30) -> list[tuple[list[dict], str]]:
    """``count`` code edits with their predictions: ``(messages, prediction)``, the chat that
    asks for a small edit of a standard-library function (held out from
    :func:`code_edit_prompts`), and the original code in the ```python block the answer
    re-emits, as a client passes it (OpenAI's Predicted Outputs)."""
    import re

    functions = stdlib_functions(min_lines, max_lines, _EDIT_MODULES)
    if not functions:
        raise RuntimeError("no standard-library source found to build edit tasks from")
    stride = max(1, len(functions) // count)
    tasks = []
    for i in range(count):
        code = functions[(i * stride) % len(functions)]
        name = re.match(r"def (\w+)", code).group(1)
        instruction = EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)].format(name=name)
        block = f"```python\n{code}\n```"
        messages = [{"role": "system", "content": EDIT_SYSTEM_PROMPT},
                    {"role": "user", "content": f"{instruction}\n\n{block}"}]
        tasks.append((messages, block))
    return tasks
