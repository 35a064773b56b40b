"""The ngram proposer's index, compiled (``ngram_index.cc``), loaded with ctypes.

``load_ngram_library()`` builds the C++ source with the system compiler once per source
version (:func:`specdec.sdk.load_shared_library`) and returns the library, or raises
:class:`specdec.sdk.KernelUnavailable` with the reason. :class:`CompiledNgramIndexes`
holds one index per request and drafts for a whole batch in one call; the Python
``NgramIndex`` of the ngram plugin is its reference twin.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Sequence

import numpy as np

from specdec.sdk import load_shared_library

SOURCE = Path(__file__).with_name("ngram_index.cc")
_INT64_P = ctypes.POINTER(ctypes.c_int64)


@functools.lru_cache(maxsize=1)
def load_ngram_library() -> ctypes.CDLL:
    """Compile (once per source version) and load the index library."""
    lib = load_shared_library(SOURCE, "specdec_ngram_index")
    lib.specdec_ngram_new.restype = ctypes.c_void_p
    lib.specdec_ngram_new.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.specdec_ngram_free.restype = None
    lib.specdec_ngram_free.argtypes = [ctypes.c_void_p]
    lib.specdec_ngram_propose.restype = None
    lib.specdec_ngram_propose.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_void_p]
    return lib


class CompiledNgramIndexes:
    """One compiled index per request (``min_n``..``max_n``-grams), and batched drafting.

    ``draft_batch`` takes each request's whole token array (prompt, then generated tokens;
    they only ever grow) and returns the same drafts as the Python ``NgramIndex``: the tokens
    that followed the most recent earlier occurrence of the longest matching suffix.
    """

    def __init__(self, min_n: int, max_n: int, lib: ctypes.CDLL | None = None):
        self._lib = lib or load_ngram_library()
        self.min_n, self.max_n = min_n, max_n
        self._entries: dict[str, list[int]] = {}  # request id -> [handle, tokens indexed so far]

    def __len__(self) -> int:
        return len(self._entries)

    def _new_entry(self, request_id: str) -> list[int]:
        """Create the index of a request seen for the first time."""
        handle = self._lib.specdec_ngram_new(self.min_n, self.max_n)
        if not handle:
            raise ValueError(f"bad ngram sizes {self.min_n}..{self.max_n} (1 <= min <= max <= 64)")
        entry = self._entries[request_id] = [handle, 0]
        return entry

    def draft_batch(self, requests: Sequence) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Catch each request's index up with its tokens and draft for it. ``requests`` are
        :class:`specdec.ProposalRequest`-like (``request_id``, ``token_ids``,
        ``max_draft_len``). Returns ``(token_ids [n, width], lengths [n], matched [n])`` with
        ``width`` the longest draft; row i holds ``lengths[i]`` drafts, the rest is padding
        (-1), and ``matched[i]`` is the length of the suffix it matched (0: no match)."""
        count = len(requests)
        entries = self._entries
        handles, pieces = [], []
        add_handle, add_piece = handles.append, pieces.append
        # Only the tokens each index has not seen cross over, in one flat array: asking numpy
        # for 256 arrays' addresses would cost more than the whole lookup.
        for request in requests:
            entry = entries.get(request.request_id) or self._new_entry(request.request_id)
            piece = request.token_ids[entry[1]:]
            entry[1] += len(piece)
            add_handle(entry[0])
            add_piece(piece)
        flat = np.concatenate(pieces, dtype=np.int64) if count else np.zeros(0, np.int64)
        handles = np.array(handles, dtype=np.uintp)
        new_counts = np.fromiter(map(len, pieces), dtype=np.int64, count=count)
        max_draft_lens = np.fromiter((r.max_draft_len for r in requests), dtype=np.int64, count=count)
        width = int(max_draft_lens.max()) if count else 0
        out = np.full((count, width), -1, dtype=np.int64)
        out_lens = np.zeros(count, dtype=np.int64)
        matched = np.zeros(count, dtype=np.int64)
        self._lib.specdec_ngram_propose(count, handles.ctypes.data, flat.ctypes.data, new_counts.ctypes.data,
                                        max_draft_lens.ctypes.data, width, out.ctypes.data, out_lens.ctypes.data,
                                        matched.ctypes.data)
        longest = int(out_lens.max()) if count else 0
        return out[:, :longest], out_lens, matched

    def finish(self, request_id: str) -> None:
        """Free a request's index (a no-op for an unknown id)."""
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._lib.specdec_ngram_free(entry[0])

    def close(self) -> None:
        for request_id in list(self._entries):
            self.finish(request_id)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass
