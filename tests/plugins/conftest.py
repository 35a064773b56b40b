"""Fixtures that install real (if tiny) distributions into a temporary site directory.

A fake distribution is what pip leaves behind: ``<dist>-<version>.dist-info/`` with ``METADATA``
and ``entry_points.txt``, next to the plugin's module file. Putting the directory on
``sys.path`` (or ``PYTHONPATH`` for a subprocess) makes ``importlib.metadata`` find it, so the
loader runs exactly as it does for a pip-installed plugin.
"""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
from pathlib import Path

import pytest

LASTN_PIP_COMMAND = "pip install -e examples/specdec-plugin-lastn"

#: Source of a plugin module registering one proposer called ``{name}``.
PROPOSER_PLUGIN = '''
import specdec

class {cls}(specdec.Proposer):
    NAME = "{name}"

    def propose(self, batch):
        return specdec.Drafts.empty(len(batch))

@specdec.hookimpl
def specdec_register_proposers(register):
    register({cls})
'''


class FakeSite:
    """A directory of installed distributions, on ``sys.path`` for the duration of a test."""

    def __init__(self, path: Path):
        self.path = path
        self.modules: list[str] = []

    def install(self, dist: str, version: str, entry_points: dict[str, str],
                modules: dict[str, str]) -> None:
        """Install distribution ``dist`` declaring ``entry_points`` (name -> module) in group
        ``specdec`` and shipping ``modules`` (module name -> source)."""
        info = self.path / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = ["[specdec]"] + [f"{name} = {module}" for name, module in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for module, source in modules.items():
            (self.path / f"{module}.py").write_text(textwrap.dedent(source))
            self.modules.append(module)
        importlib.invalidate_caches()

    def install_proposer(self, dist: str, entry_point: str, module: str, name: str,
                         version: str = "0.1.0") -> None:
        """Install a distribution whose one plugin registers a proposer called ``name``."""
        cls = "P_" + module
        self.install(dist, version, {entry_point: module},
                     {module: PROPOSER_PLUGIN.format(cls=cls, name=name)})

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a subprocess that sees this site (``None`` values unset a variable)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.path), env.get("PYTHONPATH")]))
        for key, value in extra.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A :class:`FakeSite` on ``sys.path``; its modules are forgotten afterwards."""
    monkeypatch.delenv("SPECDEC_LOAD_PLUGINS", raising=False)
    fake = FakeSite(tmp_path / "site")
    fake.path.mkdir()
    monkeypatch.syspath_prepend(str(fake.path))
    yield fake
    for module in fake.modules:
        sys.modules.pop(module, None)
