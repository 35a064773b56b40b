"""Plugins import only the public SDK: ``specdec``, ``specdec.sdk`` (and ``specdec.tools`` in their commands), never another plugin or
an engine module. Checked on the source of every built-in plugin module and of the example
third-party plugin, and by importing each of them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import specdec
import specdec.sdk

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_ROOTS = [ROOT / "plugins", ROOT / "examples" / "specdec-plugin-lastn" / "specdec_plugin_lastn",
                ROOT / "examples" / "specdec-plugin-medusa" / "specdec_plugin_medusa"]
#: The specdec modules a plugin may import.
PUBLIC_MODULES = {"specdec", "specdec.sdk", "specdec.tools"}


def plugin_files() -> list[Path]:
    return sorted(path for root in PLUGIN_ROOTS for path in root.rglob("*.py"))


def _package_dir(path: Path) -> Path:
    """The plugin package a file belongs to (``plugins/verify``, ``plugins/ngram``, ...)."""
    for root in PLUGIN_ROOTS:
        if root == path.parent or root not in path.parents:
            continue
        return root / path.relative_to(root).parts[0]
    return path.parent


def outside_surface(path: Path) -> list[str]:
    """Every import (or ``specdec.x`` attribute) in ``path`` that leaves the public SDK."""
    tree = ast.parse(path.read_text(), filename=str(path))
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom):
            # A relative import must stay inside the file's own plugin package.
            target = path.parent
            for _ in range(node.level - 1):
                target = target.parent
            if target != _package_dir(path) and _package_dir(path) not in target.parents:
                problems.append(f"line {node.lineno}: relative import leaves the plugin ({'.' * node.level}"
                                f"{node.module or ''})")
            continue
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "specdec"
              and node.attr not in specdec.__all__ and node.attr != "sdk"):
            problems.append(f"line {node.lineno}: specdec.{node.attr} is not public")
            continue
        else:
            continue
        for name in names:
            if name.split(".")[0] == "specdec" and name not in PUBLIC_MODULES:
                problems.append(f"line {node.lineno}: imports {name}")
    return problems


def test_the_plugin_files_are_found():
    names = {path.relative_to(ROOT).as_posix() for path in plugin_files()}
    assert {"plugins/verify/rejection.py", "plugins/accept/accept_all.py", "plugins/ngram/compiled.py",
            "plugins/attention/cpu_backend.py",
            "plugins/mtp/proposer.py", "plugins/hybrid/proposer.py",
            "examples/specdec-plugin-lastn/specdec_plugin_lastn/__init__.py",
            "examples/specdec-plugin-medusa/specdec_plugin_medusa/proposer.py"} <= names


@pytest.mark.parametrize("path", plugin_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_plugins_import_only_the_public_sdk(path):
    assert outside_surface(path) == []


def test_the_check_catches_what_it_should(tmp_path):
    package = tmp_path / "plugins" / "mine"
    package.mkdir(parents=True)
    source = package / "bad.py"
    source.write_text("import specdec\nfrom specdec.probs import sample_tokens\nimport specdec.engine\n"
                      "from specdec.plugins.verify import rejection\nx = specdec.config\n")
    PLUGIN_ROOTS.append(tmp_path / "plugins")
    try:
        assert [p.split(": ")[1] for p in outside_surface(source)] == [
            "imports specdec.probs", "imports specdec.engine", "imports specdec.plugins.verify",
            "specdec.config is not public"]
    finally:
        PLUGIN_ROOTS.pop()


def _module_name(path: Path) -> str:
    relative = path.relative_to(ROOT)
    if relative.parts[0] == "plugins":
        parts = ["specdec", *relative.with_suffix("").parts]
    else:  # an example package: its import name starts at its own folder
        root = next(root for root in PLUGIN_ROOTS[1:] if root in path.parents)
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@pytest.mark.parametrize("path", plugin_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_plugin_module_imports(path):
    importlib.import_module(_module_name(path))


def test_docs_list_every_sdk_name():
    text = (ROOT / "docs" / "plugins.md").read_text()
    section = text[text.index("## The SDK"): text.index("## specdec_register_proposers")]
    assert [name for name in specdec.sdk.__all__ if f"`{name}`" not in section] == []


def test_the_sdk_exports_what_it_lists():
    for name in specdec.sdk.__all__:
        assert getattr(specdec.sdk, name) is not None, name
    for name in specdec.__all__:
        assert hasattr(specdec, name), name


@pytest.mark.parametrize("name", ["load_plugins", "HiddenStateRecorder", "RecordedSequence", "save_recorded",
                                  "load_recorded"])
def test_names_moved_to_tools_still_resolve_from_the_sdk_with_a_warning(name):
    """Plugins written against the SDK before these names moved to specdec.tools keep working
    for one release."""
    import specdec.tools

    with pytest.warns(DeprecationWarning, match=f"specdec.sdk.{name} moved to specdec.tools.{name}"):
        assert getattr(specdec.sdk, name) is getattr(specdec.tools, name)
    with pytest.raises(AttributeError):
        specdec.sdk.not_a_name  # noqa: B018
