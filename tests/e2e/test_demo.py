"""``specdec demo`` (the main job of ``make run``): every built-in method in one table, each
with naive's tokens."""

from __future__ import annotations

import re

import pytest

from specdec.cli import main

pytestmark = pytest.mark.slow


def test_demo_shows_every_builtin_method(capsys):
    assert main(["demo", "--max-tokens", "24", "--no-progress"]) == 0
    out = capsys.readouterr().out
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^(naive|ngram|suffix|mtp|hybrid)\s+24\s.*\s(yes|NO)$", out, re.M)}
    assert rows == {"naive": "yes", "ngram": "yes", "suffix": "yes", "mtp": "yes", "hybrid": "yes"}, out


def test_demo_with_one_method_compares_it_with_naive(capsys):
    assert main(["demo", "--max-tokens", "16", "--no-progress", "--speculative-config", '{"method": "suffix"}']) == 0
    out = capsys.readouterr().out
    assert re.search(r"^suffix\s+16\s", out, re.M) and re.search(r"^naive\s+16\s", out, re.M)
    assert not re.search(r"^(ngram|mtp|hybrid)\s", out, re.M)
