"""``specdec chat`` without a model: its stats line, and bad flags as one line and exit 2."""

from __future__ import annotations

import pytest

from specdec.chat import Reply
from specdec.chat_cli import stats_line
from specdec.cli import main


def test_stats_line_shows_speed_and_acceptance_or_na():
    known = Reply(text="hi", completion_tokens=10, ttft_s=0.5, elapsed_s=2.0, mean_acceptance_length=2.5,
                  accepted_per_position=[0.75, 0.5])
    assert stats_line(known, "ngram") == ("[10 tokens, 5.0 tokens/s, first token 0.50 s, acceptance length 2.50, "
                                          "accepted per position 0.75 0.50; method ngram]")
    unknown = Reply(text="hi", completion_tokens=4, ttft_s=0.1, elapsed_s=1.0)
    assert "acceptance length n/a, accepted per position n/a" in stats_line(unknown, "llama")


@pytest.mark.parametrize("flags, message", [
    (["--max-tokens", "0"], "--max-tokens: must be >= 1"),
    (["--temperature", "-1"], "--temperature:"),
    (["--base-url", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9/v1/models"),
])
def test_bad_chat_flags_are_one_line_and_exit_2(capsys, flags, message):
    assert main(["chat", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
