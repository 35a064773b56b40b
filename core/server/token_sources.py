"""``include_token_sources``: which characters of a request's text came from which tokens, and how
each token came (``decode``, ``draft``, ``bonus``: see :data:`specdec.engine.request.TOKEN_SOURCES`).

The engine records one source code per generated token (``Request.token_sources``); its text
grows a step at a time, several tokens at once. A :class:`SourceTracker` (one per request that
asked, on the engine thread) decodes the tokens one by one to find where each one's text
starts and ends, and cuts each piece of text the server sends into entries: one per token, in
order, whose texts put together are exactly that piece. A token whose text a chunk boundary
cuts (held back for a stop string) has a part in each chunk, under the same ``index``; a token
without text of its own (an end-of-sequence token, a byte of a character that the next token
completes) has an entry with ``""``. Every generated token has an entry, so the entries of a
request count its ``completion_tokens``.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..engine.request import TOKEN_SOURCES


class SourceTracker:
    """Where each generated token's text lies in the request's text, and how the token came."""

    def __init__(self, tokenizer):
        from ..model.tokenizer import DetokenizeStream

        self._detokenizer = DetokenizeStream(tokenizer)
        self._ends: list[int] = []  # where each token's text ends in the decoded text
        self._sources: list[int] = []
        self._num_chars = 0
        self._next = 0  # the first token not yet entirely sent

    def update(self, generated_ids: Sequence[int], sources: bytes) -> None:
        """Take the tokens generated since the last call (and their source codes)."""
        for i in range(len(self._ends), min(len(generated_ids), len(sources))):
            self._num_chars += len(self._detokenizer.step(generated_ids[: i + 1]))
            self._ends.append(self._num_chars)
            self._sources.append(sources[i])

    def entries(self, start: int, text: str, final: bool = False) -> list[dict]:
        """The entries of ``text``, the request's text from character ``start`` on: the tokens
        whose text lies there, each with its part of ``text``. ``final``: the request's last
        piece, which takes every token not yet sent (those past the end of the text too,
        with ``""``: a stop string cut their text)."""
        if final:
            self._num_chars += len(self._detokenizer.flush())
            if self._ends:
                self._ends[-1] = self._num_chars
        end = start + len(text)
        entries = []
        while self._next < len(self._ends):
            i = self._next
            first = self._ends[i - 1] if i else 0
            last = self._ends[i]
            if i == len(self._ends) - 1 and final:
                last = max(last, end)  # text the per-token decoding did not produce: the last token's
            if first >= end and not final:
                break  # it starts after this piece (or is empty at its end: it goes with the next)
            piece = text[max(first, start) - start: max(min(last, end) - start, 0)]
            entries.append({"index": i, "text": piece, "source": TOKEN_SOURCES[self._sources[i]]})
            if last > end and not final:
                break  # the rest of its text comes in a later piece
            self._next += 1
        covered = sum(len(entry["text"]) for entry in entries)
        if covered < len(text) and self._ends:
            # A tokenizer whose text token by token falls short of its text in one go: the
            # rest goes with the last token, so that the entries still make up the text.
            last = len(self._ends) - 1
            if not entries or entries[-1]["index"] != last:
                entries.append({"index": last, "text": "", "source": TOKEN_SOURCES[self._sources[last]]})
            entries[-1]["text"] += text[covered:]
        return entries


def joined(parts: Sequence[Optional[list[dict]]]) -> Optional[list[dict]]:
    """The entries of several pieces in one list (None when none had any)."""
    if all(part is None for part in parts):
        return None
    return [entry for part in parts if part for entry in part]
