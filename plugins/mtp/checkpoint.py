"""Crash-safe training checkpoints: safetensors files, then a manifest of their hashes.

A checkpoint is a set of ``.safetensors`` files (never a pickle) and ``checkpoint.json``, the
manifest: the step, the caller's JSON metadata, and each file's name and sha256. Writing one
(:func:`write_checkpoint`):

1. each file goes to a temporary name in the same directory, is fsynced, and is renamed
   (``os.replace``) to a name of its own (``head.step000200-<random>.safetensors``), so that
   the previous checkpoint's files are never touched, even when it was of the same step;
2. the manifest is written last, the same way (temporary file, fsync, ``os.replace``), and the
   directory is fsynced: the rename of the manifest is the moment the new checkpoint exists;
3. only then are the previous checkpoint's files and stray temporary files removed.

A process killed at any point therefore leaves either the previous checkpoint or the new one,
whole. :func:`read_checkpoint` trusts nothing it did not write: it reads the manifest, checks
that every file it names is a plain ``.safetensors`` name in the directory whose sha256 matches,
and parses it with safetensors, which holds only arrays (a pickle there is refused, as is any
file that changed since it was written). Errors are one-line :class:`SpecdecError`\\ s.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import tempfile
from pathlib import Path
from typing import Any, Optional

import attrs
import numpy as np

from specdec.sdk import SpecdecError

#: The manifest's name in the checkpoint directory.
MANIFEST = "checkpoint.json"
#: The manifest's format; a manifest of another format is refused.
FORMAT = "specdec-checkpoint/1"
#: Names of the files a manifest may list: ``<part>.step<N>-<hex>.safetensors`` in the same directory.
_FILE_NAME = re.compile(r"^[a-z][a-z0-9_]*\.step[0-9]+-[0-9a-f]+\.safetensors$")
_TEMP_PREFIX = ".tmp-"


@attrs.frozen
class Checkpoint:
    """A checkpoint as read back: its ``step``, the caller's ``meta`` (JSON) and, per part
    (``head``, ``optimizer``, ...), the file's tensors as numpy arrays."""

    step: int
    meta: dict
    parts: dict[str, dict[str, np.ndarray]]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` holds either its old content or all of
    ``data``, never part of it: a temporary file in the same directory, fsynced, renamed."""
    fd, temp = tempfile.mkstemp(prefix=_TEMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _fsync_directory(directory: Path) -> None:
    """Make the renames in ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(directory: Path, step: int, parts: dict[str, dict[str, np.ndarray]], meta: dict) -> Path:
    """Write the checkpoint of ``step`` (see the module's docstring) and return the manifest's
    path. ``parts`` maps a part name to its tensors; ``meta`` must be JSON."""
    from safetensors.numpy import save

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for part, tensors in parts.items():
        name = f"{part}.step{step:06d}-{secrets.token_hex(4)}.safetensors"
        data = save({key: np.ascontiguousarray(value) for key, value in tensors.items()})
        write_atomically(directory / name, data)
        files[part] = {"file": name, "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"format": FORMAT, "step": step, "files": files, "meta": meta}
    write_atomically(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync_directory(directory)
    _remove_stale(directory, keep={entry["file"] for entry in files.values()})
    return directory / MANIFEST


def _remove_stale(directory: Path, keep: set[str]) -> None:
    """Remove earlier checkpoints' files and temporary files that a killed writer left."""
    for path in directory.iterdir():
        stale_part = _FILE_NAME.match(path.name) and path.name not in keep
        if stale_part or path.name.startswith(_TEMP_PREFIX):
            path.unlink(missing_ok=True)


def read_checkpoint(directory: Path, what: str = "--resume") -> Optional[Checkpoint]:
    """The checkpoint in ``directory``, verified; None when there is none (no manifest and no
    file of an older format). ``what`` names the flag in errors."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        legacy = [name for name in ("trainer.pdopt", "trainer.json") if (directory / name).exists()]
        if legacy:
            raise SpecdecError(f"{what}: {directory / legacy[0]} is a checkpoint of an older, pickle-based format; "
                               f"specdec resumes only from a {MANIFEST} manifest of safetensors files (start afresh)")
        return None
    manifest = _read_manifest(manifest_path, what)
    parts = {}
    for part, entry in manifest["files"].items():
        name = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not _FILE_NAME.match(name):
            raise SpecdecError(f"{what}: {manifest_path}: part '{part}' names {name!r}, not a "
                               f"<part>.step<N>-<hex>.safetensors file in the checkpoint's directory")
        path = directory / name
        if not path.is_file():
            raise SpecdecError(f"{what}: {path} is missing (the manifest lists it)")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise SpecdecError(f"{what}: {path} does not match the sha256 in {manifest_path} "
                               f"(changed since it was written); refusing to load it")
        try:
            parts[part] = load(data)
        except (SafetensorError, ValueError) as exc:
            raise SpecdecError(f"{what}: {path} is not a safetensors file ({exc})") from None
    return Checkpoint(step=manifest["step"], meta=manifest["meta"], parts=parts)


def _read_manifest(path: Path, what: str) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecdecError(f"{what}: {path} is not JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SpecdecError(f"{what}: {path} is not a {FORMAT} manifest")
    if not isinstance(manifest.get("step"), int) or not isinstance(manifest.get("files"), dict) \
            or not isinstance(manifest.get("meta"), dict):
        raise SpecdecError(f"{what}: {path} lacks its step, files or meta")
    return manifest
