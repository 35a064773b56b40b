"""The direct channel that moves a handed-off request's KV blocks from a prefill instance to a
decode instance: one TCP connection per hand-off.

Control goes through Redis, but the blocks do not: the default model's float16 KV is 23 KB
per token, and Redis would hold and copy every byte twice. TCP works
between machines as well as on one (docs/deployment.md has the measured bandwidth).

**Who may hand off.** The origin of a request (the instance its client is on) issues a
*ticket* with the job (:func:`issue_ticket`): the request's id, attempt and origin, the decode
instance it is for, an expiry and a fresh nonce, signed with the cluster secret. The prefill
instance sends it with the hand-off; the decode instance takes the request's identity from the
ticket only, and takes each ticket once (:class:`TicketBook`), so a captured hand-off cannot
be replayed, nor a request id or origin forged. Every hand-off carries an HMAC over its header
and one over its body, both under the cluster secret: without the secret, nobody can hand off,
and a hand-off whose header fails is refused before its body is read. Without a cluster secret
(allowed only on loopback, see :mod:`.secret`) nothing is authenticated, so the imported
blocks never join the decode engine's shared prefix cache (:attr:`HandoffState.share_prefix`).

The wire format:

    preamble (25 bytes)  ``SPECDEC-KV/2\\n``, header length (4 bytes), body length (8 bytes),
                         big-endian
    header               JSON, at most :data:`MAX_HEADER_BYTES`: {"ticket": {...},
                         "seq": next event number, "state": HandoffState header,
                         "sizes": [bytes of each buffer], "options": the job's
                         :class:`~.messages.Options` (tenant, grammar, token sources)}
    header MAC (32)      HMAC(secret, "kv-header", preamble, header); zeros without a secret
    body                 the raw bytes of each buffer of ``HandoffState.to_wire()``, in order
    body MAC (32)        HMAC-SHA256(secret, "kv-body" + header MAC + body); zeros without one

The receiver checks the preamble, the header's MAC (before parsing its JSON), the ticket, and
that the body's length is what the state's positions need (:class:`TransferServer`'s
``byte_cap``) before it reads the body. It answers one JSON line, ``{"ok": true}`` or
``{"ok": false, "error": "..."}``, once the request runs on its engine (or could not be
taken). A malformed, forged or oversized message gets an error answer and the connection
closes; it touches no other request. At most ``max_connections`` hand-offs are read at once;
one more is refused at once, and a sender that does not deliver its header within
``header_timeout`` seconds is cut off. The channel may run over TLS (:class:`TransferTLS`),
which hides the KV from the network; the MACs are what authenticate it either way.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import logging
import ssl
import time
from typing import Awaitable, Callable, Optional

import attrs

from ..engine.handoff import HandoffState
from ..errors import SpecdecError
from .messages import MAX_GRAMMAR_BYTES, Options
from .records import BadRecord
from .secret import MAC_BYTES, check_mac, mac, new_nonce

logger = logging.getLogger("specdec.cluster")

MAGIC = b"SPECDEC-KV/2\n"
#: The fixed-size start of every hand-off: the magic, the header's length, the body's length.
PREAMBLE_BYTES = len(MAGIC) + 4 + 8
#: The largest header accepted (prompt ids and sampling parameters of a long prompt fit, and
#: the largest grammar a job carries).
MAX_HEADER_BYTES = 4 * 2**20 + MAX_GRAMMAR_BYTES
#: Seconds a hand-off may take, connection to answer.
TRANSFER_TIMEOUT_S = 60.0
#: Seconds a sender has to deliver the preamble and header after connecting.
HEADER_TIMEOUT_S = 5.0
#: Hand-offs one decode instance reads at once.
MAX_CONNECTIONS = 8
#: Seconds a ticket is valid after the origin issued it (queueing and prefill included).
TICKET_TTL_S = 300.0
#: What the MACs of an instance without a cluster secret hold.
NO_MAC = bytes(MAC_BYTES)
_TICKET_FIELDS = ("request_id", "attempt", "origin", "decode", "nonce", "expires")


class TransferError(Exception):
    """The hand-off did not reach the decode instance, or it refused the request."""


@attrs.frozen
class TransferStats:
    """One hand-off: bytes of KV (and hidden states) sent, and seconds from connect to answer."""

    num_bytes: int
    seconds: float


@attrs.frozen
class TransferTLS:
    """TLS on the transfer channel (``--kv-transfer-tls-cert/-key/-ca``): every instance of
    the cluster uses the same flags. The decode side serves ``cert``; the prefill side checks it
    against ``ca`` (the system's store without one) and the transfer address's host, and shows
    ``cert`` in turn, which the decode side requires when ``ca`` is given (mutual TLS)."""

    cert: str
    key: str
    ca: Optional[str] = None

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, self.key)
        if self.ca:
            context.load_verify_locations(self.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca)
        context.load_cert_chain(self.cert, self.key)
        return context

    def contexts(self) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        """``(server, client)`` contexts; a file that cannot be loaded is a one-line SpecdecError."""
        try:
            return self.server_context(), self.client_context()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            files = ", ".join(path for path in (self.cert, self.key, self.ca) if path)
            raise SpecdecError(f"--kv-transfer-tls-cert/-key/-ca: cannot load {files}: "
                               f"{' '.join(str(exc).split())}") from None


# -- tickets ---------------------------------------------------------------------------------


def _ticket_body(ticket: dict) -> bytes:
    return json.dumps([ticket[name] for name in _TICKET_FIELDS], separators=(",", ":")).encode()


def issue_ticket(secret: Optional[bytes], *, request_id: str, attempt: int, origin: str, decode: str,
                 ttl: float = TICKET_TTL_S) -> dict:
    """The ticket an origin puts in a prefill job: it lets the prefill instance hand *this*
    attempt of *this* request to *that* decode instance, once, within ``ttl`` seconds
    (signed with ``secret``; unsigned without one)."""
    ticket = {"request_id": str(request_id), "attempt": int(attempt), "origin": str(origin), "decode": str(decode),
              "nonce": new_nonce(), "expires": round(time.time() + ttl, 3)}
    ticket["tag"] = mac(secret, b"kv-ticket", _ticket_body(ticket)).hex() if secret else ""
    return ticket


class TicketBook:
    """The decode side's record of tickets: :meth:`redeem` takes each valid ticket once.

    :param instance_id: this decode instance (a ticket for another is refused).
    :param secret: the cluster secret (tickets must be signed with it), or None.
    """

    def __init__(self, instance_id: str, secret: Optional[bytes]):
        self.instance_id = instance_id
        self.secret = secret
        self._used: collections.OrderedDict[str, float] = collections.OrderedDict()  # nonce -> expiry

    def redeem(self, ticket) -> Optional[str]:
        """None when ``ticket`` is valid, for this instance, unexpired and unused (it is used
        from now on); else why not, in one line."""
        if not isinstance(ticket, dict) or any(name not in ticket for name in _TICKET_FIELDS):
            return "no ticket"
        try:
            body, expires = _ticket_body(ticket), float(ticket["expires"])
            tag = bytes.fromhex(str(ticket.get("tag", "")))
        except (TypeError, ValueError):
            return "malformed ticket"
        if self.secret is not None and not check_mac(self.secret, tag, b"kv-ticket", body):
            return "the ticket's signature does not match the cluster secret"
        if ticket["decode"] != self.instance_id:
            return f"the ticket is for instance {ticket['decode']}, not {self.instance_id}"
        now = time.time()
        while self._used and next(iter(self._used.values())) < now:
            self._used.popitem(last=False)
        if expires < now:
            return "the ticket has expired"
        if expires > now + TICKET_TTL_S + 60:  # 60 s for the clocks' skew; a later one would never leave _used
            return "the ticket expires too late (are the instances' clocks set?)"
        nonce = str(ticket["nonce"])
        if nonce in self._used:
            return "the ticket was used already (a replayed hand-off)"
        self._used[nonce] = expires
        return None


# -- sending ---------------------------------------------------------------------------------


def frame_handoff(ticket: dict, seq: int, state: HandoffState, secret: Optional[bytes],
                  options: Options = Options()) -> tuple[bytes, list, bytes]:
    """A hand-off as sent: ``(preamble + header + header MAC, buffers, body MAC)``."""
    state_header, buffers = state.to_wire()
    views = [memoryview(buffer).cast("B") for buffer in buffers]
    header = json.dumps({"ticket": ticket, "seq": int(seq), "state": state_header,
                         "sizes": [view.nbytes for view in views], "options": options.to_dict()}).encode()
    preamble = MAGIC + len(header).to_bytes(4, "big") + sum(view.nbytes for view in views).to_bytes(8, "big")
    header_tag = mac(secret, b"kv-header", preamble, header) if secret else NO_MAC
    body_tag = NO_MAC
    if secret:
        digest = hmac.new(secret, b"kv-body" + header_tag, hashlib.sha256)
        for view in views:
            digest.update(view)
        body_tag = digest.digest()
    return preamble + header + header_tag, views, body_tag


async def send_handoff(address: str, ticket: dict, seq: int, state: HandoffState, secret: Optional[bytes] = None,
                       timeout: float = TRANSFER_TIMEOUT_S, tls: Optional[ssl.SSLContext] = None,
                       options: Options = Options()) -> TransferStats:
    """Send ``state`` with its ``ticket`` (from the job), ``seq`` (the request's next event
    number) and ``options`` (the job's) to the transfer listener at ``HOST:PORT`` (over TLS
    with ``tls``, a :meth:`TransferTLS.client_context`); returns once the decode instance runs it."""
    host, _, port = address.rpartition(":")
    head, views, body_tag = frame_handoff(ticket, seq, state, secret, options)
    started = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, int(port), ssl=tls, server_hostname=host if tls else None), timeout=5.0)
    except (OSError, asyncio.TimeoutError, ValueError) as exc:
        raise TransferError(f"cannot connect to {address}: {exc or type(exc).__name__}") from None
    try:
        writer.write(head)
        for view in views:
            writer.write(view)
        writer.write(body_tag)
        await asyncio.wait_for(writer.drain(), timeout=timeout)
        answer = await asyncio.wait_for(reader.readline(), timeout=timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        raise TransferError(f"sending to {address} failed: {exc or type(exc).__name__}") from None
    finally:
        writer.close()
    try:
        reply = json.loads(answer)
    except ValueError:
        raise TransferError(f"{address} closed the connection without an answer") from None
    if not reply.get("ok"):
        raise TransferError(f"{address} refused the request: {reply.get('error')}")
    return TransferStats(sum(view.nbytes for view in views), time.perf_counter() - started)


# -- receiving -------------------------------------------------------------------------------

Handler = Callable[[dict, HandoffState], Awaitable[Optional[str]]]


class _Refused(Exception):
    """A hand-off refused before its state was built (the message is the answer's error)."""


class TransferServer:
    """Listens for hand-offs; ``handler(meta, state)`` starts the request and returns None, or
    a one-line reason it could not. ``meta`` (``request_id``, ``attempt``, ``origin``) comes
    from the redeemed ticket, never from the sender's say-so; ``seq`` and ``options`` (the
    job's :class:`~.messages.Options`, checked) from the header its MAC authenticates.

    :param byte_cap: ``byte_cap(num_positions)``: the most body bytes a hand-off of that many
        positions may carry (its KV blocks and hidden states); 0 refuses the positions.
    :param tickets: the :class:`TicketBook` of this instance (its secret authenticates hand-offs).
    :param max_connections: hand-offs read at once; one more is refused at once.
    :param header_timeout: seconds a sender has for its preamble and header.
    :param tls: a :meth:`TransferTLS.server_context` to serve TLS, or None.
    """

    def __init__(self, host: str, port: int, handler: Handler, byte_cap: Callable[[int], int], tickets: TicketBook,
                 *, max_connections: int = MAX_CONNECTIONS, header_timeout: float = HEADER_TIMEOUT_S,
                 tls: Optional[ssl.SSLContext] = None):
        self.host, self.port = host, port
        self.handler = handler
        self.byte_cap = byte_cap
        self.tickets = tickets
        self.secret = tickets.secret
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.tls = tls
        self._slots = asyncio.Semaphore(max_connections)
        self._server: Optional[asyncio.AbstractServer] = None

    async def start(self) -> tuple[str, int]:
        """Listen; returns the bound address (port 0 picks a free one)."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port, ssl=self.tls,
                                                  ssl_handshake_timeout=self.header_timeout if self.tls else None)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.port = port
        return host, port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._slots.locked():
            error = f"busy: {self.max_connections} hand-offs are being read; retry later"
        else:
            async with self._slots:
                error = await self._guarded_receive(reader)
        if error is not None:
            logger.warning("kv transfer from %s refused: %s", writer.get_extra_info("peername"), error)
        try:
            writer.write(json.dumps({"ok": error is None, "error": error}).encode() + b"\n")
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _guarded_receive(self, reader: asyncio.StreamReader) -> Optional[str]:
        try:
            return await asyncio.wait_for(self._receive(reader), timeout=TRANSFER_TIMEOUT_S)
        except _Refused as exc:
            return str(exc)
        except asyncio.TimeoutError:
            return "timed out reading the hand-off"
        except (asyncio.IncompleteReadError, ConnectionError):
            return "the sender closed the connection mid-message"
        except Exception as exc:  # noqa: BLE001 - a bad message is the sender's problem, not ours
            return f"bad hand-off: {type(exc).__name__}: {' '.join(str(exc).split())}"

    async def _receive(self, reader: asyncio.StreamReader) -> Optional[str]:
        header, header_tag, body_len = await asyncio.wait_for(self._read_header(reader), self.header_timeout)
        ticket = header.get("ticket")
        refusal = self.tickets.redeem(ticket)
        if refusal is not None:
            raise _Refused(refusal)
        try:
            options = Options.from_dict(header.get("options", {}))
        except BadRecord as exc:
            raise _Refused(f"bad options: {exc}") from None
        state_header = header["state"]
        sizes = [int(size) for size in header["sizes"]]
        cap = self.byte_cap(int(state_header["num_positions"]))
        if any(size < 0 for size in sizes) or sum(sizes) != body_len or body_len > cap:
            raise _Refused(f"{body_len} bytes of KV for {state_header['num_positions']} positions; this instance "
                           f"takes at most {cap}")
        digest = hmac.new(self.secret, b"kv-body" + header_tag, hashlib.sha256) if self.secret else None
        buffers = []
        for size in sizes:
            buffers.append(await reader.readexactly(size))
            if digest is not None:
                digest.update(buffers[-1])
        body_tag = await reader.readexactly(MAC_BYTES)
        if digest is not None and not hmac.compare_digest(digest.digest(), body_tag):
            raise _Refused("the body's MAC does not match the cluster secret")
        state = HandoffState.from_wire(state_header, buffers, share_prefix=self.secret is not None)
        meta = {"request_id": str(ticket["request_id"]), "attempt": int(ticket["attempt"]),
                "origin": str(ticket["origin"]), "seq": int(header["seq"]), "options": options}
        return await self.handler(meta, state)

    async def _read_header(self, reader: asyncio.StreamReader) -> tuple[dict, bytes, int]:
        """The header (its MAC checked before its JSON is parsed), its MAC, and the body's length."""
        preamble = await reader.readexactly(PREAMBLE_BYTES)
        if not preamble.startswith(MAGIC):
            raise _Refused("not a specdec KV hand-off (bad magic)")
        header_len = int.from_bytes(preamble[len(MAGIC): len(MAGIC) + 4], "big")
        body_len = int.from_bytes(preamble[len(MAGIC) + 4:], "big")
        if header_len > MAX_HEADER_BYTES:
            raise _Refused(f"header of {header_len} bytes is more than {MAX_HEADER_BYTES}")
        header_bytes = await reader.readexactly(header_len)
        header_tag = await reader.readexactly(MAC_BYTES)
        if self.secret is not None and not check_mac(self.secret, header_tag, b"kv-header", preamble, header_bytes):
            raise _Refused("the header's MAC does not match the cluster secret (the instances must share "
                           "--cluster-secret)")
        header = json.loads(header_bytes)
        if not isinstance(header, dict):
            raise _Refused("the header is not a JSON object")
        return header, header_tag, body_len
