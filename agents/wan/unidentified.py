"""Closing the connections to a listener that never identify themselves (strangers).

Written here because libzmq has no per-socket connection limit nor a way to drop one peer; see
:class:`Unidentified`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections import OrderedDict
from collections.abc import Callable, Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from geosched.ratelimit import AddressShares

log = logging.getLogger(__name__)

MAX_UNIDENTIFIED = 64
"""Connections a listener holds that have not identified themselves; beyond, the oldest is closed."""
MAX_UNIDENTIFIED_PER_ADDRESS = 16
"""Of those, what one client address may hold (a WAN listener's); beyond, its oldest is closed."""


class Unidentified:
    """The accepted connections of one listener that no accepted frame has come from yet, by descriptor.

    libzmq's ROUTER keeps every TCP connection that completed the ZMTP handshake, whether it says anything or
    not, and offers no call to close one peer's connection. A stranger could hold idle connections until the
    listener runs out of descriptors (then no genuine peer can connect), or keep one connection sending a
    multipart message that never ends. So the listener (a WanLink's, :mod:`agents.wan.io`; a prefill
    endpoint's, :mod:`agents.prefill.service`) notes each accepted connection's descriptor (its monitor's
    ACCEPTED event) until a frame from it is accepted (a stream's hello, an authenticated request); a connection
    still unidentified after its timeout, or the oldest beyond :data:`MAX_UNIDENTIFIED`, is shut down:
    ``shutdown(2)`` on a duplicate of its descriptor, after checking that it is a TCP connection to this
    listener's port; libzmq sees its peer hang up and closes its own descriptor. With ``per_address``, one
    client address holds at most that many of them, beyond which its own oldest is closed: a stranger opening
    connections as fast as they close pushes out only its own (and those of its address: a peer behind the
    same NAT still gets in, as the newest), not a genuine peer's from elsewhere.

    A connection's ACCEPTED event and its first frames come from different libzmq threads (the listener's and
    the connection's I/O thread), so the first frame can be read before the event: a connection identified
    that way is not taken for a stranger when its event comes (it was, and was cut at the timeout).
    """

    def __init__(
        self,
        timeout_s: float,
        per_address: int | None = None,
        *,
        port: int = 0,
        read_events: Callable[[], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.port = port  # the listener's, once bound: only connections to it are ever shut down
        self._read_events = read_events  # takes in the listener's pending monitor events (see identified)
        self.closed = 0  # connections shut down so far
        self._since: dict[int, float] = {}  # descriptor -> when it was accepted
        self._shares = AddressShares(per_address) if per_address else None
        self._address: dict[int, str] = {}  # descriptor -> the client address its share is counted against
        self._open: dict[int, bytes] = {}  # descriptor -> routing id of the identified connection on it
        self._gone: OrderedDict[bytes, None] = OrderedDict()  # libzmq's ids of identified connections since closed

    def accepted(self, fd: int, now: float) -> None:
        """A connection was accepted on ``fd``; beyond MAX_UNIDENTIFIED the oldest waiting one is closed, and
        beyond ``per_address`` from its address that address's oldest."""
        if fd in self._open:  # the event of a connection whose first frame was read before it
            return
        if self._shares is not None and (address := self._peer(fd)) is not None:
            if not self._shares.take(address):  # its oldest goes: a peer sharing a stranger's address still gets in
                oldest = next(f for f, a in self._address.items() if a == address)
                self.close(oldest, f"more than {self._shares.per_address} unidentified connections from {address}")
                self._shares.take(address)
            self._address[fd] = address
        self._since[fd] = now
        while len(self._since) > MAX_UNIDENTIFIED:
            self.close(next(iter(self._since)), "too many connections that have not identified themselves")

    def read_events(self, monitor: zmq.Socket[bytes], now: float) -> None:
        """Take in a listener's monitor events (:func:`agents.sockets.monitor_events`) until none is waiting:
        accepted connections are noted, closed ones forgotten (for a listener with nothing else to watch)."""
        while True:
            try:
                message = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if message["event"] == zmq.EVENT_ACCEPTED:
                self.accepted(message["value"], now)
            elif message["event"] == zmq.EVENT_DISCONNECTED:
                self.gone(message["value"])

    def identified(self, fd: int, peer: bytes) -> bool:
        """A frame from connection ``peer`` (its routing id) on ``fd`` was accepted (a stream's hello, an
        authenticated request): it is no stranger. True the first time for that connection; False for its later
        frames, also those read after it closed. Where ``fd`` still holds another identified connection, whose
        close is then waiting in the listener's monitor (libzmq reports a close before it frees the descriptor),
        the constructor's ``read_events`` takes that in first."""
        if self._open.get(fd) == peer or peer in self._gone:
            return False
        if fd in self._open and self._read_events is not None:
            self._read_events()
        if (old := self._open.get(fd)) is not None:
            self._closed_identified(old)
        self._open[fd] = peer
        self._forget(fd)
        return True

    def gone(self, fd: int) -> None:
        """The connection on ``fd`` closed (the descriptor may be reused by the next one)."""
        if (peer := self._open.pop(fd, None)) is not None:
            self._closed_identified(peer)
        self._forget(fd)

    def _closed_identified(self, peer: bytes) -> None:
        """Remember a few recent closed connections by routing id, to know their frames read after the close:
        only libzmq's own ids (a zero byte first), new for every connection; a peer that sets its id keeps it when
        it reconnects."""
        if peer[:1] == b"\0":
            self._gone[peer] = None
            while len(self._gone) > MAX_UNIDENTIFIED:
                self._gone.popitem(last=False)

    def _forget(self, fd: int) -> None:
        self._since.pop(fd, None)
        if (address := self._address.pop(fd, None)) is not None and self._shares is not None:
            self._shares.give_back(address)

    def expire(self, now: float) -> None:
        """Close the connections unidentified for longer than ``timeout_s``."""
        for fd in [fd for fd, since in self._since.items() if now - since > self.timeout_s]:
            self.close(fd, f"not identified within {self.timeout_s:g} s")

    def close(self, fd: int, why: str) -> None:
        """Shut the connection on ``fd`` down (if it still is a TCP connection to this listener's port)."""
        self._forget(fd)
        self._shut(fd, why)

    def _shut(self, fd: int, why: str) -> None:
        with self._connection(fd) as conn:
            if conn is not None:
                with contextlib.suppress(OSError):  # not connected (any more)
                    conn.shutdown(socket.SHUT_RDWR)
                    self.closed += 1
                    log.debug("closing a connection to port %d: %s", self.port, why)

    def _peer(self, fd: int) -> str | None:
        """The client address of the connection on ``fd`` (None if it is not one to this listener any more)."""
        with self._connection(fd) as conn:
            with contextlib.suppress(OSError):
                return str(conn.getpeername()[0]).split("%")[0] if conn is not None else None
        return None

    @contextlib.contextmanager
    def _connection(self, fd: int) -> Iterator[socket.socket | None]:
        """A duplicate of ``fd`` if it is a TCP connection to this listener's port, else None; closed after
        (the duplicate only: libzmq closes its own once it sees a hang-up)."""
        try:
            dup = os.dup(fd)
        except OSError:
            yield None  # already closed
            return
        try:
            conn = socket.socket(fileno=dup)
        except OSError:  # the number was reused by something else than a socket (an eventfd): the dup was leaked
            os.close(dup)
            yield None
            return
        try:
            ours = conn.type == socket.SOCK_STREAM and self.port and conn.getsockname()[1] == self.port
        except OSError:
            ours = False
        try:
            yield conn if ours else None
        finally:
            conn.close()
