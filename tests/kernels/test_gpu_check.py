"""``benchmarks/gpu_check.py --dry-run``: the GPU check's own code, on tiny shapes in Triton's
interpreter, so that the script a lent GPU machine runs cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_gpu_check_dry_run_passes_and_prints_its_table():
    env = {**os.environ, "TRITON_INTERPRET": "1", "MKL_DEBUG_CPU_TYPE": "5"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert table[0] == "| check | shape | result | figure |"
    results = {line.split(" | ")[0][2:] for line in table[1:]}
    assert results == {"attention vs twin", "fused verify vs twin", "attention, 6 rows/request",
                       "fused verify (rejection)"}
    assert "FAIL" not in done.stdout
    assert sum("| ok |" in line for line in table) == 5  # 4 attention cases, 1 verify
