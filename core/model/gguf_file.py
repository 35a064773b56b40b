"""Opening GGUF files: one parsed reader per file, shared by the loads of one process."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

from ..errors import SpecdecError

#: Readers kept by :func:`open_gguf_reader` (the most recently used files).
_READERS_KEPT = 2
_readers: OrderedDict = OrderedDict()
_readers_lock = threading.Lock()


def open_gguf_reader(path: str | Path):
    """A read-only ``gguf.GGUFReader`` of ``path``, shared by the loads of one process.

    Parsing a file's header and metadata costs 2-3 s for the default model (its tokenizer's
    49,152 strings and merges, one memory-map view each), every time an engine, a tokenizer
    or a tensor-parallel rank opens the file. The tensors are memory-mapped read-only, so one
    reader serves every load. Keyed by the file's identity (device, inode, size, modification
    time): a file replaced on disk is read again. A one-line :class:`SpecdecError` when the
    file cannot be read."""
    import gguf

    try:
        stat = os.stat(path)
        key = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with _readers_lock:
            reader = _readers.get(key)
            if reader is None:
                reader = gguf.GGUFReader(str(path), "r")
                _readers[key] = reader
                while len(_readers) > _READERS_KEPT:
                    _readers.popitem(last=False)
            _readers.move_to_end(key)
            return reader
    except (OSError, ValueError) as exc:
        raise SpecdecError(f"cannot read GGUF file {path}: {exc}") from exc
