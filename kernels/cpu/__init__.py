"""CPU kernels for small-batch decoding, compiled on first use as paddle custom operators.

``load_cpu_ops()`` builds the ``.cc`` sources here (float kernels in ``specdec_cpu_ops.cc``,
weight-only quantized ones in ``specdec_quant_ops.cc``) with the system C++ compiler through
``paddle.utils.cpp_extension`` (cached across runs) and returns the module, or raises
:class:`KernelUnavailable` with the reason (no AVX2/FMA/F16C, no compiler, not on CPU).
Each operator has a numpy twin in :mod:`specdec.kernels.cpu.reference`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import tempfile
from pathlib import Path

KERNEL_DIR = Path(__file__).parent
SOURCES = (KERNEL_DIR / "specdec_cpu_ops.cc", KERNEL_DIR / "specdec_quant_ops.cc")
#: Everything the build reads: the sources and the files they include.
BUILD_INPUTS = SOURCES + tuple(sorted(KERNEL_DIR.glob("*.h"))) + tuple(sorted(KERNEL_DIR.glob("*.inc")))
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
# fp-contract=off: the compiler never fuses a * b + c on its own, so that every kernel computing
# a Q4_K/Q6_K row does the same float operations, bit for bit (quant_matmul.inc); the kernels'
# explicit fma intrinsics are unaffected. -g0 undoes the -g that setuptools puts first: no
# debug info, a third less compile time (specdec_quant_ops.cc: 55 -> 36 s of CPU on Zen 2) at
# every user's first run; backtraces still name the functions.
CXX_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-pthread", "-g0")


class KernelUnavailable(RuntimeError):
    """The CPU kernels cannot be used here; the message says why."""


def release_free_heap() -> None:
    """Give the heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere a
    no-op). Once loaded, the quantized kernels keep up to 256 MiB of freed heap for the next
    prompt's temporaries (``specdec_quant_ops.cc``); the engine calls this after loading a
    model, so that the loader's freed temporaries do not stay resident with them."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.lru_cache(maxsize=None)
def has_avx512_vnni() -> bool:
    """Whether this CPU has what the quantized kernels' AVX-512 VNNI path needs (they choose
    it at run time; ``SPECDEC_CPU_ISA=avx2`` still forces the portable path)."""
    return {"avx512_vnni", "avx512bw", "avx512vl"} <= _cpu_flags()


#: The environment variable the kernels read, once, for where they prefetch weights.
PREFETCH_ENV = "SPECDEC_PREFETCH"


def cpuinfo_fields(cpuinfo: str) -> dict[str, str]:
    """The first processor's fields in ``cpuinfo`` (the text of ``/proc/cpuinfo``): ``{"vendor_id":
    ..., "cpu family": ..., "model": ..., "model name": ..., "flags": ...}``."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block is enough
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def prefetch_hint_for(cpuinfo: str) -> str:
    """Where the quantized kernels prefetch the weights they stream, on the CPU that
    ``cpuinfo`` (the text of ``/proc/cpuinfo``) describes: ``"nta"`` (non-temporal) on AMD's
    Zen 5 (family 0x1A, 26), ``"l2"`` everywhere else.

    Non-temporal prefetches keep streamed weights out of the last-level cache, which then keeps
    what the next step reads again (the KV cache, a draft head's weights): that paid on a Zen 5
    (1.00-1.04x). Elsewhere they cost far more than that. On a Zen 4 they came too late for the
    interleaved Q4_K and Q6_K kernels, which read a super-block's bytes out of order (into L2,
    Qwen2.5-Coder-1.5B's 6-row pass ran 1.35x faster). On a 4th-generation Intel Xeon (2026-12-07)
    the default model's 1-row pass took 10.5 ms with them and 3.85-3.99 ms into L2, Qwen2.5-Coder's
    77 against 51 ms, on every ISA path (docs/benchmarks/llamacpp.md). On a Zen 3 (2026-12-07,
    AVX2) the default model's passes were alike either way, within the VM's noise, and
    Qwen2.5-Coder's 1.18x (1 row) and 1.25x (6 rows) faster into L2. Zen 2 is not measured:
    ``"l2"`` is the nearest to what the kernels did before 2026-12-06 (the T0 hint, into L1),
    when its AVX2 figures were measured. ``SPECDEC_PREFETCH`` set by hand wins
    (:func:`load_cpu_ops`)."""
    fields = cpuinfo_fields(cpuinfo)
    zen_5 = fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "26"
    return "nta" if zen_5 else "l2"


@functools.lru_cache(maxsize=None)
def prefetch_hint_here() -> str:
    """:func:`prefetch_hint_for` this machine."""
    try:
        with open("/proc/cpuinfo") as f:
            return prefetch_hint_for(f.read())
    except OSError:
        return "l2"


def kernel_path() -> str:
    """The quantized kernels' path in this process, as a benchmark reports it beside the CPU:
    the instruction set (``SPECDEC_CPU_ISA`` where it forces one, else the CPU's best), whether
    AMX tiles take prompt rows of Q4_K/Q6_K matrices (where the CPU has them: the kernels also
    ask the OS for them, at run time), and where the weights are prefetched. The same model's figures differ by these: on one
    Intel Xeon a 1-row pass took 10.5 ms with non-temporal prefetches and 4.0 into L2."""
    if not set(REQUIRED_CPU_FLAGS) <= _cpu_flags():
        return "none (they need " + ", ".join(f.upper() for f in REQUIRED_CPU_FLAGS) + ")"
    forced = os.environ.get("SPECDEC_CPU_ISA")
    if forced == "avx2" or not has_avx512_vnni():
        isa = "AVX2"
    elif forced != "avx512" and {"amx_tile", "amx_int8"} <= _cpu_flags():
        isa = "AVX-512 VNNI, AMX tiles"
    else:
        isa = "AVX-512 VNNI"
    prefetch = os.environ.get(PREFETCH_ENV) or prefetch_hint_here()
    return f"{isa}, weights prefetched {'non-temporally' if prefetch == 'nta' else 'into L2'}"


def kernel_build_dir(*sources: Path) -> Path:
    """Where native code made of ``sources`` (default: the engine's kernels) is built: one
    folder per version of those files (a hash of them all, and of where they are) under
    ``$SPECDEC_KERNEL_CACHE``, else ~/.cache/specdec/kernels. Two checkouts never share a build:
    paddle's build records the source paths, and would rebuild in turn for each."""
    inputs = sources or BUILD_INPUTS
    root = Path(os.environ.get("SPECDEC_KERNEL_CACHE", Path.home() / ".cache" / "specdec" / "kernels"))
    digest = hashlib.sha256(" ".join(CXX_FLAGS).encode())
    for path in inputs:
        digest.update(str(path.resolve()).encode() + b"\0" + path.read_bytes())
    return root / digest.hexdigest()[:16]


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Hold an exclusive lock on ``build_dir`` (``fcntl.flock``; released if the process dies):
    processes starting at once on an empty cache build one after the other, and none loads a
    half-written library."""
    import fcntl

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def _stderr_to(file):
    """Point file descriptor 2 at ``file`` for the block. paddle builds in a subprocess that
    inherits it, and with setuptools >= 70 that subprocess logs every compiler command there:
    a user's first run would print a page of g++ lines. The caller reads ``file`` on failure."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        os.dup2(file.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


OPS_NAME = "specdec_cpu_ops"
#: Written into a build folder once paddle has built and loaded the library there.
BUILT_MARKER = ".built"


def _load_built(build_dir: Path):
    """The library already built in ``build_dir`` (one folder per version of the sources, see
    :func:`kernel_build_dir`), loaded without asking paddle to rebuild it, or ``None``.

    ``paddle.utils.cpp_extension.load`` runs a setuptools build in a subprocess on every call,
    even when nothing changed: 2-3 s of every process start. Its last step, loading the library
    and registering its operators, is ``_import_module_from_library``, a private function: if a
    paddle release renames it, or the load fails, the caller falls back to ``load``."""
    library = build_dir / OPS_NAME / f"{OPS_NAME}.so"
    if not (build_dir / BUILT_MARKER).is_file() or not library.is_file():
        return None
    try:
        from paddle.utils.cpp_extension.extension_utils import _import_module_from_library

        return _import_module_from_library(OPS_NAME, str(library.parent), False)
    except Exception:  # noqa: BLE001 - any failure: let paddle's own load build and load it
        return None


@functools.lru_cache(maxsize=1)
def cpu_ops_c_library():
    """The loaded CPU operators' library through ctypes, for its plain C functions (waiting for
    work it runs in the background): a ctypes call of one costs a few microseconds where
    paddle's dispatch of an operator costs tens on the caches a forward pass has just flushed.
    The same library as :func:`load_cpu_ops` (loaded first), so the same state."""
    import ctypes

    load_cpu_ops()
    library = ctypes.CDLL(str(kernel_build_dir() / OPS_NAME / f"{OPS_NAME}.so"))
    pointer, count = ctypes.c_void_p, ctypes.c_int64
    start = library.specdec_draft_head_start
    start.restype = ctypes.c_int
    start.argtypes = [count, pointer, count, count, pointer, pointer, count, pointer, count, count, pointer, pointer,
                      count, ctypes.c_char_p, count]
    finish = library.specdec_draft_head_finish
    finish.restype = ctypes.c_int
    finish.argtypes = [count, ctypes.c_char_p, count]
    return library


@functools.lru_cache(maxsize=1)
def load_cpu_ops():
    """Compile (once per source version) and load the CPU operators."""
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in _cpu_flags()]
    if missing:
        raise KernelUnavailable(f"the CPU lacks {', '.join(missing)}")
    from specdec.errors import require_paddle

    require_paddle()
    import io
    import logging
    import warnings

    # Before the library loads: the kernels read it once, then (kPrefetchNonTemporal, simd_math.h).
    os.environ.setdefault(PREFETCH_ENV, prefetch_hint_here())
    build_dir = kernel_build_dir()
    saved_warnings = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = "ignore"  # the build runs in a subprocess that warns about ccache
    # When paddle finds ccache it compiles through it; the build folder (the compiler's working
    # directory) differs per cache and checkout, so leave it out of ccache's hash: the same
    # sources then build once per machine, not once per folder.
    os.environ.setdefault("CCACHE_NOHASHDIR", "true")
    build_log = tempfile.TemporaryFile("w+", errors="replace")
    try:
        with build_lock(build_dir), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                _stderr_to(build_log):
            warnings.simplefilter("ignore")
            from paddle.utils.cpp_extension import load

            logging.getLogger("utils.cpp_extension").setLevel(logging.WARNING)
            module = _load_built(build_dir)
            if module is not None:
                return module
            module = load(
                name=OPS_NAME,
                sources=[str(path) for path in SOURCES],
                extra_cxx_cflags=list(CXX_FLAGS),
                extra_ldflags=["-pthread"],
                build_directory=str(build_dir),
                verbose=False,
            )
            (build_dir / BUILT_MARKER).write_text(OPS_NAME + "\n")
            return module
    except Exception as exc:  # a compiler error, a missing compiler, ...
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        build_log.seek(0)
        compiler_error = next((line.strip() for line in build_log if "error" in line.lower()), "")
        detail = f" ({compiler_error[:200]})" if compiler_error else ""
        raise KernelUnavailable(f"building the CPU kernels failed: {type(exc).__name__}: {first_line}{detail}") from exc
    finally:
        build_log.close()
        if saved_warnings is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = saved_warnings


def cpu_ops_or_none():
    """The kernels module, or ``None`` when they cannot be used (see :func:`load_cpu_ops`)."""
    try:
        return load_cpu_ops()
    except KernelUnavailable:
        return None
