"""The kernels sit at the bottom of the import graph: they import nothing of specdec above them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
#: What a kernel module may import from specdec.
ALLOWED = ("specdec.errors", "specdec.kernels")


def specdec_imports(source: str, package: list[str]) -> list[str]:
    """The specdec names ``source`` imports (``from m import n`` as ``m.n``), relative imports
    resolved against ``package``."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = base + ([node.module] if node.module else [])
            names += [".".join(module + [alias.name]) for alias in node.names]
    return [name for name in names if name == "specdec" or name.startswith("specdec.")]


def allowed(name: str) -> bool:
    return any(name == root or name.startswith(root + ".") for root in ALLOWED)


@pytest.mark.parametrize("path", sorted(KERNELS.rglob("*.py")), ids=lambda p: str(p.relative_to(KERNELS)))
def test_kernels_import_only_errors_and_kernels(path):
    package = ["specdec", "kernels", *path.relative_to(KERNELS).parent.parts]
    assert [name for name in specdec_imports(path.read_text(), package) if not allowed(name)] == []


def test_the_check_catches_upward_imports():
    source = "from .layout import x\nfrom ...model.quant import y\nimport specdec.engine\nfrom specdec import errors\n"
    names = specdec_imports(source, ["specdec", "kernels", "cpu"])
    assert names == ["specdec.kernels.cpu.layout.x", "specdec.model.quant.y", "specdec.engine", "specdec.errors"]
    assert [name for name in names if not allowed(name)] == ["specdec.model.quant.y", "specdec.engine"]
    assert not allowed("specdec.kernelsx") and allowed("specdec.errors")
