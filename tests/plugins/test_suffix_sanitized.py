"""The compiled suffix trees under AddressSanitizer and UndefinedBehaviorSanitizer.

``suffix_trees.cc`` is built with ``-fsanitize=address,undefined`` and the twin tests (random
trees with removals and ties; a random proposer lifecycle with preemptions, tenants and
eviction; the requests' catch-up and free) run against it in a child process with the
sanitizers' runtimes preloaded, stopping at the first error: a read past a sequence, a node
used after it was freed or an overflow fails the test where the drafts alone might still agree.
Leaks are not checked: the interpreter's own would drown them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parents[1] / "plugins" / "suffix" / "suffix_trees.cc"

CHILD = """
import ctypes, sys
import specdec.plugins.suffix.compiled as compiled
compiled.load_shared_library = lambda source, name, flags=(): ctypes.CDLL(sys.argv[1])
compiled.load_suffix_library.cache_clear()
sys.path.insert(0, sys.argv[2])
import test_suffix_proposer, test_suffix_tree
for seed in range(0, 160, 20):
    test_suffix_tree.test_the_compiled_tree_is_the_python_trees_twin(seed)
for scope, cap in (("global", 4), ("tenant", 3), ("global", 0)):
    test_suffix_proposer.test_the_compiled_trees_draft_as_the_python_trees(scope, cap)
test_suffix_proposer.test_the_compiled_requests_catch_up_start_over_and_free()
print("clean")
"""


def _runtime(name: str) -> str:
    found = subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) else ""


def test_the_compiled_trees_are_clean_under_the_sanitizers(tmp_path):
    runtimes = [_runtime("libasan.so"), _runtime("libubsan.so")]
    if not all(runtimes):
        pytest.skip("g++ has no sanitizer runtimes here (libasan, libubsan)")
    library = tmp_path / "libsuffix_sanitized.so"
    subprocess.run(["g++", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                    "-fno-omit-frame-pointer", "-std=c++17", "-shared", "-fPIC", str(SOURCE), "-o", str(library)],
                   check=True, capture_output=True)
    env = {**os.environ, "LD_PRELOAD": " ".join(runtimes), "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
    result = subprocess.run([sys.executable, "-c", CHILD, str(library), str(HERE)], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("clean"), result.stderr[-4000:]
