"""The cluster secret: resolution, MACs and sealed records (core/cluster/secret.py)."""

import json

import pytest

from specdec.cli import main
from specdec.cluster.secret import (
    BadSignature, check_mac, mac, resolve_cluster_secret, seal, secret_required, unseal,
)
from specdec.errors import SpecdecError

SECRET = b"0123456789abcdef0123456789abcdef"


def test_secret_from_file_flag_and_env(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_CLUSTER_SECRET", raising=False)
    assert resolve_cluster_secret() is None
    monkeypatch.setenv("SPECDEC_CLUSTER_SECRET", "e" * 20)
    assert resolve_cluster_secret() == b"e" * 20
    assert resolve_cluster_secret("f" * 16) == b"f" * 16
    path = tmp_path / "secret"
    path.write_text("g" * 32 + "\nignored\n")
    assert resolve_cluster_secret("f" * 16, str(path)) == b"g" * 32
    with pytest.raises(SpecdecError, match="at least 16 bytes") as info:
        resolve_cluster_secret("short")
    assert "short" not in str(info.value)  # never echoed
    with pytest.raises(SpecdecError, match="cannot read"):
        resolve_cluster_secret(file=str(tmp_path / "missing"))


def test_macs_cover_every_part_and_its_boundaries():
    tag = mac(SECRET, b"ab", b"c")
    assert check_mac(SECRET, tag, b"ab", b"c")
    assert not check_mac(SECRET, tag, b"a", b"bc")
    assert not check_mac(b"x" * 32, tag, b"ab", b"c")


def test_sealed_records_refuse_forgery_replay_and_unsigned():
    record = seal(SECRET, "instance", {"num_pending": 1})
    assert unseal(SECRET, "instance", record) == {"num_pending": 1}
    with pytest.raises(BadSignature):
        unseal(SECRET, "job", record)  # a record of one kind replayed as another
    forged = json.loads(record)
    forged["p"] = forged["p"].replace("1", "-1000")
    with pytest.raises(BadSignature):
        unseal(SECRET, "instance", json.dumps(forged).encode())
    with pytest.raises(BadSignature):
        unseal(SECRET, "instance", seal(None, "instance", {"num_pending": 1}))
    assert unseal(None, "instance", seal(None, "instance", {"a": 1})) == {"a": 1}
    with pytest.raises(ValueError):
        unseal(None, "instance", b"[1]")


def test_secret_required_off_loopback_for_disaggregated_roles():
    assert secret_required("decode", "0.0.0.0") and secret_required("prefill", "10.0.0.2")
    assert not secret_required("decode", "127.0.0.1") and not secret_required("decode", "localhost")
    assert not secret_required("mixed", "0.0.0.0")


def test_serve_refuses_a_decode_role_off_loopback_without_a_secret(capsys, monkeypatch):
    monkeypatch.delenv("SPECDEC_CLUSTER_SECRET", raising=False)
    code = main(["serve", "--host", "0.0.0.0", "--scheduler", "redis://127.0.0.1:1/0", "--role", "decode"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "need a shared secret" in err[0], err
