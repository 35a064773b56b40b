"""``specdec plugins``: run as users run it, in a subprocess that sees a fake site."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys

from specdec.plugin_manager import KINDS, load_plugins
from specdec.plugins_cli import add_plugins_subcommand, format_plugins

BROKEN = "import specdec_missing_dependency_xyz\n"
EXITS = "import sys\nsys.exit(3)\n"


def plugins_command(*args: str) -> list[str]:
    """``specdec plugins ARGS`` through the real CLI when it exists, else the subcommand alone."""
    if importlib.util.find_spec("specdec.cli") is not None:
        return [sys.executable, "-m", "specdec.cli", "plugins", *args]
    return [sys.executable, "-m", "specdec.plugins_cli", *args]


def run_plugins(site, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(plugins_command(*args), env=site.env(**env), capture_output=True,
                          text=True, timeout=120, check=False)


def install_good_and_broken(site):
    site.install_proposer("specdec-plugin-good", "good", "sdt_cli_good", name="cligood", version="1.2.3")
    site.install("specdec-plugin-broken", "0.1.0", {"broken": "sdt_cli_broken"}, {"sdt_cli_broken": BROKEN})


def test_json_listing_shape_and_warnings(site):
    install_good_and_broken(site)
    # sys.exit(3) at import used to end `specdec plugins` (and `serve`) with code 3 and no word.
    site.install("specdec-plugin-exit", "0.1.0", {"exiter": "sdt_cli_exiter"}, {"sdt_cli_exiter": EXITS})
    result = run_plugins(site, "--json", SPECDEC_LOAD_PLUGINS=None)

    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    assert isinstance(listing, list) and listing
    for entry in listing:
        assert set(entry) == {"name", "distribution", "version", "module", "builtin", "registered", "error"}
        assert set(entry["registered"]) == {kind.attr for kind in KINDS}
    by_name = {entry["name"]: entry for entry in listing}
    assert by_name["good"] == {
        "name": "good", "distribution": "specdec-plugin-good", "version": "1.2.3",
        "module": "sdt_cli_good", "builtin": False,
        "registered": {"proposers": ["cligood"], "verify_strategies": [], "accept_policies": [],
                       "attention_backends": []},
        "error": None,
    }
    assert by_name["broken"]["error"].startswith(
        "plugin 'broken' (specdec-plugin-broken 0.1.0) failed to load: ModuleNotFoundError")
    assert by_name["ngram"]["builtin"] is True and by_name["ngram"]["distribution"] == "paddle-specdec"
    assert ("warning: plugin 'broken' (specdec-plugin-broken 0.1.0) failed to load: "
            "ModuleNotFoundError: No module named 'specdec_missing_dependency_xyz'") in result.stderr.splitlines()
    assert by_name["exiter"]["error"] == "plugin 'exiter' (specdec-plugin-exit 0.1.0) failed to load: SystemExit: 3"
    assert "warning: " + by_name["exiter"]["error"] in result.stderr.splitlines()


def test_text_listing_one_line_per_plugin(site):
    install_good_and_broken(site)
    result = run_plugins(site, SPECDEC_LOAD_PLUGINS=None)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAME", "DISTRIBUTION", "VERSION", "REGISTERED"]
    [good] = [line for line in lines if line.startswith("good ")]
    assert good.split() == ["good", "specdec-plugin-good", "1.2.3", "proposer:", "cligood"]
    assert any(line.startswith("broken ") and line.endswith("[error]") for line in lines)


def test_empty_load_list_lists_builtins_only(site):
    install_good_and_broken(site)
    result = run_plugins(site, "--json", SPECDEC_LOAD_PLUGINS="")
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    assert listing and all(entry["builtin"] for entry in listing)
    assert "specdec-plugin-broken" not in result.stderr


def test_format_plugins_in_process(site):
    site.install_proposer("specdec-plugin-good", "good", "sdt_cli_fmt", name="fmtgood")
    plugins = load_plugins(load="good")
    table = format_plugins(plugins, as_json=False)
    assert len(table.splitlines()) == len(plugins.infos) + 1
    assert json.loads(format_plugins(plugins, as_json=True))[-1]["registered"]["proposers"] == ["fmtgood"]


def test_add_plugins_subcommand_wires_func():
    parser = argparse.ArgumentParser(prog="specdec")
    add_plugins_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plugins", "--json"])
    assert args.json is True and args.func.__name__ == "run_plugins"


COMMANDS_PLUGIN = '''
import specdec

@specdec.hookimpl
def specdec_register_commands(subcommands):
    hello = subcommands.add_parser("hello", help="say hello")
    hello.add_argument("--name", default="world")
    hello.set_defaults(func=run)

def run(args):
    if args.name == "":
        raise specdec.SpecdecError("--name: must not be empty")
    print(f"hello {args.name}")
    return 0
'''

TAKEN_COMMAND_PLUGIN = '''
import specdec

@specdec.hookimpl
def specdec_register_commands(subcommands):
    subcommands.add_parser("generate")
'''

EXITING_COMMAND_PLUGIN = '''
import sys
import specdec

@specdec.hookimpl
def specdec_register_commands(subcommands):
    sys.exit(3)
'''


def test_a_plugin_adds_a_command_and_a_bad_one_does_not_break_the_cli(site, capsys):
    """Through the real ``specdec`` entry point in this process: a third-party command runs
    and reports bad input as one line with exit 2; a plugin whose hook fails (its command name
    is taken, or it calls sys.exit) becomes a plugin error while the command line works on."""
    from specdec.cli import main
    from specdec.plugin_manager import get_plugins, reset_plugins

    site.install("specdec-plugin-hello", "0.1.0", {"hello": "sdt_cli_hello"}, {"sdt_cli_hello": COMMANDS_PLUGIN})
    site.install("specdec-plugin-taken", "0.1.0", {"taken": "sdt_cli_taken"},
                 {"sdt_cli_taken": TAKEN_COMMAND_PLUGIN})
    site.install("specdec-plugin-exit-cmd", "0.1.0", {"exit_cmd": "sdt_cli_exit_cmd"},
                 {"sdt_cli_exit_cmd": EXITING_COMMAND_PLUGIN})
    reset_plugins()
    try:
        assert main(["hello", "--name", "plugins"]) == 0
        assert capsys.readouterr().out == "hello plugins\n"
        assert main(["hello", "--name", ""]) == 2
        assert capsys.readouterr().err == "error: --name: must not be empty\n"
        errors = get_plugins().errors
        assert [e for e in errors if "taken" in e] == [
            "plugin 'taken' (specdec-plugin-taken 0.1.0) failed in specdec_register_commands: "
            "ArgumentError: argument command: conflicting subparser: generate"], errors
        assert [e for e in errors if "exit_cmd" in e] == [
            "plugin 'exit_cmd' (specdec-plugin-exit-cmd 0.1.0) failed in specdec_register_commands: "
            "SystemExit: 3"], errors
        assert main(["plugins"]) == 0  # the command line works on, and says what went wrong
        assert "conflicting subparser: generate" in capsys.readouterr().err
    finally:
        reset_plugins()
