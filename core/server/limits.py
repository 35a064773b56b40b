"""What one client can make the server hold or do: the server's limits (docs/server.md, "Server limits").

Two layers, because neither sees everything:

- The app (any ASGI server): :class:`BodyLimitMiddleware` reads each request body before the
  app sees it, counting bytes as they arrive (a ``Content-Length`` over the limit is refused
  before a byte of the body is read; a chunked body is refused as soon as it grows past the
  limit), and refuses a body that stalls or that is not complete by its deadline (a body sent
  a byte every few seconds would otherwise hold its connection for days). The prompt limits
  and the capacity check before tokenizing are in ``app._Handlers``.
- The connection (uvicorn): :class:`LimitedH11Protocol` is uvicorn's h11 protocol with a
  request-head timeout (uvicorn itself never closes a connection that sends half a request
  head, or nothing, and then waits: slowloris), a send timeout (a client that stops reading
  its response is cut off), a connection limit answered with a 503 in the error schema, and a
  lingering close after a refusal, so the client reads the refusal instead of a reset while it
  is still sending its body.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Callable, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import APIError

#: ``--max-body-bytes``: the largest request body, in bytes (4 MiB).
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: ``--max-connections``: open HTTP connections; more are answered 503 and closed.
DEFAULT_MAX_CONNECTIONS = 2048
#: ``--read-timeout``: seconds a client may take to send a request head, and may pause while
#: sending a body.
DEFAULT_READ_TIMEOUT = 10.0
#: ``--body-timeout``: seconds from the end of a request's head until its whole body must have
#: arrived (a 4 MiB body then needs about 70 KB/s).
DEFAULT_BODY_TIMEOUT = 60.0
#: ``--send-timeout``: seconds a client may leave the server's response unread (the socket's
#: buffers full) before the connection is cut and its request aborted.
DEFAULT_SEND_TIMEOUT = 30.0
#: What uvicorn may hold for a connection beyond the kernel's socket buffer before its writes
#: wait (asyncio's default is 64 KiB): the send timeout starts there.
WRITE_BUFFER_HIGH = 4 * 1024

#: Called with the HTTP status of each refusal (``ServerMetrics.request_rejected``).
OnReject = Optional[Callable[[int], None]]


@dataclass(frozen=True)
class ServerLimits:
    """The limits of one server; every field is a ``specdec serve`` flag.

    :ivar max_body_bytes: the largest request body; a larger one gets 413 ``request_too_large``.
    :ivar max_prompt_chars: the longest prompt in characters (a completion's ``prompt`` string,
        or the characters of all chat ``messages`` contents together), checked before
        tokenizing; a longer one gets 400 ``context_length_exceeded``. ``None``: derived from
        the model by :func:`default_max_prompt_chars`.
    :ivar max_connections: open HTTP connections; a request on a connection beyond them gets
        503 ``too_many_connections`` and the connection is closed.
    :ivar read_timeout: seconds from a connection's start (or the first byte of a keep-alive
        connection's next request) until the request head is complete, and the longest pause
        while a body is sent. A head that is late gets 408 ``request_timeout`` (a connection
        that sent nothing is just closed); so does a body that stalls.
    :ivar body_timeout: seconds from the end of the request head until the whole body has
        arrived, however steadily it trickles; a body still incomplete then gets 408
        ``request_timeout``. With ``read_timeout`` it bounds how long one request can hold a
        connection before the app answers.
    :ivar send_timeout: seconds the server may wait for a client to read its response: once
        the socket's buffers are full, a client that takes nothing for this long is
        disconnected, which aborts its request (its batch slot and KV blocks are freed).
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: Optional[int] = None
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    read_timeout: float = DEFAULT_READ_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    send_timeout: float = DEFAULT_SEND_TIMEOUT

    def __post_init__(self):
        for name, low in (("max_body_bytes", 1), ("max_prompt_chars", 1), ("max_connections", 1)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        for name in ("read_timeout", "body_timeout", "send_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def longest_token_chars(tokenizer) -> int:
    """The most characters any one token of ``tokenizer`` covers (an upper bound).

    For byte-level BPE the vocabulary strings have one character per byte, so their length
    bounds the characters a token decodes to; SentencePiece pieces (``▁the``) are the text
    itself, a byte-fallback piece (``<0x0A>``) is longer than its one byte; special tokens are
    matched as their literal text.
    """
    return max((len(piece) for piece in tokenizer.hf_tokenizer.get_vocab()), default=1)


def default_max_prompt_chars(max_model_len: int, tokenizer) -> int:
    """``--max-prompt-chars`` when not given: ``max_model_len`` times the longest token in
    characters. A longer prompt needs more than ``max_model_len`` tokens whatever it holds, so
    this refuses no prompt that fits the context (SmolLM2: 8192 x 81 = 663,552 characters; its
    longest token is a newline and 80 spaces), and it bounds what tokenizing one prompt costs."""
    return max_model_len * longest_token_chars(tokenizer)


# -- the app: request bodies -------------------------------------------------------------------


class BodyLimitMiddleware:
    """Reads the whole request body, within ``max_body_bytes``, ``read_timeout`` and
    ``body_timeout``, before the app runs; then hands it to the app in one message.

    A ``Content-Length`` over the limit is refused at once, before the body is read; a body
    without one (chunked) is counted as it arrives and refused as soon as it passes the limit,
    so the server never holds more than ``max_body_bytes`` of it. 413 ``request_too_large``;
    a body that pauses longer than ``read_timeout``, or is not complete ``body_timeout``
    seconds after the head, gets 408 ``request_timeout``. Both close the connection
    (``Connection: close``).
    """

    def __init__(self, app, *, max_body_bytes: int, read_timeout: float,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT, on_reject: OnReject = None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout
        self.body_timeout = body_timeout
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope["headers"])
        if length is not None and length > self.max_body_bytes:
            await self._refuse(413, f"the request body: {length} bytes is more than this server takes "
                                    f"({self.max_body_bytes} bytes, --max-body-bytes)", "request_too_large",
                               scope, receive, send)
            return
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        while True:
            left = deadline - loop.time()
            try:
                message = await asyncio.wait_for(receive(), min(self.read_timeout, max(left, 0.0)))
            except asyncio.TimeoutError:
                if left <= self.read_timeout:
                    problem, flag = f"not complete within {self.body_timeout:g} s", "--body-timeout"
                else:
                    problem, flag = f"nothing arrived for {self.read_timeout:g} s", "--read-timeout"
                await self._refuse(408, f"the request body: {problem} ({flag})", "request_timeout",
                                   scope, receive, send)
                return
            if message["type"] != "http.request":  # the client has gone: nobody to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._refuse(413, f"the request body: more than this server takes "
                                        f"({self.max_body_bytes} bytes, --max-body-bytes)", "request_too_large",
                                   scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()  # after the body: http.disconnect, when the client goes
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, status: int, message: str, code: str, scope, receive, send) -> None:
        if self.on_reject is not None:
            self.on_reject(status)
        response = APIError(status, message, code=code).response()
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def _content_length(headers) -> Optional[int]:
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # h11 refuses these before the app runs
                return None
    return None


# -- the connection: uvicorn's h11 protocol with a head timeout and a connection limit --------


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with five additions (:func:`limited_protocol` makes the class
    for given limits; pass it to ``uvicorn.Config(http=...)``):

    - **Request-head timeout.** A timer starts when the connection opens, and when the first
      byte of a keep-alive connection's next request arrives; it stops once the request head
      is complete. When it fires, a connection that sent part of a head gets 408
      ``request_timeout`` and is closed; one that sent nothing is closed. The timer counts the
      whole head, so a client trickling a byte at a time is closed too. (Idle keep-alive
      connections are closed by uvicorn's own keep-alive timeout, 5 s.)
    - **Send timeout.** When the client stops reading, the kernel's socket buffers fill, then
      uvicorn's own (``WRITE_BUFFER_HIGH``), and the response's writes wait. If nothing of that
      drains for ``send_timeout`` seconds the connection is aborted: the app sees the client
      gone, and the request is aborted as for any disconnect. (Without this, a stalled reader
      kept its connection forever: even a finished response waits in the buffer to be sent.)
    - **Connection limit.** A connection opened while ``max_connections`` are open is served
      503 ``too_many_connections`` (with ``Connection: close``) for its first request.
    - **Lingering close.** When the server closes a connection while the client is still
      sending a request body (a 413, a 503, a 408), it sends its response and a FIN, then
      reads and drops what still arrives for up to ``read_timeout`` seconds before closing.
      Closing at once would make the kernel answer the unread data with a reset, and the
      client would see a broken connection instead of the response.
    - **Unparsable requests** (not HTTP/1.1, or a head over h11's 16 KiB) get their 400 in the
      error schema, ``invalid_http_request``, rather than uvicorn's plain text.
    """

    read_timeout: float = DEFAULT_READ_TIMEOUT
    send_timeout: float = DEFAULT_SEND_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    on_reject: OnReject = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_timer: Optional[asyncio.TimerHandle] = None
        self._linger_timer: Optional[asyncio.TimerHandle] = None
        self._send_timer: Optional[asyncio.TimerHandle] = None
        self._lost = False

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        # Low water 0: writing resumes (and the send timer stops) only once the client has
        # taken everything buffered, so a client reading a byte now and then cannot keep it.
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH, low=0)
        super().connection_made(transport)
        self.transport = _LingeringTransport(transport, self)
        if len(self.connections) > self.max_connections:
            self.app = self._too_many_connections
        self._start_head_timer()

    def connection_lost(self, exc) -> None:
        self._lost = True
        self._stop_head_timer()
        self._stop_send_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.lingering:
            return  # the response has gone out: drop the rest of the body
        if self._head_timer is None and self.conn.their_state is h11.IDLE:
            self._start_head_timer()  # the first byte of a keep-alive connection's next request
        super().data_received(data)
        self._check_head()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None and not self._lost:
            self._send_timer = self.loop.call_later(self.send_timeout, self._send_timed_out)

    def resume_writing(self) -> None:
        self._stop_send_timer()
        super().resume_writing()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._check_head()  # a pipelined request may be partly buffered already

    def shutdown(self) -> None:
        if self.transport.lingering:
            self.transport.force_close()
            return
        super().shutdown()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer when h11 cannot parse the request, in the error schema."""
        if self.on_reject is not None:
            self.on_reject(400)
        payload = json.dumps(APIError(400, "the request is not valid HTTP/1.1, or its head is larger than 16 KiB",
                                      code="invalid_http_request").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=payload),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # the app's response had begun already
            pass
        self.transport.close()

    # -- the head timer ------------------------------------------------------------------------

    def _start_head_timer(self) -> None:
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self.read_timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _check_head(self) -> None:
        """Stop the timer once a head is complete; start it for a partly received one."""
        if self.conn.their_state is not h11.IDLE:
            self._stop_head_timer()
        elif self._head_timer is None and self.conn.trailing_data[0] and not self.transport.is_closing():
            self._start_head_timer()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a head: say why before closing
            if self.on_reject is not None:
                self.on_reject(408)
            body = APIError(408, f"the request head did not arrive within {self.read_timeout:g} s (--read-timeout)",
                            code="request_timeout").body()
            self.transport.write(_raw_response(408, "Request Timeout", body))
        self.transport.force_close()

    # -- the send timer ------------------------------------------------------------------------

    def _stop_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timed_out(self) -> None:
        """The client has read nothing for ``send_timeout`` seconds: drop what waits for it
        and close (``abort``: a plain close would wait for the buffer to drain, forever)."""
        self._send_timer = None
        self.logger.info("%s:%s - the client read nothing for %g s (--send-timeout): connection closed",
                         *(self.client or ("?", 0)), self.send_timeout)
        self.transport.abort()

    # -- over the connection limit -------------------------------------------------------------

    async def _too_many_connections(self, scope, receive, send) -> None:
        if self.on_reject is not None:
            self.on_reject(503)
        response = APIError(503, f"too many connections: the server holds {self.max_connections} "
                                 "(--max-connections); retry later", code="too_many_connections").response()
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def limited_protocol(limits: ServerLimits, on_reject: OnReject = None) -> type[LimitedH11Protocol]:
    """The :class:`LimitedH11Protocol` class for ``limits``: ``uvicorn.Config(app, http=...)``."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {
        "read_timeout": limits.read_timeout, "send_timeout": limits.send_timeout,
        "max_connections": limits.max_connections,
        "on_reject": staticmethod(on_reject) if on_reject is not None else None,
    })


class _LingeringTransport:
    """The connection's transport as uvicorn's protocol sees it: ``close()`` lingers (see
    :class:`LimitedH11Protocol`) while the client is still sending a body."""

    def __init__(self, transport, protocol: LimitedH11Protocol):
        self._transport = transport
        self._protocol = protocol
        self.lingering = False

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.lingering:
            return
        protocol = self._protocol
        if (protocol.conn.their_state is h11.SEND_BODY and not protocol._lost and not self._transport.is_closing()
                and self._transport.can_write_eof()):
            self.lingering = True
            protocol._stop_head_timer()
            self._transport.resume_reading()  # uvicorn pauses reading while a body waits to be read
            self._transport.write_eof()  # the response, then FIN; reading goes on
            protocol._linger_timer = protocol.loop.call_later(protocol.read_timeout, self.force_close)
            return
        self._transport.close()

    def force_close(self) -> None:
        self._transport.close()


def _raw_response(status: int, reason: str, body: dict) -> bytes:
    """A whole HTTP/1.1 response with a JSON body and ``Connection: close``, as bytes."""
    payload = json.dumps(body).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n"
            f"connection: close\r\n\r\n").encode() + payload
