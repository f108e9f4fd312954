"""Connections to a listening WanLink that have not identified themselves: timed out and bounded.

libzmq's ROUTER keeps every TCP connection that completed the ZMTP handshake, whether it says anything or
not, and offers no call to close one peer's connection. A stranger could hold idle connections until the
listener runs out of descriptors (then no genuine stream can connect), or keep one connection sending a
multipart message that never ends. So the listener notes each accepted connection's descriptor (its
monitor's ACCEPTED event) until a frame from it is accepted as one of the link's streams; a connection
still unidentified after ``hello_timeout_s``, or the oldest beyond :data:`MAX_UNIDENTIFIED`, is shut down:
``shutdown(2)`` on a duplicate of its descriptor, after checking that it is a TCP connection to this
listener's port; libzmq sees its peer hang up and closes its own descriptor.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

MAX_UNIDENTIFIED = 64
"""Connections a listener holds that have not identified as one of its streams; beyond, the oldest is closed."""


class Unidentified:
    """The accepted connections of one listener that no accepted frame has come from yet, by descriptor."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.port = 0  # the listener's, once bound: only connections to it are ever shut down
        self.closed = 0  # connections shut down so far
        self._since: dict[int, float] = {}  # descriptor -> when it was accepted

    def accepted(self, fd: int, now: float) -> None:
        """A connection was accepted on ``fd``; beyond MAX_UNIDENTIFIED the oldest waiting one is closed."""
        self._since[fd] = now
        while len(self._since) > MAX_UNIDENTIFIED:
            self.close(next(iter(self._since)), "too many connections that have not said hello")

    def identified(self, fd: int) -> None:
        """A frame from ``fd`` was accepted as a stream's: it is no stranger."""
        self._since.pop(fd, None)

    def gone(self, fd: int) -> None:
        """The connection on ``fd`` closed (the descriptor may be reused by the next one)."""
        self._since.pop(fd, None)

    def expire(self, now: float) -> None:
        """Close the connections unidentified for longer than ``timeout_s``."""
        for fd in [fd for fd, since in self._since.items() if now - since > self.timeout_s]:
            self.close(fd, f"no hello within {self.timeout_s:g} s")

    def close(self, fd: int, why: str) -> None:
        """Shut the connection on ``fd`` down (if it still is a TCP connection to this listener's port)."""
        self._since.pop(fd, None)
        try:
            conn = socket.socket(fileno=os.dup(fd))
        except OSError:
            return  # already closed
        try:
            if conn.type == socket.SOCK_STREAM and self.port and conn.getsockname()[1] == self.port:
                conn.shutdown(socket.SHUT_RDWR)
                self.closed += 1
                log.debug("closing a connection to port %d: %s", self.port, why)
        except OSError:
            pass  # not a connected TCP socket (any more)
        finally:
            conn.close()  # the duplicate only; libzmq closes its own once it sees the hang-up
