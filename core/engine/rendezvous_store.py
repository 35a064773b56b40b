"""The process group's rendezvous store, served by rank 0 on the address it is given.

paddle.distributed's own store server binds every interface (``0.0.0.0``) whatever address the
ranks are told (``TCPServer::create`` listens on ``""``; its libuv variant on ``0.0.0.0``), on
a port chosen beforehand and released until paddle binds it. This module serves the same
store instead: it binds the configured address, port 0 letting the OS choose when no port is
given, and keeps the socket it bound, so that no other process can take the port in between.
Every rank, rank 0 too, joins as a client of it (:func:`connect_as_client`), which paddle's
store supports: only its rank-0 client would have started a server. Each rank opens one
connection, so once ``clients`` have connected the store stops listening: it serves them until
they leave, and nobody else can connect afterwards.

The store runs in a small process of its own (:func:`start_store_process`: this file, run by
path, standard library only), which inherits the bound socket: rank 0's paddle holds the GIL
while it waits for the store, so a thread of rank 0 could not answer it.

The wire protocol is paddle's ``TCPStore`` client's (``paddle/phi/core/distributed/store``):
a command (int32), a key (uint64 length, bytes), and per command an int64 or a uint64-length
byte vector; replies the same way. Keys and values are kept as bytes, never interpreted.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import threading
import time

#: paddle's ``Command`` and ``ReplyType`` (``tcp_store.h``).
ADD, GET, CHECK, SET, WAIT, STOP = range(6)
STOP_WAIT, READY, NOT_READY = 1, 2, 3
#: Bounds on what a client may send (paddle's libuv store has the same two).
MAX_KEY_BYTES = 16 * 1024
MAX_VALUE_BYTES = 16 * 1024 * 1024
#: All values together (gloo's rendezvous stores a few hundred bytes per rank).
MAX_STORED_BYTES = 64 * 1024 * 1024
#: Connections served at once: each rank opens one or two; more is not a rank.
MAX_CONNECTIONS = 64


class ProtocolError(Exception):
    """A client sent something the store protocol does not allow."""


class RendezvousStore:
    """A store server on ``listener`` (a bound, listening socket), until ``clients`` have
    connected (None: until :meth:`close`); serves in threads of this process."""

    def __init__(self, listener: socket.socket, clients: int | None = None):
        self._listener = listener
        self.host, self.port = listener.getsockname()[:2]
        self._open_connections = 0
        self._clients_left = clients
        #: Seconds a rank waits at the rendezvous for the others (paddle's own store's bound).
        self.wait_timeout = float(os.environ.get("FLAGS_stop_check_timeout", "900"))
        self._values: dict[bytes, bytes] = {}
        self._changed = threading.Condition()
        self._connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = False
        threading.Thread(target=self._accept, name="specdec-tp-store", daemon=True).start()

    @classmethod
    def bind(cls, host: str, port: int = 0, clients: int | None = None) -> "RendezvousStore":
        """A store on ``host:port`` (``port`` 0: one the OS picks), listening from now on."""
        return cls(socket.create_server((host, port)), clients)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def done(self) -> bool:
        """Every expected client has come and gone."""
        return self._clients_left == 0 and self._open_connections == 0

    def close(self) -> None:
        """Stop listening and serving."""
        self._closed = True
        self.stop_listening()
        with self._changed:
            self._changed.notify_all()

    def stop_listening(self) -> None:
        """Accept no more connections (those accepted are still served)."""
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            if not self._connections.acquire(blocking=False):
                connection.close()
                continue
            with self._changed:
                self._open_connections += 1
            threading.Thread(target=self._serve, args=(connection,), name="specdec-tp-store-client",
                             daemon=True).start()
            if self._clients_left is not None:
                self._clients_left -= 1
                if self._clients_left == 0:
                    self.stop_listening()
                    return

    def _serve(self, connection: socket.socket) -> None:
        try:
            with connection:
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while not self._closed and self._command(connection):
                    pass
        except (OSError, ProtocolError, ValueError, struct.error):
            pass  # a client gone, or one that broke the protocol (e.g. an add to a non-number): drop it
        finally:
            with self._changed:
                self._open_connections -= 1
            self._connections.release()

    def _command(self, connection: socket.socket) -> bool:
        """Serve one command; False when the client is done."""
        header = _receive(connection, 4, allow_eof=True)
        if header is None:
            return False
        (command,) = struct.unpack("<i", header)
        if command == STOP:
            return False
        if command not in (ADD, GET, CHECK, SET, WAIT):
            raise ProtocolError(f"unknown command {command}")
        key = _receive_bytes(connection, MAX_KEY_BYTES)
        if command == ADD:
            (amount,) = struct.unpack("<q", _receive(connection, 8))
            with self._changed:
                value = int(self._values.get(key, b"0")) + amount
                self._values[key] = str(value).encode()
                self._changed.notify_all()
            connection.sendall(struct.pack("<q", value))
        elif command == SET:
            value = _receive_bytes(connection, MAX_VALUE_BYTES)
            with self._changed:
                stored = sum(map(len, self._values.values())) - len(self._values.get(key, b""))
                if stored + len(value) > MAX_STORED_BYTES:
                    raise ProtocolError("the store is full")
                self._values[key] = value
                self._changed.notify_all()
        elif command == GET:
            with self._changed:
                value = self._values.get(key)
            if value is None:
                raise ProtocolError("get of a missing key")  # paddle's client waits first
            connection.sendall(struct.pack("<Q", len(value)) + value)
        elif command == CHECK:
            with self._changed:
                present = key in self._values
            connection.sendall(struct.pack("<i", READY if present else NOT_READY))
        else:  # WAIT: answer once the key is set; paddle's client waits as long as it takes
            with self._changed:
                if not self._changed.wait_for(lambda: key in self._values or self._closed, self.wait_timeout):
                    raise ProtocolError("a rank never came")  # dropped: the waiting rank's join fails
            connection.sendall(struct.pack("<i", STOP_WAIT))
        return True


def _receive(connection: socket.socket, size: int, allow_eof: bool = False):
    data = bytearray()
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            if allow_eof and not data:
                return None
            raise ProtocolError("connection closed mid-message")
        data += chunk
    return bytes(data)


def _receive_bytes(connection: socket.socket, limit: int) -> bytes:
    (size,) = struct.unpack("<Q", _receive(connection, 8))
    if size > limit:
        raise ProtocolError(f"{size} bytes, more than {limit}")
    return _receive(connection, size)


class StoreProcess:
    """A :class:`RendezvousStore` in a process of its own, on ``host:port`` (``port`` 0: one
    the OS picks). The socket is bound here, before the process starts, and handed to it:
    the port is held from the first moment. The process ends once ``clients`` have come and
    gone, or when this process ends."""

    def __init__(self, host: str, port: int = 0, clients: int = 1):
        with socket.create_server((host, port)) as listener:
            self.host, self.port = listener.getsockname()[:2]
            self.process = subprocess.Popen(
                [sys.executable, "-I", __file__, str(listener.fileno()), str(clients), str(os.getpid())],
                pass_fds=(listener.fileno(),), stdin=subprocess.DEVNULL)
        # This process's copy of the socket is closed: the store's process alone listens.

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def _serve_inherited(fd: int, clients: int, parent: int) -> None:
    """The store process: serve on the inherited socket ``fd`` until ``clients`` have come
    and gone, or the process ``parent`` (rank 0) has ended."""
    store = RendezvousStore(socket.socket(fileno=fd), clients)
    while not store.done and os.getppid() == parent:
        time.sleep(0.5)
    store.close()


def connect_as_client(paddle) -> None:
    """Make this process's paddle store a client of the store its environment names
    (``PADDLE_MASTER``, else the first of ``PADDLE_TRAINER_ENDPOINTS``), whatever its rank.

    paddle keeps one store per process, made by its first use (``init_parallel_env`` asks for
    it, and would make rank 0's start paddle's own server on every interface); made here first
    under a nonzero rank, rank 0's is a client too, and ``init_parallel_env`` then uses it."""
    saved = os.environ.get("PADDLE_TRAINER_ID")
    os.environ["PADDLE_TRAINER_ID"] = "1"  # any rank but 0: the store's role only
    try:
        paddle.base.core.create_or_get_global_tcp_store()
    finally:
        if saved is None:
            os.environ.pop("PADDLE_TRAINER_ID", None)
        else:
            os.environ["PADDLE_TRAINER_ID"] = saved


if __name__ == "__main__":  # run by path by StoreProcess: imports nothing of specdec
    _serve_inherited(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
