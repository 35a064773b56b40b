"""The floor plan holds: specdec's modules import each other in layers, from the plugin contract
at the ground floor up to the command line, with no circles; core never imports a plugin; and
importing the SDK or any built-in plugin loads nothing above the contract.

The graph is read from the source (every ``import`` and ``from ... import``, also inside
functions, except under ``if TYPE_CHECKING:``), so a lazy import counts like any other.
docs/architecture.md ("The floor plan") draws the same layers.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Source folder -> import name, as pyproject.toml's package-dir maps them.
SOURCE_ROOTS = {"core": "specdec", "plugins": "specdec.plugins", "kernels": "specdec.kernels"}

#: The floors, bottom first: a module may import modules of its own floor or below. A module
#: belongs to the floor of the longest prefix that names it.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("specdec.errors", "specdec.validators")),
    ("kernels", ("specdec.kernels",)),
    ("contract", ("specdec", "specdec.sdk", "specdec.plugin", "specdec.hookspecs", "specdec.plugin_kinds",
                  "specdec.attention", "specdec.proposer", "specdec.verify", "specdec.probs",
                  "specdec.verify_builders", "specdec.device_verify", "specdec.sampling", "specdec.proposer_context", "specdec.metrics",
                  "specdec.workloads", "specdec.model.quant", "specdec.model.quant_layer", "specdec.model_paths")),
    ("model", ("specdec.model",)),
    ("plugin host", ("specdec.registry", "specdec.plugin_manager", "specdec.config")),
    ("engine", ("specdec.engine", "specdec.structured")),
    ("applications", ("specdec.api", "specdec.tools", "specdec.recording", "specdec.testing",
                      "specdec.testing_attention", "specdec.testing_verify", "specdec.demo", "specdec.server",
                      "specdec.bench", "specdec.chat")),
    ("cluster", ("specdec.cluster",)),
    ("command line", ("specdec.cli", "specdec.plugins_cli", "specdec.bench_cli", "specdec.chat_cli")),
]
#: What a plugin may import of specdec: the contract, and the tools inside its commands.
PLUGIN_SURFACE = ("specdec", "specdec.sdk", "specdec.tools")
#: The only place a lower floor names a higher one, lazily and on purpose: the package face's
#: ``specdec.LLM`` and ``specdec.SpeculativeConfig`` (its module ``__getattr__``). (Deprecated
#: names, until the next release, are looked up by name with ``importlib``, not imported.)
LAZY_FACE = {("specdec", "specdec.api"), ("specdec", "specdec.config")}


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT)
    parts = [SOURCE_ROOTS[relative.parts[0]], *relative.with_suffix("").parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    return {module_name(path): path for folder in SOURCE_ROOTS for path in sorted((ROOT / folder).rglob("*.py"))}


MODULES = source_modules()


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, child.end_lineno + 1))
    return lines


def imports_of(name: str, path: Path) -> set[str]:
    """The specdec modules ``name`` imports (a ``from X import y`` of a submodule ``y`` imports
    ``X.y``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t == "specdec" or t.startswith("specdec."))
    found.discard(name)
    return {t for t in found if t in MODULES}


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def floor_of(name: str) -> int:
    best, floor = -1, None
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), index
    return floor


def is_plugin(name: str) -> bool:
    return name == "specdec.plugins" or name.startswith("specdec.plugins.")


def test_every_core_and_kernel_module_has_a_floor():
    assert [name for name in MODULES if not is_plugin(name) and floor_of(name) is None] == []


def test_no_import_runs_from_a_lower_floor_to_a_higher_one():
    upward = []
    for name, targets in GRAPH.items():
        if is_plugin(name):
            continue
        for target in targets:
            if (name, target) in LAZY_FACE or is_plugin(target):
                continue
            if floor_of(target) > floor_of(name):
                upward.append(f"{name} ({FLOORS[floor_of(name)][0]}) imports {target} "
                              f"({FLOORS[floor_of(target)][0]})")
    assert upward == []


def test_core_never_imports_a_plugin():
    assert [(name, target) for name, targets in GRAPH.items() if not is_plugin(name)
            for target in targets if is_plugin(target)] == []


def test_plugins_import_only_the_contract_and_the_tools():
    assert [(name, target) for name, targets in GRAPH.items() if is_plugin(name)
            for target in targets if not is_plugin(target) and target not in PLUGIN_SURFACE] == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    graph = {name: {t for t in targets if (name, t) not in LAZY_FACE} for name, targets in GRAPH.items()}
    assert _cycles(graph) == []


def test_the_checks_catch_what_they_should():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert floor_of("specdec.engine.build") > floor_of("specdec.sdk") > floor_of("specdec.errors")
    assert floor_of("specdec.cli") > floor_of("specdec.cluster.node") > floor_of("specdec.server.serve")
    assert "specdec.engine.build" in GRAPH["specdec.engine.engine"]  # relative imports resolve
    assert "specdec.engine.admission" in GRAPH["specdec.engine.engine"]  # ``from . import admission``


def test_the_sdk_stands_on_the_ground_floors():
    reachable, todo = set(), ["specdec.sdk"]
    while todo:
        name = todo.pop()
        for target in {t for t in GRAPH[name] if (name, t) not in LAZY_FACE} - reachable:
            reachable.add(target)
            todo.append(target)
    contract = [index for index, (label, _) in enumerate(FLOORS) if label == "contract"][0]
    assert sorted(t for t in reachable if floor_of(t) > contract) == []


#: What importing the SDK or a built-in plugin must not load.
ABOVE_THE_CONTRACT = ("specdec.engine", "specdec.server", "specdec.cluster", "specdec.cli", "specdec.plugins_cli",
                      "specdec.model.gguf_loader", "specdec.model.hf_loader", "specdec.model.resolve",
                      "specdec.model.llama", "specdec.model.tokenizer", "specdec.plugin_manager", "specdec.registry",
                      "specdec.config", "specdec.tools", "specdec.recording", "specdec.api", "paddle")


@pytest.mark.parametrize("module", ["specdec.sdk"] + sorted(name for name in MODULES if is_plugin(name)))
def test_importing_it_loads_nothing_above_the_contract(module):
    """In a fresh interpreter, as a third party's ``import`` would run."""
    code = (f"import sys, json, {module}\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({ABOVE_THE_CONTRACT!r}))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
