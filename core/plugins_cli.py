"""``specdec plugins``: list every loaded plugin, its distribution, version and what it registered.

Problems found while loading (a plugin that failed to import, a duplicate name) are printed to
stderr as ``warning: ...`` lines; the listing itself still succeeds (exit code 0), so the command
stays usable precisely when a plugin is broken.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from .plugin_manager import KINDS, PluginInfo, Plugins, get_plugins


def plugin_as_dict(info: PluginInfo) -> dict:
    """One plugin as the JSON object ``specdec plugins --json`` prints."""
    return {
        "name": info.name,
        "distribution": info.distribution,
        "version": info.version,
        "module": info.module,
        "builtin": info.builtin,
        "registered": {kind.attr: list(info.registered.get(kind.attr, [])) for kind in KINDS},
        "error": info.error,
    }


def _registered_text(info: PluginInfo) -> str:
    parts = [f"{kind.label}: {', '.join(info.registered[kind.attr])}"
             for kind in KINDS if info.registered.get(kind.attr)]
    return "; ".join(parts) or "-"


def format_plugins(plugins: Plugins, as_json: bool) -> str:
    """The listing of ``plugins``: a JSON list of objects, or a table with one line per plugin."""
    if as_json:
        return json.dumps([plugin_as_dict(info) for info in plugins.infos], indent=2)
    header = ("NAME", "DISTRIBUTION", "VERSION", "REGISTERED")
    rows = [header] + [
        (info.name, info.distribution, info.version,
         _registered_text(info) + ("  [error]" if info.error else ""))
        for info in plugins.infos
    ]
    widths = [max(len(row[col]) for row in rows) for col in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1]
        for row in rows
    )


def run_plugins(args: argparse.Namespace) -> int:
    """Print the listing to stdout and loading problems to stderr; always exit 0."""
    plugins = get_plugins()
    print(format_plugins(plugins, as_json=getattr(args, "json", False)))
    for error in plugins.errors:
        print(f"warning: {error}", file=sys.stderr)
    return 0


def add_plugins_subcommand(subparsers) -> argparse.ArgumentParser:
    """Add ``plugins [--json]`` to an argparse ``subparsers`` object; ``args.func`` runs it."""
    parser = subparsers.add_parser(
        "plugins",
        help="list installed plugins and what they registered",
        description="List every loaded plugin (built-in and third-party), its distribution, "
                    "version and what it registered. Set SPECDEC_LOAD_PLUGINS to a comma list "
                    "of plugin or distribution names to load only those ('' = built-ins only).",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.set_defaults(func=run_plugins)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m specdec.plugins_cli [--json]``: the subcommand on its own."""
    parser = argparse.ArgumentParser(prog="specdec")
    add_plugins_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plugins", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
