"""``--allowed-hosts``: the names a request's ``Host`` header may give, against DNS rebinding.

A web page can make a browser send requests to ``127.0.0.1``: it points a name of its own
(``attacker.example``) at that address once the page has loaded, and its scripts then reach
the local server as a same-origin site. The browser still sends ``Host: attacker.example``,
so a server that answers only to its own names cannot be reached that way, even without an
API key. Bound to loopback, the server therefore answers only to ``localhost``,
``127.0.0.1``, ``[::1]`` and the bound address by default (any port); bound elsewhere, to any
name (``*``), since the names clients use for it are the network's to decide.
"""

from __future__ import annotations

import ipaddress
from typing import Iterable, Optional, Sequence
from urllib.parse import urlsplit

from ..errors import SpecdecError
from .errors import APIError
from .limits import OnReject

#: The names of this machine's loopback interface.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address, as ``--host`` takes it) is this machine's loopback."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> tuple[str, ...]:
    """``--allowed-hosts`` when not given: the loopback names (and ``bind_host`` itself) when
    the server listens on loopback, else ``("*",)`` (any name)."""
    if not is_loopback(bind_host):
        return ("*",)
    names = dict.fromkeys((*LOOPBACK_NAMES, bind_host.strip("[]").lower()))
    return tuple(names)


def parse_allowed_hosts(value: str) -> tuple[str, ...]:
    """The host patterns of ``--allowed-hosts`` (comma-separated: names, addresses, IPv6 in
    brackets or not, ``*.example.com`` for a domain and its subdomains, ``*`` for any), or a
    :class:`SpecdecError` naming the one that is not valid."""
    patterns = tuple(part.strip().lower() for part in value.split(","))
    for pattern in patterns:
        name = pattern[2:] if pattern.startswith("*.") else pattern
        if pattern != "*" and (not name or "*" in name or not _valid_host(name)):
            raise SpecdecError(f"--allowed-hosts: '{pattern}' is not a host name, an address, '*.domain' or '*'")
    return tuple(pattern.strip("[]") for pattern in patterns)


def _valid_host(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
        return True
    except ValueError:
        pass
    try:
        return _host_of(name) == name.strip("[]")
    except ValueError:
        return False


def _host_of(header: str) -> str:
    """The host of a ``Host`` header (``name``, ``name:port``, ``[v6]:port``), lowercased and
    without brackets; ValueError when it is not one."""
    if not header or any(c in header for c in "/?#@ \\"):
        raise ValueError(header)
    parts = urlsplit("//" + header)
    parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    if not parts.hostname:
        raise ValueError(header)
    return parts.hostname


class AllowedHostsMiddleware:
    """Refuses a request whose ``Host`` header names no host of ``allowed_hosts`` (patterns of
    :func:`parse_allowed_hosts`): 421 ``host_not_allowed`` in the error schema, before
    anything else runs (the API key, the body). A missing or malformed ``Host`` is refused too.
    ``("*",)`` lets every request through."""

    def __init__(self, app, allowed_hosts: Sequence[str], on_reject: OnReject = None):
        self.app = app
        self.allowed = frozenset(p for p in allowed_hosts if not p.startswith("*"))
        self.domains = tuple(p[1:] for p in allowed_hosts if p.startswith("*.") and p != "*")
        self.allow_any = "*" in allowed_hosts
        self.shown = ",".join(f"[{p}]" if ":" in p else p for p in allowed_hosts)
        self.on_reject = on_reject

    def allows(self, header: Optional[str]) -> bool:
        try:
            host = _host_of(header or "")
        except ValueError:
            return False
        return host in self.allowed or any(host.endswith(d) or host == d[1:] for d in self.domains)

    async def __call__(self, scope, receive, send):
        if self.allow_any or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = _header(scope["headers"], b"host")
        if self.allows(header):
            await self.app(scope, receive, send)
            return
        if self.on_reject is not None:
            self.on_reject(421)
        given = "missing" if header is None else repr(header[:100])
        error = APIError(421, f"host: {given} is not a name this server answers to ({self.shown}); "
                              "add it to --allowed-hosts", code="host_not_allowed")
        response = error.response()
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> Optional[str]:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None
