"""agents.wan.unidentified: which accepted connections are strangers, whatever order libzmq reports them in.

Real TCP connections to a real listening socket: the descriptors are the accepted ones, so a connection the
tracker closes is really shut down (its client reads end-of-file).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from agents.wan.unidentified import Unidentified

AUTO_A, AUTO_B = b"\0\x00\x00\x00\x01", b"\0\x00\x00\x00\x02"  # libzmq's own routing ids: new for every connection


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server


def _connect(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    client.settimeout(2.0)
    return client, accepted


def _was_shut(client: socket.socket) -> bool:
    client.settimeout(0.2)
    try:
        return client.recv(1) == b""
    except TimeoutError:
        return False


def test_a_connection_whose_first_frame_came_before_its_accepted_event_is_no_stranger(
    listener: socket.socket,
) -> None:
    """libzmq reports ACCEPTED from the listener's I/O thread and frames from the connection's: a stream's hello
    was read first, its ACCEPTED then made it a stranger, and it was cut at the timeout (1 in 25-100 idle links
    on a loaded 2-core host)."""
    strangers = Unidentified(1.0, port=listener.getsockname()[1])
    client, conn = _connect(listener)
    with client, conn:
        assert strangers.identified(conn.fileno(), AUTO_A)
        strangers.accepted(conn.fileno(), now=0.0)  # its event, late
        strangers.expire(now=10.0)
        assert strangers.closed == 0 and not _was_shut(client)
        assert not strangers.identified(conn.fileno(), AUTO_A)  # its later frames: known


def test_the_next_connection_on_a_reused_descriptor_is_a_stranger_again(listener: socket.socket) -> None:
    """After an identified connection closes, a stranger that gets its descriptor is tracked, also when a frame
    of the closed one is read after its close (with libzmq's own ids, which a new connection never reuses)."""
    strangers = Unidentified(1.0, port=listener.getsockname()[1])
    client, conn = _connect(listener)
    with client, conn:
        fd = conn.fileno()
        strangers.accepted(fd, now=0.0)
        assert strangers.identified(fd, AUTO_A)
        strangers.gone(fd)
        assert not strangers.identified(fd, AUTO_A)  # a frame of the closed one, read late
        strangers.accepted(fd, now=5.0)  # the stranger on the same descriptor
        strangers.expire(now=10.0)
        assert strangers.closed == 1 and _was_shut(client)


def test_a_peer_that_sets_its_own_id_is_identified_again_when_it_reconnects(listener: socket.socket) -> None:
    """A WanLink stream without a seal keeps its routing id across reconnects: its new connection is no
    stranger, though one with that id closed before."""
    strangers = Unidentified(1.0, port=listener.getsockname()[1])
    client, conn = _connect(listener)
    with client, conn:
        fd = conn.fileno()
        strangers.accepted(fd, now=0.0)
        assert strangers.identified(fd, b"session-0")
        strangers.gone(fd)
        strangers.accepted(fd, now=5.0)
        assert strangers.identified(fd, b"session-0")
        strangers.expire(now=10.0)
        assert strangers.closed == 0 and not _was_shut(client)


def test_a_new_connection_on_a_descriptor_whose_close_is_unread_reads_the_pending_events(
    listener: socket.socket,
) -> None:
    """A frame of a new connection on a descriptor still held by an identified one: the old one's close is
    waiting in the monitor (libzmq reports a close before it frees the descriptor); it is read first."""
    read: list[int] = []

    def pending_events() -> None:  # the old connection's close, waiting in the monitor
        read.append(fd)
        strangers.gone(fd)

    strangers = Unidentified(1.0, port=listener.getsockname()[1], read_events=pending_events)
    client, conn = _connect(listener)
    with client, conn:
        fd = conn.fileno()
        strangers.accepted(fd, now=0.0)
        strangers.identified(fd, AUTO_A)
        assert read == []  # its own descriptor: nothing to read first
        assert strangers.identified(fd, AUTO_B)
        assert read == [fd]
        strangers.accepted(fd, now=1.0)  # the new one's event, late: it is identified already
        strangers.expire(now=10.0)
        assert strangers.closed == 0 and not _was_shut(client)
