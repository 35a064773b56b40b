"""Opening GGUF files: a fast metadata parse, and one reader per file shared by a process."""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ..errors import SpecdecError

#: Readers kept by :func:`open_gguf_reader` (the most recently used files).
_READERS_KEPT = 2
_readers: OrderedDict = OrderedDict()
_readers_lock = threading.Lock()

#: struct formats of GGUF's scalar value types (``gguf.GGUFValueType`` numbers).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class MetadataField:
    """One metadata key/value of a GGUF file, parsed straight from its bytes.

    Has the parts of ``gguf.ReaderField`` that readers of metadata use: ``name``, ``types``
    (the value type, then the element type of an array), ``contents()`` (strings decoded as
    strict UTF-8, as gguf decodes them) and ``parts``/``data`` (the raw values, where a string
    is its bytes; ``parts[i] for i in data`` are the elements)."""

    __slots__ = ("name", "types", "parts", "data")

    def __init__(self, name: str, types: list, values: list):
        self.name, self.types = name, types
        self.parts = [_as_part(value) for value in values]
        self.data = list(range(len(values)))

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        def decoded(value):
            return value.decode("utf-8") if isinstance(value, bytes) else value

        import gguf

        if self.types and self.types[0] == gguf.GGUFValueType.ARRAY:
            if isinstance(index_or_slice, int):
                return decoded(_plain(self.parts[index_or_slice]))
            return [decoded(_plain(part)) for part in self.parts[index_or_slice]]
        return decoded(_plain(self.parts[-1])) if self.parts else None


def _as_part(value):
    """A scalar as a one-element numpy array (what ``ReaderField.parts`` holds), bytes as they are."""
    import numpy as np

    return value if isinstance(value, bytes) else np.array([value])


def _plain(part):
    return part if isinstance(part, bytes) else part.tolist()[0]


def _parse_fields(buffer: memoryview, offset: int, count: int) -> tuple[dict, int]:
    """``count`` key/value pairs from ``offset``: ({name: MetadataField}, the offset after them).

    A string array (a tokenizer's 49,152 tokens) is read with one ``struct`` call per string
    instead of the numpy view per string that ``gguf.GGUFReader`` makes (2-5 s per open)."""
    import gguf

    unpack_from = struct.unpack_from

    def read_string(at: int) -> tuple[bytes, int]:
        (length,) = unpack_from("<Q", buffer, at)
        start = at + 8
        return bytes(buffer[start:start + length]), start + length

    def read_values(at: int, value_type: int, count: int) -> tuple[list, int]:
        if value_type == _STRING:
            values = []
            for _ in range(count):
                value, at = read_string(at)
                values.append(value)
            return values, at
        fmt = _SCALAR_FORMATS.get(value_type)
        if fmt is None:
            raise ValueError(f"unsupported GGUF value type {value_type} in an array or value")
        size = struct.calcsize("<" + fmt)
        return list(unpack_from(f"<{count}{fmt}", buffer, at)), at + size * count

    fields: dict[str, MetadataField] = {}
    for _ in range(count):
        raw_name, offset = read_string(offset)
        name = raw_name.decode("utf-8")
        (value_type,) = unpack_from("<I", buffer, offset)
        offset += 4
        if value_type == _ARRAY:
            item_type, length = unpack_from("<IQ", buffer, offset)
            offset += 12
            if item_type == _ARRAY:
                raise ValueError(f"GGUF key '{name}' holds nested arrays, which specdec does not read")
            values, offset = read_values(offset, item_type, length)
            types = [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(item_type)]
        else:
            values, offset = read_values(offset, value_type, 1)
            types = [gguf.GGUFValueType(value_type)]
        if name in fields:
            raise ValueError(f"duplicate GGUF key '{name}'")
        fields[name] = MetadataField(name, types, values)
    return fields, offset


def fast_gguf_reader_class():
    """``gguf.GGUFReader`` with a fast metadata parse (defined on first use: gguf loads lazily)."""
    global _FastReader
    if _FastReader is None:
        import gguf

        class FastGGUFReader(gguf.GGUFReader):
            """``gguf.GGUFReader`` whose key/value section is parsed by :func:`_parse_fields`;
            the tensors are gguf's own memory-mapped views. Little-endian files only (every GGUF
            file llama.cpp writes); a big-endian one goes to gguf's own parser."""

            def _build_fields(self, offs: int, count: int) -> int:
                if self.byte_order != "I" or struct.pack("=I", 1) != struct.pack("<I", 1):
                    return super()._build_fields(offs, count)
                fields, end = _parse_fields(memoryview(self.data), int(offs), int(count))
                for field in fields.values():
                    self._push_field(field, skip_sum=True)
                return end

        _FastReader = FastGGUFReader
    return _FastReader


_FastReader = None


def open_gguf_reader(path: str | Path):
    """A read-only reader of ``path`` (a ``gguf.GGUFReader``), shared by the loads of one process.

    gguf's own parse of the default model's metadata (its tokenizer's 49,152 strings and merges,
    one memory-map view each) takes 2-5 s; :func:`fast_gguf_reader_class` reads the same fields
    in a fraction of that. The tensors are memory-mapped read-only, so one reader serves every
    load (engine, tokenizer, tensor-parallel rank). Keyed by the file's identity (device, inode,
    size, modification time): a file replaced on disk is read again. A one-line
    :class:`SpecdecError` when the file cannot be read."""
    try:
        stat = os.stat(path)
        key = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with _readers_lock:
            reader = _readers.get(key)
            if reader is None:
                reader = fast_gguf_reader_class()(str(path), "r")
                _readers[key] = reader
                while len(_readers) > _READERS_KEPT:
                    _readers.popitem(last=False)
            _readers.move_to_end(key)
            return reader
    except (OSError, ValueError, struct.error) as exc:
        raise SpecdecError(f"cannot read GGUF file {path}: {exc}") from exc


def release_mapped_pages() -> None:
    """Take the shared readers' mapped file pages out of this process's resident set.

    Loading reads every tensor of a file once, through its memory map, and copies the
    matrices into the kernels' layouts; the map stays (the readers are shared, and a map
    costs nothing), but its touched pages would count in the process's resident memory for
    good: 1.2 GB for Qwen2.5-Coder-1.5B's file. The pages stay in the page cache, and a tensor
    read through the map again (a tensor the kernels use in place) faults them back."""
    with _readers_lock:
        for reader in _readers.values():
            mapped = getattr(getattr(reader, "data", None), "_mmap", None)
            if mapped is not None and hasattr(mapped, "madvise"):
                mapped.madvise(mmap.MADV_DONTNEED)
