"""The tensor-parallel rendezvous store: on the address it is given, from a socket it keeps.

paddle's own store server binds every interface, on a port picked earlier and released until
it binds it. specdec's is bound to loopback from construction on (no moment when another
process could take its port), speaks paddle's store protocol to paddle's real client, and
stops listening once the expected ranks have connected.
"""

from __future__ import annotations

import socket
import struct

import pytest

from specdec.engine.rendezvous_store import MAX_KEY_BYTES, SET, WAIT, RendezvousStore, StoreProcess


def _listening(port: int) -> list[str]:
    """The local addresses listening on TCP ``port`` (from /proc/net/tcp: state 0A)."""
    found = []
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.append(socket.inet_ntoa(struct.pack("<I", int(address, 16))))
    return found


def test_it_listens_on_loopback_only_from_the_start_then_stops_after_its_clients():
    paddle = pytest.importorskip("paddle")
    store = RendezvousStore.bind("127.0.0.1", clients=1)
    try:
        assert store.host == "127.0.0.1" and store.port > 0
        assert _listening(store.port) == ["127.0.0.1"]  # bound already: nobody can take the port
        client = paddle.base.core.TCPStore("127.0.0.1", store.port, False, 1, 30)  # paddle's own client
        client.set("key", "value")
        assert client.get("key") == b"value"
        assert client.add("counter", 2) == 2 and client.add("counter", 3) == 5
        client.wait("key")
        assert _listening(store.port) == []  # its one client came: it listens no more
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", store.port), timeout=5)
        assert client.add("counter", 1) == 6  # the client it has is still served
    finally:
        store.close()


def test_the_store_process_holds_its_port_before_it_starts_and_ends_after_its_clients():
    """What rank 0 runs: the socket is bound before the store's process starts (no moment
    when the port is free), and the process ends once its clients have come and gone."""
    paddle = pytest.importorskip("paddle")
    store = StoreProcess("127.0.0.1", clients=1)
    try:
        assert _listening(store.port) == ["127.0.0.1"]
        client = paddle.base.core.TCPStore("127.0.0.1", store.port, False, 1, 30)
        client.set("rank", "0")
        assert client.get("rank") == b"0"
        del client  # the rank leaves
        assert store.process.wait(timeout=10) == 0
        assert _listening(store.port) == []
    finally:
        store.stop()


def test_a_client_that_sends_an_oversized_key_is_dropped():
    store = RendezvousStore.bind("127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", store.port), timeout=5) as attacker:
            attacker.sendall(struct.pack("<iQ", SET, MAX_KEY_BYTES + 1))
            assert attacker.recv(1) == b""  # closed without reading (or allocating) the key
    finally:
        store.close()


def test_a_rank_waiting_for_one_that_never_comes_is_dropped_after_the_timeout():
    store = RendezvousStore.bind("127.0.0.1")
    store.wait_timeout = 0.2
    try:
        with socket.create_connection(("127.0.0.1", store.port), timeout=5) as rank:
            rank.sendall(struct.pack("<iQ", WAIT, 5) + b"/rank")
            assert rank.recv(4) == b""  # dropped, so that paddle's join fails instead of waiting forever
    finally:
        store.close()
