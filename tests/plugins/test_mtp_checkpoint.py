"""Crash-safe ``train-mtp`` checkpoints (specdec.plugins.mtp.checkpoint) on small real tensors:
a writer SIGKILLed in the middle of a write leaves the previous checkpoint loadable, and
``--resume`` refuses a changed file, a pickle, or a checkpoint of the old pickle format."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from specdec.cli import main
from specdec.plugins.mtp.checkpoint import MANIFEST, read_checkpoint, write_checkpoint
from specdec.sdk import SpecdecError


def parts_of(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"head": {"embed_proj": rng.standard_normal((64, 64)).astype(np.float32)},
            "optimizer": {"embed_proj_moment1_0": rng.standard_normal((64, 64)).astype(np.float32)}}


#: Writes the step-1 checkpoint, then starts step 2 and SIGKILLs itself in the middle of its
#: ``KILL_AT``-th file write (1: the head, 2: the optimizer, 3: the manifest), after half
#: the bytes are on disk: the crash at the exact write point, in a real process.
WRITER = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from specdec.plugins.mtp import checkpoint
    from test_mtp_checkpoint import parts_of

    directory, kill_at = sys.argv[1], int(sys.argv[2])
    checkpoint.write_checkpoint(directory, 1, parts_of(1), {"history": [1]})
    opened = [0]
    real_fdopen = os.fdopen

    class HalfThenKill:
        def __init__(self, f):
            self.f = f
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            self.f.close()
        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            os.fsync(self.f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

    def fdopen(fd, mode):
        opened[0] += 1
        f = real_fdopen(fd, mode)
        return HalfThenKill(f) if opened[0] == kill_at else f

    checkpoint.os.fdopen = fdopen
    checkpoint.write_checkpoint(directory, 2, parts_of(2), {"history": [1, 2]})
    print("not killed")
""")


@pytest.mark.parametrize("kill_at", [1, 3], ids=["in-a-tensor-file", "in-the-manifest"])
def test_a_kill_mid_write_leaves_the_previous_checkpoint_loadable(tmp_path, kill_at):
    directory = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", WRITER, str(directory), str(kill_at)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.path.dirname(__file__)})
    assert done.returncode == -9, done.stderr  # SIGKILLed mid-write
    assert any(p.name.startswith(".tmp-") for p in directory.iterdir())  # the half-written file is there
    previous = read_checkpoint(directory)
    assert previous.step == 1 and previous.meta == {"history": [1]}
    for part, tensors in parts_of(1).items():
        for name, value in tensors.items():
            np.testing.assert_array_equal(previous.parts[part][name], value)
    # The next checkpoint replaces it whole, and sweeps what the killed writer left.
    write_checkpoint(directory, 3, parts_of(3), {"history": [1, 3]})
    assert read_checkpoint(directory).step == 3
    assert sorted(p.name.split(".")[0] for p in directory.iterdir()) == ["checkpoint", "head", "optimizer"]


class Payload:
    """A pickle that, when loaded, creates a file: proof that the loader ran it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_resume_refuses_a_changed_file_a_pickle_and_the_old_format(tmp_path, capsys):
    directory = tmp_path / "out"
    write_checkpoint(directory, 5, parts_of(5), {"history": []})
    manifest = json.loads((directory / MANIFEST).read_text())
    optimizer = directory / manifest["files"]["optimizer"]["file"]

    # One byte changed: the hash in the manifest no longer matches.
    original = optimizer.read_bytes()
    optimizer.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(SpecdecError, match="does not match the sha256"):
        read_checkpoint(directory)

    # A pickle put in its place, with a manifest rewritten to match: never unpickled.
    marker = tmp_path / "unpickled"
    data = pickle.dumps(Payload(marker))
    optimizer.write_bytes(data)
    manifest["files"]["optimizer"]["sha256"] = hashlib.sha256(data).hexdigest()
    (directory / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SpecdecError, match="is not a safetensors file"):
        read_checkpoint(directory)
    assert not marker.exists()

    # A manifest naming a file outside the directory.
    manifest["files"]["optimizer"]["file"] = "../elsewhere.step000005-00.safetensors"
    (directory / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SpecdecError, match="not a <part>.step<N>-<hex>.safetensors file"):
        read_checkpoint(directory)

    # The old format (a pickled trainer.pdopt, no manifest): a one-line error, exit 2, before
    # any model is loaded.
    old = tmp_path / "old"
    old.mkdir()
    (old / "trainer.pdopt").write_bytes(pickle.dumps(Payload(marker)))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to train on\n")
    assert main(["train-mtp", "--corpus", str(corpus), "--output", str(old), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "trainer.pdopt is a checkpoint of an older, pickle-based format" in err
    assert not marker.exists()
