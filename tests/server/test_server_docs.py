"""docs/server.md documents every metric the server exports and every flag of ``specdec serve``."""

from __future__ import annotations

from pathlib import Path

from specdec.cli import build_parser
from specdec.server.metrics import ServerMetrics

DOCS = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()


def test_every_metric_is_documented():
    names = set()
    for family in ServerMetrics("m").registry.collect():
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    missing = sorted(name for name in names if f"`{name}" not in DOCS)
    assert not missing, f"not in docs/server.md: {missing}"


def test_every_serve_flag_is_documented():
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    flags = {option for action in serve._actions for option in action.option_strings if option.startswith("--")}
    missing = sorted(flag for flag in flags - {"--help"} if f"`{flag}" not in DOCS)
    assert not missing, f"not in docs/server.md: {missing}"
