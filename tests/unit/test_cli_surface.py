"""The command line a new user meets: ``--version``, defaults in every flag's help, the model
as a positional argument, GGUF files recognised by their bytes, and the one line that says the
CPU kernels could not be built (no ``--debug`` needed)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from importlib import metadata

import pytest

import specdec
from specdec.cli import HelpFormatter, build_parser, main
from specdec.model.resolve import known_model_name, resolve_model_path


def _subparsers(parser: argparse.ArgumentParser, prefix: str = "specdec"):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, f"{prefix} {name}")


def test_version_names_the_distribution_and_matches_its_metadata(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and out.startswith(f"specdec {specdec.__version__} (paddle-specdec;")
    assert metadata.version("paddle-specdec") == specdec.__version__


def test_every_flag_says_its_default():
    formatter = HelpFormatter("specdec")
    missing = []
    for command, parser in _subparsers(build_parser()):
        for action in parser._actions:
            if not action.option_strings or action.default is argparse.SUPPRESS:
                continue  # positionals, --help, --version
            text = formatter._get_help_string(action) or ""
            if "default" not in text or not (action.help or "").strip():
                missing.append(f"{command} {action.option_strings[0]}")
    assert not missing, f"flags without help or a default: {missing}"


def test_serve_help_groups_its_flags():
    """Every flag of ``specdec serve`` (the engine's and the server's own) sits in a titled group,
    none in argparse's catch-all "options" group but --help, and --help shows each title."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    ungrouped = [action.option_strings[0] for action in serve._optionals._group_actions
                 if action.option_strings and action.default is not argparse.SUPPRESS]
    assert not ungrouped, f"serve flags outside a titled group: {ungrouped}"
    titled = {group.title: [(action.option_strings or [action.dest])[0] for action in group._group_actions]
              for group in serve._action_groups if group not in (serve._optionals, serve._positionals)}
    help_text = serve.format_help()
    for title in ("model", "speculation (docs/methods.md)", "batching and KV cache (docs/batching.md)",
                  "diagnostics", "server (docs/server.md)", "security (docs/deployment.md#security)",
                  "limits and timeouts (docs/server.md#server-limits)",
                  "sampling defaults (docs/server.md#sampling-defaults)",
                  "logging and metrics (docs/server.md#metrics)", "cluster (docs/deployment.md)"):
        assert titled.get(title), f"no flags in the group {title!r}: {sorted(titled)}"
        assert f"\n{title}:\n" in help_text
    assert "--api-key" in titled["security (docs/deployment.md#security)"]
    assert "--read-timeout" in titled["limits and timeouts (docs/server.md#server-limits)"]


def test_a_model_named_twice_differently_is_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "a.gguf", "--model", "b.gguf", "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and "named twice" in err[0]


def test_gguf_is_recognised_by_its_bytes_and_the_known_name_by_path(tmp_path):
    real = resolve_model_path("smollm2-135m-instruct")
    renamed = tmp_path / "weights.bin"
    renamed.symlink_to(real)
    assert resolve_model_path(str(renamed)) == renamed
    assert known_model_name(str(renamed)) == "smollm2-135m-instruct"
    assert known_model_name(str(real)) == "smollm2-135m-instruct"
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(specdec.SpecdecError, match="not a GGUF file"):
        resolve_model_path(str(not_gguf))
    assert known_model_name(str(not_gguf)) == str(not_gguf)


def test_kernels_that_cannot_build_are_said_in_one_line(tmp_path):
    """No compiler on PATH and an empty kernel cache: ``kernels: auto`` falls back to paddle and
    says so on stderr, in one line, without --debug."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable), SPECDEC_KERNEL_CACHE=str(tmp_path / "cache"),
               CC="", CXX="")
    code = ("from specdec.config import EngineConfig; from specdec.engine.build import resolve_kernels; "
            "print(resolve_kernels(EngineConfig())[0])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "paddle"
    lines = [line for line in result.stderr.splitlines() if line.startswith("warning: CPU kernels unavailable")]
    assert len(lines) == 1 and "install a C++ compiler" in lines[0], result.stderr[-2000:]
