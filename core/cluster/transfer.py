"""The direct channel that moves a handed-off request's KV blocks from a prefill instance to a
decode instance: one TCP connection per hand-off.

Control goes through Redis, but the blocks do not: the default model's float16 KV is 23 KB
per token, and Redis would hold and copy every byte twice. TCP works
between machines as well as on one (docs/deployment.md has the measured bandwidth).

The wire format, after the magic line ``SPECDEC-KV/1\\n``:

    8 bytes   header length, big-endian
    header    JSON: {"meta": {...}, "state": HandoffState header, "sizes": [bytes of each buffer],
                     "key": the API key's SHA-256 when the cluster has one}
    buffers   the raw bytes of each buffer of ``HandoffState.to_wire()``, in order

and the receiver answers one JSON line, ``{"ok": true}`` or ``{"ok": false, "error": "..."}``,
once the request runs on its engine (or could not be taken). A malformed or oversized message
gets an error answer and the connection closes; it touches no other request.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from typing import Awaitable, Callable, Optional

import attrs

from ..engine.handoff import HandoffState

logger = logging.getLogger("specdec.cluster")

MAGIC = b"SPECDEC-KV/1\n"
#: The largest header accepted (prompt ids and sampling parameters fit in far less).
MAX_HEADER_BYTES = 16 * 2**20
#: Seconds a hand-off may take, connection to answer.
TRANSFER_TIMEOUT_S = 60.0


class TransferError(Exception):
    """The hand-off did not reach the decode instance, or it refused the request."""


@attrs.frozen
class TransferStats:
    """One hand-off: bytes of KV (and hidden states) sent, and seconds from connect to answer."""

    num_bytes: int
    seconds: float


def key_digest(api_key: Optional[str]) -> Optional[str]:
    return hashlib.sha256(api_key.encode()).hexdigest() if api_key else None


async def send_handoff(address: str, meta: dict, state: HandoffState, api_key: Optional[str] = None,
                       timeout: float = TRANSFER_TIMEOUT_S) -> TransferStats:
    """Send ``state`` (with ``meta``: the request's id, attempt, origin and next event number)
    to the transfer listener at ``HOST:PORT``; returns once the decode instance runs it."""
    host, _, port = address.rpartition(":")
    header, buffers = state.to_wire()
    body = json.dumps({"meta": meta, "state": header, "sizes": [int(b.nbytes) for b in buffers],
                       "key": key_digest(api_key)}).encode()
    started = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout=5.0)
    except (OSError, asyncio.TimeoutError, ValueError) as exc:
        raise TransferError(f"cannot connect to {address}: {exc or type(exc).__name__}") from None
    try:
        writer.write(MAGIC + len(body).to_bytes(8, "big") + body)
        for buffer in buffers:
            writer.write(memoryview(buffer).cast("B"))
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
    return TransferStats(sum(int(b.nbytes) for b in buffers), time.perf_counter() - started)


Handler = Callable[[dict, HandoffState], Awaitable[Optional[str]]]


class TransferServer:
    """Listens for hand-offs; ``handler(meta, state)`` starts the request and returns None, or
    a one-line reason it could not.

    :param max_bytes: the most buffer bytes one hand-off may carry (the KV pool's size, say).
    """

    def __init__(self, host: str, port: int, handler: Handler, max_bytes: int, api_key: Optional[str] = None):
        self.host, self.port = host, port
        self.handler = handler
        self.max_bytes = max_bytes
        self.expected_key = key_digest(api_key)
        self._server: Optional[asyncio.AbstractServer] = None

    async def start(self) -> tuple[str, int]:
        """Listen; returns the bound address (port 0 picks a free one)."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=2**26)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.port = port
        return host, port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            error = await asyncio.wait_for(self._receive(reader), timeout=TRANSFER_TIMEOUT_S)
        except asyncio.TimeoutError:
            error = "timed out reading the hand-off"
        except (asyncio.IncompleteReadError, ConnectionError):
            error = "the sender closed the connection mid-message"
        except Exception as exc:  # noqa: BLE001 - a bad message is the sender's problem, not ours
            logger.warning("kv transfer: bad hand-off", exc_info=exc)
            error = f"bad hand-off: {type(exc).__name__}: {' '.join(str(exc).split())}"
        try:
            writer.write(json.dumps({"ok": error is None, "error": error}).encode() + b"\n")
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _receive(self, reader: asyncio.StreamReader) -> Optional[str]:
        if await reader.readexactly(len(MAGIC)) != MAGIC:
            return "not a specdec KV hand-off (bad magic)"
        length = int.from_bytes(await reader.readexactly(8), "big")
        if length > MAX_HEADER_BYTES:
            return f"header of {length} bytes is more than {MAX_HEADER_BYTES}"
        header = json.loads(await reader.readexactly(length))
        if self.expected_key is not None and header.get("key") != self.expected_key:
            return "wrong or missing cluster key (the instances must share --api-key)"
        sizes = [int(size) for size in header["sizes"]]
        if any(size < 0 for size in sizes) or sum(sizes) > self.max_bytes:
            return f"{sum(sizes)} bytes of KV is more than this instance's pool holds ({self.max_bytes})"
        buffers = [await reader.readexactly(size) for size in sizes]
        state = HandoffState.from_wire(header["state"], buffers)
        return await self.handler(header["meta"], state)
