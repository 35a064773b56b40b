"""User-facing error plumbing: did-you-mean, and the one-line error when paddle is missing."""

from __future__ import annotations

import subprocess
import sys

from specdec.errors import did_you_mean


def test_did_you_mean_picks_the_close_name():
    assert did_you_mean("ngarm", ["naive", "ngram"]) == " (did you mean 'ngram'?)"
    assert did_you_mean("zzzz", ["naive", "ngram"]) == ""


def test_missing_paddle_is_one_line_naming_the_extra():
    # sys.modules["paddle"] = None makes `import paddle` raise ImportError, as when it is absent.
    code = (
        "import sys; sys.modules['paddle'] = None\n"
        "from specdec.cli import main\n"
        "sys.exit(main(['generate', '--prompt', 'hi', '--max-tokens', '2', '--no-progress']))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: paddle is not installed: pip install 'paddle-specdec[cpu]'"), lines[0]


def test_paddle_missing_a_module_it_imports_names_that_module():
    """paddle installed but failing to import (setuptools missing, as in a venv made by uv or
    Python >= 3.12 before specdec declared it) is not "paddle is not installed"."""
    code = (
        "import sys; sys.modules['setuptools'] = None\n"
        "from specdec.errors import SpecdecError, require_paddle\n"
        "try:\n    require_paddle()\nexcept SpecdecError as exc:\n    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("paddle failed to import: ") and "setuptools" in result.stdout, result.stdout
