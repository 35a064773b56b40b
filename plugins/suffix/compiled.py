"""The suffix proposer's trees, compiled (``suffix_trees.cc``), loaded with ctypes.

The Python trees (``tree.py``) are the reference twin: the same drafts, token for token, tests
compare them. What is compiled is what a step pays for, per request and token: extending a
request's own tree, following its match in the tree of earlier responses, drafting. A step
makes one call for the whole batch (:meth:`CompiledRequests.propose`,
:meth:`CompiledRequests.extend`), where the Python trees cost about 19 us a request-token in
``on_step`` alone (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Callable, Hashable, Iterable, Optional, Sequence

import numpy as np

from specdec.sdk import load_shared_library

from .tree import Draft, EMPTY_DRAFT

SOURCE = Path(__file__).with_name("suffix_trees.cc")
_P, _I64, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


@functools.lru_cache(maxsize=1)
def load_suffix_library() -> ctypes.CDLL:
    """Compile (once per source version) and load the trees' library; raises
    :class:`specdec.sdk.KernelUnavailable` where it cannot."""
    lib = load_shared_library(SOURCE, "specdec_suffix_trees")
    signatures = {
        "specdec_suffix_tree_new": (_P, [_I64]),
        "specdec_suffix_tree_free": (None, [_P]),
        "specdec_suffix_tree_extend": (_I64, [_P, _I64, _P, _I64]),
        "specdec_suffix_tree_remove": (_I64, [_P, _I64]),
        "specdec_suffix_tree_num_nodes": (_I64, [_P]),
        "specdec_suffix_tree_sequence": (_I64, [_P, _I64, _P]),
        "specdec_suffix_tree_speculate": (_I64, [_P, _P, _I64, _I64, _F64, _F64, _P, _P, _P, _P]),
        "specdec_suffix_request_new": (_P, [_I64]),
        "specdec_suffix_request_free": (None, [_P]),
        "specdec_suffix_request_tokens": (_I64, [_P, _I64, _P]),
        "specdec_suffix_extend_batch": (None, [_I64, _P, _P]),
        "specdec_suffix_propose_batch": (None, [_I64, _P, _P, _F64, _F64, _I64, _P]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


def _int64s(tokens) -> np.ndarray:
    return np.ascontiguousarray(tokens, dtype=np.int64)


class CompiledSuffixTree:
    """:class:`~specdec.plugins.suffix.tree.SuffixTree`'s interface for the trees of earlier
    responses (sequences keyed by any hashable id), held in native memory."""

    def __init__(self, max_depth: int, lib: ctypes.CDLL | None = None):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self._lib = lib or load_suffix_library()
        self.max_depth = max_depth
        self.handle = self._lib.specdec_suffix_tree_new(max_depth)
        self._keys: dict[Hashable, int] = {}  # sequence id -> the native key, oldest first
        self._next_key = 0

    def extend(self, seq_id: Hashable, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (only the sequence appended to last can grow)."""
        key = self._keys.get(seq_id)
        if key is None:
            key = self._next_key
            self._next_key += 1
        array = _int64s(list(tokens))
        if self._lib.specdec_suffix_tree_extend(self.handle, key, array.ctypes.data, len(array)) < 0:
            raise ValueError(f"sequence {seq_id!r} is closed: only the last sequence appended to can grow")
        self._keys[seq_id] = key

    def remove(self, seq_id: Hashable) -> None:
        """Remove sequence ``seq_id`` (KeyError when absent)."""
        key = self._keys.pop(seq_id)
        self._lib.specdec_suffix_tree_remove(self.handle, key)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self):
        return iter(self._keys)

    def sequence(self, seq_id: Hashable) -> list:
        """A copy of the tokens of ``seq_id``."""
        key = self._keys[seq_id]
        out = np.zeros(self._lib.specdec_suffix_tree_sequence(self.handle, key, None), dtype=np.int64)
        self._lib.specdec_suffix_tree_sequence(self.handle, key, out.ctypes.data)
        return out.tolist()

    def num_nodes(self) -> int:
        """Inner nodes plus leaves, the root excluded (a measure of memory)."""
        return self._lib.specdec_suffix_tree_num_nodes(self.handle)

    def speculate(self, context: Sequence[int], max_tokens: int, max_spec_factor: float = 1.0,
                  min_token_prob: float = 0.1) -> Draft:
        """The best draft for ``context`` from this tree alone."""
        if max_tokens <= 0:
            return EMPTY_DRAFT
        context = _int64s(context)
        tokens = np.zeros(max_tokens, dtype=np.int64)
        probs = np.zeros(max_tokens, dtype=np.float64)
        score, match_len = ctypes.c_double(), ctypes.c_int64()
        length = self._lib.specdec_suffix_tree_speculate(
            self.handle, context.ctypes.data, len(context), max_tokens, max_spec_factor, min_token_prob,
            tokens.ctypes.data, probs.ctypes.data, ctypes.byref(score), ctypes.byref(match_len))
        if not length:
            return EMPTY_DRAFT
        return Draft(tokens[:length].tolist(), probs[:length].tolist(), score.value, match_len.value)

    def __del__(self):
        try:
            self._lib.specdec_suffix_tree_free(self.handle)
        except Exception:  # interpreter shutdown: the library may be gone already
            pass


class _Request:
    """A running request's native state (its own tree and its match in a response tree) and
    how many of its tokens that state holds."""

    __slots__ = ("handle", "have", "num_prompt_tokens", "cache_key")

    def __init__(self, handle: int, num_prompt_tokens: int, cache_key: Hashable):
        self.handle, self.have, self.num_prompt_tokens, self.cache_key = handle, 0, num_prompt_tokens, cache_key


class CompiledRequests:
    """The running requests' trees, one native state each, caught up and drafted for a whole
    batch per call. ``trees`` maps a cache key to its :class:`CompiledSuffixTree` of earlier
    responses (the proposer's ``response_trees``, read at every call: trees come and go);
    ``cache_key(tenant)`` says which one a new request drafts from."""

    def __init__(self, max_depth: int, trees: dict, cache_key: Callable[[Optional[str]], Hashable],
                 lib: ctypes.CDLL | None = None):
        self._lib = lib or load_suffix_library()
        self.max_depth = max_depth
        self.trees = trees
        self.cache_key = cache_key
        self._requests: dict[str, _Request] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def _start(self, request) -> _Request:
        """A new state for ``request`` (replacing one whose tokens are not its history any more)."""
        self.finish(request.request_id)
        state = self._requests[request.request_id] = _Request(
            self._lib.specdec_suffix_request_new(self.max_depth), request.num_prompt_tokens,
            self.cache_key(request.tenant))
        return state

    def _catch_up(self, requests: Sequence, extra: Optional[Sequence] = None) -> tuple[list, np.ndarray]:
        """Each request's state and the tokens it has not seen: ``token_ids`` past what it
        holds, then ``extra[i]``. Returns the first columns of a batch call's table (states,
        response trees, token counts: see ``suffix_trees.cc``) and the tokens, flat."""
        handles, trees, counts, pieces = [], [], [], []
        get_state, get_tree = self._requests.get, self.trees.get
        for i, request in enumerate(requests):
            state = get_state(request.request_id)
            token_ids = request.token_ids
            total = len(token_ids)
            if state is None or state.have > total:
                state = self._start(request)
            count = total - state.have
            if count:
                pieces.append(token_ids[state.have:])
            if extra is not None:
                pieces.append(extra[i])
                count += len(extra[i])
            state.have += count
            counts.append(count)
            handles.append(state.handle)
            tree = get_tree(state.cache_key)
            trees.append(tree.handle if tree is not None else 0)
        flat = np.concatenate(pieces, dtype=np.int64) if pieces else np.zeros(1, np.int64)
        return handles + trees + counts, flat

    def extend(self, requests: Sequence, accepted: Optional[Sequence[np.ndarray]] = None) -> None:
        """Catch each request up with its ``token_ids``, then append ``accepted[i]`` if given."""
        if requests:
            columns, flat = self._catch_up(requests, accepted)
            table = np.array(columns, dtype=np.int64)
            self._lib.specdec_suffix_extend_batch(len(requests), table.ctypes.data, flat.ctypes.data)

    def propose(self, requests: Sequence, max_spec_factor: float,
                min_token_prob: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Catch each request up and draft for it (a seeded sampled request from its own tree
        alone): ``(token_ids [n, width], lengths [n], match lengths [n])``, rows padded with -1,
        a match length 0 where there is no draft."""
        count = len(requests)
        if not count:
            empty = np.zeros(0, dtype=np.int64)
            return np.zeros((0, 0), dtype=np.int64), empty, empty
        columns, flat = self._catch_up(requests)
        max_lens = [request.max_draft_len for request in requests]
        columns += max_lens
        columns += [request.reproducible for request in requests]
        columns += [0] * (2 * count)
        table = np.array(columns, dtype=np.int64).reshape(7, count)
        width = max(max(max_lens), 0)
        out = np.full((count, width), -1, dtype=np.int64)
        self._lib.specdec_suffix_propose_batch(count, table.ctypes.data, flat.ctypes.data, max_spec_factor,
                                               min_token_prob, width, out.ctypes.data)
        lengths, match_lens = table[5], table[6]
        return out[:, :int(lengths.max())], lengths, match_lens

    def tokens(self, request_id: str) -> list:
        """The request's tokens so far (prompt, then generated)."""
        return self._tokens_of(self._requests[request_id])

    def finish(self, request_id: str) -> Optional[tuple[Hashable, list]]:
        """Free a request's state; returns (its cache key, its response tokens), or None for an
        unknown id."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        response = self._tokens_of(state, start=state.num_prompt_tokens)
        self._lib.specdec_suffix_request_free(state.handle)
        return state.cache_key, response

    def _tokens_of(self, state: _Request, start: int = 0) -> list:
        start = min(start, state.have)
        out = np.zeros(state.have - start, dtype=np.int64)
        self._lib.specdec_suffix_request_tokens(state.handle, start, out.ctypes.data)
        return out.tolist()

    def close(self) -> None:
        for request_id in list(self._requests):
            self.finish(request_id)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass
