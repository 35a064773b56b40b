"""``specdec bench`` and ``specdec chat`` in-process, run as the installed command (the console
script next to this Python), each in one subprocess that loads the real model: tiny runs (two
prompts, eight tokens), so both together stay within a few seconds of model loading."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SPECDEC = Path(sys.executable).parent / "specdec"
STATS = re.compile(r"^\[(\d+) tokens, [\d.]+ tokens/s, first token [\d.]+ s, acceptance length (\S+), "
                   r"accepted per position (.*); method (\w+)\]$")


@pytest.fixture(autouse=True)
def _installed():
    if not SPECDEC.exists():
        pytest.skip(f"the specdec command is not installed next to {sys.executable}")


def test_bench_in_process_compares_methods_and_writes_plots(tmp_path):
    result = subprocess.run([str(SPECDEC), "bench", "--methods", "naive,ngram", "--workload", "chat",
                             "--num-prompts", "2", "--max-tokens", "8", "--batch-sizes", "1,2",
                             "--output-dir", str(tmp_path), "--no-progress"],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {tuple(line.split()[:2]): line.split() for line in result.stdout.splitlines()
            if line.split()[:1] in (["naive"], ["ngram"])}
    assert set(rows) == {("naive", "1"), ("ngram", "1"), ("naive", "2"), ("ngram", "2")}, result.stdout
    assert rows[("naive", "1")][8] == "1.00"  # plain decoding: one token per step
    from specdec.kernels.cpu import kernel_path

    # The machine and the kernels' path, which the figures depend on (kernel_path: the same here)
    assert "CPU" in result.stdout.splitlines()[0] and f"kernels {kernel_path()}" in result.stdout.splitlines()[0]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["setup"]["target"] == "in-process" and list(results["setup"]["methods"]) == ["naive", "ngram"]
    assert results["setup"]["kernels"] == kernel_path()
    assert len(results["samples"]) == 2 * (2 + 2)
    batch_of_two = [s for s in results["summaries"] if s["batch_size"] == 2]
    assert [s["requests"] for s in batch_of_two] == [2, 2]
    for name in ("tokens_per_s.png", "acceptance_per_position.png", "batch_scaling.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def _answers_and_stats(stdout: str) -> list[tuple[str, re.Match]]:
    """(answer text, its stats line) for each answer in a piped chat's output."""
    answers, lines = [], []
    for line in stdout.splitlines():
        match = STATS.match(line)
        if match:
            answers.append(("\n".join(lines).strip(), match))
            lines = []
        elif not (line.startswith("(") and line.endswith(")")):  # "(method ngram)", "(conversation reset)"
            lines.append(line)
    return answers


def test_chat_script_switches_method_and_resets():
    """hello; /method ngram; /reset; hello again (after the reset: the same greedy answer, now
    drafted by ngram); a follow-up question (with the history); then end of input."""
    script = "hello\n/method ngram\n/reset\nhello\nAnd what is 2+2?\n"
    result = subprocess.run([str(SPECDEC), "chat", "--max-tokens", "8", "--no-progress"], input=script,
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(method ngram)" in result.stdout and "(conversation reset)" in result.stdout
    answers = _answers_and_stats(result.stdout)
    assert len(answers) == 3, result.stdout
    (first, first_stats), (again, again_stats), (follow_up, follow_stats) = answers
    assert first and follow_up
    assert first_stats.group(4) == "naive" and first_stats.group(2) == "1.00" and first_stats.group(3) == "n/a"
    assert again_stats.group(4) == "ngram" and follow_stats.group(4) == "ngram"
    assert again == first  # greedy decoding is lossless, and /reset forgot the first exchange
    assert all(1 <= int(stats.group(1)) <= 8 for _, stats in answers)
