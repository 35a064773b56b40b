"""A plugin's own C++ source, built into a shared library once per version and loaded with ctypes.

For native code with a plain C ABI and no paddle types (the ngram index, the suffix trees):
the system compiler (``$CXX``, else ``c++`` or ``g++``) builds ``source`` into
:func:`specdec.kernels.cpu.kernel_build_dir`, one folder per version of the file, so a user's
first run pays the build and later runs only load it. Where it cannot be built or loaded,
:class:`KernelUnavailable` says why in one line, and the plugin falls back to its Python twin.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from . import KernelUnavailable, kernel_build_dir

#: The flags every build gets: the code is position-independent and plain C++17.
BASE_FLAGS = ("-std=c++17", "-shared", "-fPIC")


def load_shared_library(source: Path, name: str, flags: tuple[str, ...] = ("-O2",)) -> ctypes.CDLL:
    """Build ``source`` into ``lib<name>-<flags>.so`` (once per version of the file and flags) and
    load it.

    Concurrent first runs are safe: each builds beside the target and renames, so none loads a
    half-written file. Raises :class:`KernelUnavailable` without a compiler, on a compiler
    error (its first line) or when the library does not load."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise KernelUnavailable("no C++ compiler found (set CXX)")
    flags_digest = hashlib.sha256(" ".join(flags).encode()).hexdigest()[:8]  # new flags, a new build
    target = kernel_build_dir(Path(source)) / f"lib{name}-{flags_digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            try:
                result = subprocess.run([compiler, *flags, *BASE_FLAGS, str(source), "-o", str(built)],
                                        capture_output=True, text=True)
            except OSError as exc:
                raise KernelUnavailable(f"running the C++ compiler failed: {exc}") from exc
            if result.returncode != 0:
                first = (result.stderr.strip().splitlines() or ["(no output)"])[0]
                raise KernelUnavailable(f"building {Path(source).name} failed: {first}")
            os.replace(built, target)
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        raise KernelUnavailable(f"loading {target.name} failed: {exc}") from exc
