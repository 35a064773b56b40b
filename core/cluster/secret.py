"""The cluster secret: what instances of one cluster prove to each other with.

The API key (``--api-key``) is what clients hold; the cluster secret
(``--cluster-secret-file``, ``$SPECDEC_CLUSTER_SECRET`` or ``--cluster-secret``) is what the
instances share and clients never see. It signs what one instance hands another: KV hand-offs
(an HMAC over header and body), registrations and jobs in Redis. A client that knows the API
key, or a process that can write to Redis, cannot forge any of them.

Every MAC here is HMAC-SHA256 over length-prefixed parts (so that ``("ab", "c")`` and
``("a", "bc")`` differ), compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
from typing import Optional

from ..errors import SpecdecError

#: The environment variable that holds the cluster secret.
CLUSTER_SECRET_ENV = "SPECDEC_CLUSTER_SECRET"
#: The shortest secret accepted, in bytes (a shorter one can be guessed).
MIN_SECRET_BYTES = 16
#: Bytes of one MAC.
MAC_BYTES = 32


class BadSignature(ValueError):
    """A record or message whose MAC is missing or does not match the cluster secret."""


def resolve_cluster_secret(flag: Optional[str] = None, file: Optional[str] = None) -> Optional[bytes]:
    """The cluster secret from ``--cluster-secret-file`` (its first line), ``--cluster-secret``
    or ``$SPECDEC_CLUSTER_SECRET``, in that order; None when none is set. A secret shorter
    than :data:`MIN_SECRET_BYTES` is a one-line :class:`SpecdecError` (the secret itself is
    never part of a message)."""
    source = "--cluster-secret"
    if file:
        source = "--cluster-secret-file"
        try:
            with open(file, encoding="utf-8") as handle:
                flag = handle.readline().strip()
        except OSError as exc:
            raise SpecdecError(f"--cluster-secret-file: cannot read {file}: {exc.strerror or exc}") from None
    elif not flag:
        source, flag = f"${CLUSTER_SECRET_ENV}", os.environ.get(CLUSTER_SECRET_ENV)
    if not flag:
        return None
    secret = flag.encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise SpecdecError(f"{source}: the cluster secret must be at least {MIN_SECRET_BYTES} bytes "
                           f"(got {len(secret)}); `python -c 'import secrets; print(secrets.token_hex(32))'` "
                           "makes one")
    return secret


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def secret_required(role: str, host: str) -> bool:
    """A cluster secret is required for the ``prefill`` and ``decode`` roles (they take KV
    hand-offs, or send prompts to instances Redis names) on any address other machines can
    reach; ``mixed`` instances and a cluster on loopback may run without one."""
    return role != "mixed" and not is_loopback(host)


def mac(secret: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts`` under ``secret`` (each part prefixed by its length)."""
    digest = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.digest()


def check_mac(secret: bytes, tag: bytes, *parts: bytes) -> bool:
    """Whether ``tag`` is :func:`mac` of ``parts`` (constant time)."""
    return hmac.compare_digest(mac(secret, *parts), tag)


def new_nonce() -> str:
    """A fresh random nonce (hex, 128 bits): one per job, so that a hand-off cannot be replayed."""
    return secrets.token_hex(16)


def seal(secret: Optional[bytes], kind: str, payload: dict) -> bytes:
    """``payload`` as the JSON Redis stores, signed when the cluster has a secret:
    ``{"p": payload, "mac": hex}`` with the MAC over ``kind`` and the payload's JSON (a record of
    one kind cannot be replayed as another). Without a secret, the payload's JSON alone."""
    body = json.dumps(payload, separators=(",", ":"), sort_keys=True)
    if secret is None:
        return body.encode()
    tag = mac(secret, kind.encode(), body.encode()).hex()
    return json.dumps({"p": body, "mac": tag}, separators=(",", ":")).encode()


def unseal(secret: Optional[bytes], kind: str, data: bytes) -> dict:
    """The payload of a record :func:`seal` wrote. Raises :class:`BadSignature` when the cluster
    has a secret and the record is unsigned or its MAC does not match, and ``ValueError``
    when it is not a JSON object."""
    record = json.loads(data)
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if secret is None:
        return record
    body, tag = record.get("p"), record.get("mac")
    if not isinstance(body, str) or not isinstance(tag, str):
        raise BadSignature("unsigned record (the cluster has a secret)")
    try:
        tag_bytes = bytes.fromhex(tag)
    except ValueError:
        raise BadSignature("malformed MAC") from None
    if not check_mac(secret, tag_bytes, kind.encode(), body.encode()):
        raise BadSignature("MAC does not match the cluster secret")
    payload = json.loads(body)
    if not isinstance(payload, dict):
        raise ValueError(f"expected a JSON object, got {type(payload).__name__}")
    return payload
