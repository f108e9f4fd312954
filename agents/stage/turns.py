"""Pipelines take turns on a shared WAN link: one message at a time, first ready, first served.

The ``dp x tp`` ranks of one stage in one DC all send over the same WAN link
to the next stage's DC (and over the reverse direction to the previous
stage's). Left alone, their TCP flows share it fairly: every replica's message
arrives late, all at about the same time, after ``d`` messages' link time.
Taking turns (Atlas, arXiv 2411.14458, sec. 4.2), they are granted the link one
message at a time, in the order they reach their sends: for replicas in step,
schedule order (message k of every replica, then message k + 1). The first
replica's message arrives after one message's link time, the next after two,
and the last when it would have anyway, which is what the simulator charges
every message of the pipeline it models (one message occupying the link for
``sharing x bytes / rate``, :func:`geosched.netcost.wan_transfer`, messages of
one link served first come, first served).

**A ticket lock in the stage group's store.** For each message the holder
draws the next ticket (``add`` on the key ``turn/<direction>/next``), waits for
the key ``turn/<direction>/<ticket>`` in the group's TCPStore (hosted by group
rank 0, in the same DC: a turn costs in-DC round trips, about 100 us on
loopback, not a WAN one), starts the send on its link, and as
soon as the message has all but left (``WanLink.start_send(transmitted=...)``:
every chunk went out and what is unanswered is at most one chunk per stream,
about 1/16 of the message, or what the path holds, its measured rate x least
round trip, whichever is more) it sets the next ticket's key: the next
holder's first bytes reach the bottleneck about when this message's last leave
it, so the link hardly idles and is hardly shared between turns (a message of
at most one chunk per stream passes it on as soon as it is handed to the
link). Then it deletes its own key. Ticket 0 needs no key.

Tickets are drawn when a send is reached, not fixed in a round robin: a
replica running late (a preempted core, a slower GPU) does not hold the link
idle for the others (a fixed round robin, tried first, took 1.10x fair
sharing's iteration in a quick ``benchmarks/turns.py --wan-scale 0.01`` on a
loaded host). No torch collective fits: the holders are not in lockstep, and a
token must pass between any two. Figures: benchmarks/README.md, "turns".

The training thread never waits for a turn: :meth:`LinkTurns.submit` queues
the send for the direction's own thread and returns a future of its
acknowledgement, as ``WanLink.start_send`` does. Turns cannot deadlock: a
holder waits only for tickets drawn before its own, by sends already started,
each of which ends (is out, fails, or times out after ``timeout_s``) whatever
the waiting holder does. A holder that dies holding a ticket makes the others'
turns fail after ``timeout_s``, in one LinkError naming the ticket, raised by
the transport's next call.

Which links: :func:`shared_link_turns` gives a rank one :class:`LinkTurns`
per WAN direction its stage sends on, when its group has other ranks (the
group's ranks all send over the same links, being one stage of pipelines on
one DC path). With data parallelism across DCs (``role.sync``) a group's
pipelines may leave its DC for different DCs, and they do not take turns yet.

Example (the activations a rank sends to the next DC)::

    turns = LinkTurns(lambda: TCPStore(host, port, is_master=False), "us->eu")
    ack = turns.submit(lambda transmitted: link.start_send(x, step=s, microbatch=m, transmitted=transmitted))
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from agents.layout import RankRole
from geosched.errors import LinkError

log = logging.getLogger(__name__)

StartSend = Callable[[concurrent.futures.Future[None]], concurrent.futures.Future[None]]
"""Starts one send on the link, given the future to resolve once its last chunk is out; returns its ack future."""
GRANTS_KEPT = 4096
"""Recent turns each holder remembers (:attr:`LinkTurns.grants`)."""
SLOW_DRAW_S = 1.0
"""A ticket drawn slower than this (one in-DC round trip, normally under a millisecond) is logged as a sick store:
torch's TCPStore serves connections one at a time, and a trial's 3,000 empty ones from strangers made each of its
operations take 3 s for minutes, the pipeline 14x slower, with nothing said."""
SLOW_LINE_S = 60.0
"""At most one such line per this many seconds per link direction."""


class LinkTurns:
    """The turns of one holder on one shared link direction (``direction``: a name the holders agree on)."""

    def __init__(
        self, connect: Callable[[], Any], direction: str, *, timeout_s: float = 120.0, where: str = "its store"
    ) -> None:
        self.direction, self.timeout_s, self.where = direction, timeout_s, where
        self._slow_said = -SLOW_LINE_S
        self.grants: deque[tuple[int, float, float]] = deque(maxlen=GRANTS_KEPT)
        """(ticket, granted, transmitted) of recent turns, ``time.monotonic()`` seconds."""
        self._connect = connect
        self._queue: queue.SimpleQueue[tuple[StartSend, concurrent.futures.Future[None]] | None] = queue.SimpleQueue()
        self._error: LinkError | None = None  # set once: every later send fails with it
        self._lock = threading.Lock()  # submit vs _fail: no send queued after the queue was drained
        self._thread = threading.Thread(target=self._run, name=f"geosched-turns-{direction}", daemon=True)
        self._thread.start()

    def key(self, ticket: int | str) -> str:
        """The store key that grants ``ticket`` (``"next"``: the counter tickets are drawn from)."""
        return f"turn/{self.direction}/{ticket}"

    def submit(self, start: StartSend) -> concurrent.futures.Future[None]:
        """Queue one send for this holder's next turn; the future resolves when the link's send does."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            if self._error is None:
                self._queue.put((start, done))
                return done
        done.set_exception(self._error)
        return done

    def close(self) -> None:
        """Stop taking turns: sends not yet granted fail (a turn being waited for ends when its wait does; the
        thread is a daemon)."""
        with self._lock:
            self._error = self._error or LinkError(f"turns on {self.direction} closed")
        self._queue.put(None)

    def _run(self) -> None:
        try:
            store = self._connect()
        except Exception as exc:  # noqa: BLE001 - reported through every queued send
            self._fail(LinkError(f"turns on {self.direction}: cannot reach the group's store: {exc}"))
            return
        while (item := self._queue.get()) is not None:
            start, done = item
            if self._error is not None:  # closed
                done.set_exception(self._error)
                self._fail(self._error)
                return
            ticket = -1
            try:
                drawn = time.monotonic()
                ticket = int(store.add(self.key("next"), 1)) - 1
                self._check_draw(time.monotonic() - drawn)
                granted = self._take(store, ticket)
                try:
                    self._send(start, done)
                finally:  # the next holder's turn, also after a failed send
                    store.set(self.key(ticket + 1), b"")
                self.grants.append((ticket, granted, time.monotonic()))
                if ticket > 0:
                    store.delete_key(self.key(ticket))  # after passing the turn on: off the next holder's path
            except Exception as exc:  # noqa: BLE001 - the store or the peer holder is gone
                if not done.done():
                    done.set_exception(LinkError(f"turns on {self.direction}, ticket {ticket}: {exc}"))
                self._fail(LinkError(f"turns on {self.direction} stopped at ticket {ticket}: {exc}"))
                return

    def _check_draw(self, seconds: float) -> None:
        """Warn (once a minute at most) when drawing a ticket, one round trip to the store, took over
        :data:`SLOW_DRAW_S`."""
        now = time.monotonic()
        if seconds > SLOW_DRAW_S and now - self._slow_said >= SLOW_LINE_S:
            self._slow_said = now
            log.warning(
                "turns on %s: the group's store (%s) took %.1f s to answer one request (normally under a ms), which "
                "slows every WAN send of this stage: is something flooding its port with connections? Keep the "
                "group's store and gloo ports reachable from the group's own hosts only (docs/security.md)",
                self.direction,
                self.where,
                seconds,
            )

    def _send(self, start: StartSend, done: concurrent.futures.Future[None]) -> None:
        """Start the send (its outcome becomes ``done``'s) and wait until it has all but left, failed or timed
        out; a send that cannot start fails ``done`` alone."""
        transmitted: concurrent.futures.Future[None] = concurrent.futures.Future()
        try:
            sent = start(transmitted)
        except Exception as exc:  # noqa: BLE001 - e.g. a tensor over the link's bounds: this send's error only
            done.set_exception(exc)
            return
        sent.add_done_callback(functools.partial(_copy_outcome, target=done))
        concurrent.futures.wait([transmitted, sent], self.timeout_s, concurrent.futures.FIRST_COMPLETED)

    def _take(self, store: Any, ticket: int) -> float:
        """Wait until ``ticket`` is granted; the time it was."""
        if ticket > 0:
            try:
                store.wait([self.key(ticket)], timedelta(seconds=self.timeout_s))
            except RuntimeError:  # torch's DistStoreError: the holder before did not pass the turn on
                raise LinkError(
                    f"the replica holding ticket {ticket - 1} did not pass the turn on within {self.timeout_s:g} s; "
                    "is every replica of this stage running?"
                ) from None
        return time.monotonic()

    def _fail(self, error: LinkError) -> None:
        """Fail every queued send (and every later one) with ``error``."""
        with self._lock:
            closed = self._error is not None
            self._error = self._error or error
        if not closed:
            log.error("%s", error)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and not item[1].done():
                item[1].set_exception(error)


def shared_link_turns(role: RankRole, store_host: str, store_port: int, *, timeout_s: float) -> dict[int, LinkTurns]:
    """This rank's turns on the WAN links its stage's group shares: peer stage -> LinkTurns (one per direction,
    shared by both peers when they are in the same DC); {} when the rank sends on them alone."""
    if role.group_size == 1 or role.sync is not None:
        return {}
    import torch.distributed as dist

    def connect() -> Any:
        return dist.TCPStore(  # type: ignore[attr-defined]  # torch.distributed re-exports it implicitly
            store_host, store_port, is_master=False, timeout=timedelta(seconds=timeout_s)
        )

    directions: dict[str, LinkTurns] = {}
    out = {}
    for peer in (role.stage - 1, role.stage + 1):
        dc = role.wan_peer_dc(peer)
        if dc is not None:
            direction = f"{role.dc}->{dc}"
            if direction not in directions:
                where = f"{store_host}:{store_port}"
                directions[direction] = LinkTurns(connect, direction, timeout_s=timeout_s, where=where)
            out[peer] = directions[direction]
    return out


def _copy_outcome(source: concurrent.futures.Future[None], *, target: concurrent.futures.Future[None]) -> None:
    """Resolve ``target`` as ``source`` resolved."""
    if target.done():
        return
    exc = source.exception() if not source.cancelled() else LinkError("the send was cancelled")
    if exc is None:
        target.set_result(None)
    else:
        target.set_exception(exc)
