"""The hook reference cannot rot: every hookspec is documented under its exact signature, and
the tutorial's code is the example package's code."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from specdec import hookspecs
from specdec.plugin_manager import COMMANDS_HOOK, KINDS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "plugins.md"
EXAMPLE = ROOT / "examples" / "specdec-plugin-lastn"


def all_hookspecs() -> list:
    return [fn for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
            if hasattr(fn, "specdec_spec")]


def test_every_hook_is_one_the_loader_calls():
    assert sorted(fn.__name__ for fn in all_hookspecs()) == sorted([kind.hook for kind in KINDS] + [COMMANDS_HOOK])


@pytest.mark.parametrize("hook", all_hookspecs(), ids=lambda fn: fn.__name__)
def test_hook_is_documented_under_its_exact_signature(hook):
    heading = f"## {hook.__name__}{inspect.signature(hook)}"
    headings = [line.strip() for line in DOC.read_text().splitlines() if line.startswith("#")]
    assert heading in headings, f"docs/plugins.md needs the heading: {heading}"
    assert (hook.__doc__ or "").strip(), f"{hook.__name__} needs a docstring in core/hookspecs.py"


@pytest.mark.parametrize("path", ["pyproject.toml", "specdec_plugin_lastn/__init__.py"])
def test_tutorial_quotes_the_example_package_verbatim(path):
    assert (EXAMPLE / path).read_text() in DOC.read_text(), (
        f"docs/plugins.md must quote examples/specdec-plugin-lastn/{path} verbatim")
