"""``specdec.sdk.load_shared_library``: a plugin's own C++ file, built once per version and
flags with the system compiler, loaded with ctypes; a one-line KernelUnavailable otherwise."""

from __future__ import annotations

import ctypes

import pytest

from specdec.sdk import KernelUnavailable, load_shared_library

SOURCE = 'extern "C" long long specdec_test_add(long long a, long long b) { return a + b; }\n'


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_KERNEL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _library(path):
    lib = load_shared_library(path, "specdec_test")
    lib.specdec_test_add.restype = ctypes.c_longlong
    lib.specdec_test_add.argtypes = [ctypes.c_longlong, ctypes.c_longlong]
    return lib


def test_builds_once_per_version_and_flags(tmp_path, cache):
    source = tmp_path / "add.cc"
    source.write_text(SOURCE)
    assert _library(source).specdec_test_add(40, 2) == 42
    [built] = cache.rglob("*.so")
    first_build = built.stat().st_mtime_ns
    _library(source)
    assert [built] == list(cache.rglob("*.so")) and built.stat().st_mtime_ns == first_build  # loaded, not rebuilt
    load_shared_library(source, "specdec_test", flags=("-O1",))  # other flags: another build
    source.write_text(SOURCE.replace("a + b", "a * b"))  # another version: another build
    assert _library(source).specdec_test_add(40, 2) == 80
    assert len(list(cache.rglob("*.so"))) == 3


def test_a_compiler_error_is_one_line_naming_the_file(tmp_path, cache):
    source = tmp_path / "broken.cc"
    source.write_text("this is not C++\n")
    with pytest.raises(KernelUnavailable) as info:
        load_shared_library(source, "specdec_broken")
    message = str(info.value)
    assert message.startswith("building broken.cc failed: ") and "\n" not in message, message
    assert not list(cache.rglob("*.so"))  # nothing half-built is left to load


def test_a_missing_compiler_says_so(tmp_path, cache, monkeypatch):
    source = tmp_path / "add.cc"
    source.write_text(SOURCE)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(KernelUnavailable, match="running the C\\+\\+ compiler failed"):
        load_shared_library(source, "specdec_test")
