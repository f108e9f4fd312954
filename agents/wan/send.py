"""Send side of a WAN link: cut tensors into chunks, stripe them, resend what is lost.

Pure bookkeeping, no sockets: the link's I/O thread calls :meth:`SendState.pump`
with a ``transmit(stream, header, payload)`` callable that does the actual
zero-copy send. Each transmission gets a number (``tx``) that the receiver
echoes in its response, so a response tells exactly which transmission
arrived. Loss detection relies on each stream being one TCP connection (in
order): when a response arrives for transmission t on stream s, every earlier
transmission on s still unanswered was lost (a reconnect dropped it) and is
resent. A stream with unanswered chunks on which nothing has come in for
``ack_timeout_s`` (or four chunks' time at its measured rate, if longer) is
declared stalled and all its chunks are resent, on any stream; duplicates this
creates are discarded by the receiver. "Nothing has come in" counts the peer's
own data chunks on that stream as well as its responses (:meth:`SendState.heard`):
a stream carries both directions on one TCP connection, so when both ends send
at once the responses queue behind the peer's data, seconds behind on a slow
link, while the connection is plainly alive (resending then only doubles the
queue, and the next stall comes sooner: congestion collapse). Each stall in a
row doubles the stream's patience, as TCP backs off its retransmission timer.

Flow control: at most ``max_inflight_bytes`` unanswered per link, and per
stream about ``stream_queue_s`` seconds of the best response rate the stream
has recently shown (at least two chunks; up to 4 MiB before anything is
measured), so queues stay short, a burst after an idle gap starts
at full speed, and chunks go to the streams that drain fastest. A "busy" response (receiver has no room) pauses
that message with exponential backoff.

A message may also say when it has all but left (``OutMessage.transmitted``, what a shared link's turn waits
for, :mod:`agents.stage.turns`): every chunk went out and its unanswered chunks are at most one per stream or
what the path holds, the streams' measured rates times the least round trip of the last :data:`RTT_WINDOW_S`
seconds (a transmission to its response, as BBR's min RTT), whichever is more.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from agents.wan.metrics import LinkCounters, RateMeter, StreamCounters
from agents.wan.recv import Key, fail_future, resolve_future
from geosched.errors import LinkError
from geosched.wire import checksum, encode_header, join_maps

log = logging.getLogger(__name__)

SENT, AGAIN, UNREACHABLE = 0, 1, 2  # results of a transmit() call
BACKOFF_START_S, BACKOFF_MAX_S = 0.02, 1.0
MAX_BACKOFF_DOUBLINGS = 5  # a stream's stall patience grows to at most 32 x its base
RATE_HALF_LIFE_S = 10.0
NO_CHECKSUM = -1  # the crc field of a chunk sent without one (WanLinkConfig.checksum)
RTT_WINDOW_S = 10.0  # the least round trip is the least of this long (queues come and go)
INITIAL_STREAM_BYTES = 4 << 20  # in flight per stream before its rate is known (then rate x stream_queue_s)
Transmit = Callable[[int, bytes, memoryview], int]


@dataclass(eq=False)
class OutMessage:
    """One tensor being sent: its bytes, chunk bookkeeping and the caller's future."""

    key: Key
    base: dict[str, Any]  # header fields shared by every chunk
    data: memoryview  # flat read-only bytes of the (contiguous) tensor
    total: int
    chunk: int
    future: Future[None]
    deadline: float
    timeout_s: float
    seq: int = -1
    nchunks: int = 0
    next_index: int = 0  # first chunk never sent
    acked: bytearray = field(default_factory=bytearray)
    acked_count: int = 0
    crcs: list[int | None] = field(default_factory=list)
    retry: deque[int] = field(default_factory=deque)  # chunk indices to send again
    paused_until: float = 0.0
    backoff_s: float = BACKOFF_START_S
    finished: bool = False
    transmitted: Future[None] | None = None  # resolved once its unanswered rest fits in the path (or it finished)

    _head: bytes = b""  # the packed fields every chunk shares (filled by header())

    def __post_init__(self) -> None:
        self.nchunks = max(1, -(-self.total // self.chunk))
        self.acked = bytearray(self.nchunks)
        self.crcs = [None] * self.nchunks

    def header(self, **chunk_fields: int) -> bytes:
        """The msgpack header of one chunk: the shared fields packed once per message, then this chunk's."""
        if not self._head:
            self._head = encode_header(self.base)
        return join_maps(self._head, len(self.base), encode_header(chunk_fields), len(chunk_fields))


@dataclass(eq=False)
class StreamSlot:
    """Sender-side state of one stream (one TCP connection)."""

    index: int
    counters: StreamCounters
    probe_when_down: bool  # a ROUTER learns of a reconnect only by trying to send
    retry_at: float = 0.0  # when a blocked or down stream may be tried again
    inflight: OrderedDict[int, tuple[OutMessage, int, int, float]] = field(default_factory=OrderedDict)  # tx -> (msg,
    # idx, n, when sent)
    inflight_bytes: int = 0
    last_progress: float = 0.0
    responded_bytes: int = 0
    response_meter: RateMeter = field(default_factory=RateMeter)
    rate_estimate: float = 0.0  # bytes/s the stream has shown it can carry (peak, decaying; 0: unknown)
    rate_sampled_at: float = 0.0
    last_chunk: int = 0  # chunk size of the latest transmission (stall patience scales with it)
    stalls: int = 0  # stalls in a row with nothing heard since (each doubles the patience)

    @property
    def up(self) -> bool:
        """Whether the stream is believed connected (mirrored in its counters)."""
        return self.counters.up

    @up.setter
    def up(self, value: bool) -> None:
        self.counters.up = value

    def usable(self, now: float) -> bool:
        """True if chunks may be handed to this stream now."""
        if now < self.retry_at:
            return False
        return self.up or self.probe_when_down


class SendState:
    """Chunking, striping, acknowledgement and resend for one link direction (I/O thread only)."""

    def __init__(
        self,
        counters: LinkCounters,
        *,
        peer: str,
        link_id: int,
        max_inflight_bytes: int,
        stream_queue_s: float,
        ack_timeout_s: float,
        checksums: bool = True,
    ) -> None:
        self.counters = counters
        self.checksums = checksums  # chunks carry a CRC32C (else NO_CHECKSUM)
        self.peer = peer
        self.link_id = link_id
        self.max_inflight_bytes = max_inflight_bytes
        self.stream_queue_s = stream_queue_s
        self.ack_timeout_s = ack_timeout_s
        self.slots: list[StreamSlot] = []
        self.pending: dict[int, OutMessage] = {}  # seq -> message not yet fully acknowledged
        self.dispatching: list[OutMessage] = []  # messages with chunks to (re)send, by seq
        self.last_by_key: dict[Key, OutMessage] = {}
        self.next_seq = 0
        self.next_tx = 0
        self._floor = 0
        self.min_rtt_s = 0.0  # least time from a transmission to its response lately (a windowed minimum)
        self._rtt_since = 0.0

    # ------------------------------------------------------------ messages

    def submit(self, msg: OutMessage) -> None:
        """Number a new message, link it to the previous one of its key, and queue it."""
        if msg.future.cancelled():
            return
        msg.seq = self.next_seq
        self.next_seq += 1
        previous = self.last_by_key.get(msg.key)
        msg.base["seq"] = msg.seq
        msg.base["prev"] = previous.seq if previous is not None else -1
        self.last_by_key[msg.key] = msg
        self.pending[msg.seq] = msg
        self.dispatching.append(msg)

    @property
    def floor(self) -> int:
        """Lowest seq not yet finished (acknowledged, failed or cancelled); the receiver forgets below it."""
        while self._floor < self.next_seq and self._floor not in self.pending:
            self._floor += 1
        return self._floor

    def _finish(self, msg: OutMessage, error: Exception | None) -> None:
        msg.finished = True
        if msg.transmitted is not None:
            resolve_future(msg.transmitted, None)  # a no-op once set: after its last chunk went out
        self.pending.pop(msg.seq, None)
        if self.last_by_key.get(msg.key) is msg:
            del self.last_by_key[msg.key]
        if msg.future.cancelled():
            return
        if error is None:
            self.counters.messages_sent += 1
            resolve_future(msg.future, None)
        else:
            fail_future(msg.future, error)

    # ------------------------------------------------------------ sending

    def pump(self, now: float, transmit: Transmit) -> None:
        """Hand chunks to streams until the window is full or nothing is left to send."""
        while self.dispatching and self.counters.inflight_bytes < self.max_inflight_bytes:
            item = self._next_chunk(now)
            if item is None:
                return
            msg, idx, is_retry = item
            slot = self._pick_slot(now, msg.chunk)
            if slot is None:
                self._untake(msg, idx, is_retry)
                return
            offset = idx * msg.chunk
            length = min(msg.chunk, msg.total - offset)
            payload = msg.data[offset : offset + length]
            crc = msg.crcs[idx]
            if crc is None:
                crc = msg.crcs[idx] = checksum(payload) if self.checksums else NO_CHECKSUM
            header = msg.header(offset=offset, length=length, crc=crc, floor=self.floor, tx=self.next_tx)
            status = transmit(slot.index, header, payload)
            if status != SENT:
                self._untake(msg, idx, is_retry)
                slot.retry_at = now + (0.002 if status == AGAIN else 0.1)
                if status == UNREACHABLE and slot.up:
                    self.stream_lost(slot.index, now)
                continue
            if not slot.inflight:
                slot.last_progress = now
            slot.inflight[self.next_tx] = (msg, idx, length, now)
            slot.last_chunk = msg.chunk
            self.next_tx += 1
            self._add_inflight(slot, length)
            self.counters.bytes_sent += length
            self.counters.chunks_sent += 1
            slot.counters.bytes_sent += length
            slot.counters.chunks_sent += 1
            if status == SENT and not slot.up:
                slot.up = True  # a probe of a down stream went through: it reconnected
            if is_retry:
                self.counters.resends += 1
                slot.counters.resends += 1
            elif idx == msg.nchunks - 1:  # first transmissions go in order: the last one is out
                self._check_transmitted(msg)

    def _sample_rtt(self, sample_s: float, now: float) -> None:
        if not self.min_rtt_s or sample_s < self.min_rtt_s or now - self._rtt_since > RTT_WINDOW_S:
            self.min_rtt_s, self._rtt_since = sample_s, now

    def path_bytes(self) -> float:
        """What the path holds in flight: the streams' measured rates x the least round trip (0 before either
        is measured)."""
        return sum(slot.rate_estimate for slot in self.slots) * self.min_rtt_s

    def _check_transmitted(self, msg: OutMessage) -> None:
        """Resolve ``msg.transmitted`` once every chunk went out and what is unanswered is at most one chunk per
        stream (about 1/16 of a message, :func:`~geosched.chunking.auto_chunk_bytes`) or what the path holds."""
        if msg.transmitted is None or msg.transmitted.done() or msg.next_index < msg.nchunks:
            return
        if (msg.nchunks - msg.acked_count) * msg.chunk <= max(self.path_bytes(), len(self.slots) * msg.chunk):
            resolve_future(msg.transmitted, None)

    @staticmethod
    def _untake(msg: OutMessage, idx: int, is_retry: bool) -> None:
        """Put back a chunk that did not go out (a first transmission stays a first transmission)."""
        if is_retry:
            msg.retry.appendleft(idx)
        else:
            msg.next_index -= 1

    def _add_inflight(self, slot: StreamSlot, nbytes: int) -> None:
        slot.inflight_bytes += nbytes
        slot.counters.inflight_bytes = slot.inflight_bytes
        self.counters.inflight_bytes += nbytes

    def _pick_slot(self, now: float, chunk: int) -> StreamSlot | None:
        best: StreamSlot | None = None
        for slot in self.slots:
            if not slot.usable(now):
                continue
            if slot.rate_estimate > 0:
                cap = max(2 * chunk, min(self.max_inflight_bytes, slot.rate_estimate * self.stream_queue_s))
            else:  # nothing measured yet: an equal share of the link's window, within a first guess
                share = min(self.max_inflight_bytes // len(self.slots), INITIAL_STREAM_BYTES)
                cap = max(2 * chunk, share)
            if slot.inflight_bytes + chunk > cap and slot.inflight:
                continue
            if best is None or (slot.up, -slot.inflight_bytes) > (best.up, -best.inflight_bytes):
                best = slot
        return best

    def _next_chunk(self, now: float) -> tuple[OutMessage, int, bool] | None:
        dispatching, i = self.dispatching, 0
        while i < len(dispatching):  # hot path (once per chunk): no copy of the list
            msg = dispatching[i]
            if msg.finished:
                del dispatching[i]
                continue
            if msg.paused_until > now:
                i += 1
                continue
            while msg.retry:
                idx = msg.retry.popleft()
                if not msg.acked[idx]:
                    return msg, idx, True
            if msg.next_index < msg.nchunks:
                msg.next_index += 1
                return msg, msg.next_index - 1, False
            del dispatching[i]
        return None

    def _requeue(self, msg: OutMessage, idx: int) -> None:
        if msg.finished or msg.acked[idx]:
            return
        msg.retry.append(idx)
        if msg not in self.dispatching:
            self.dispatching.append(msg)
            self.dispatching.sort(key=lambda m: m.seq)

    # ------------------------------------------------------------ responses

    def on_response(self, stream: int, seq: int, offset: int, tx: int, busy: bool, now: float) -> None:
        """Handle the receiver's answer to transmission ``tx`` (chunk at ``offset`` of ``seq``) on ``stream``."""
        if not 0 <= stream < len(self.slots):
            return
        slot = self.slots[stream]
        entry = slot.inflight.pop(tx, None)
        if entry is not None:
            # TCP keeps a stream in order: anything sent on it before tx and still unanswered is lost.
            while slot.inflight:
                first_tx = next(iter(slot.inflight))
                if first_tx > tx:
                    break
                lost_msg, lost_idx, lost_n, _ = slot.inflight.popitem(last=False)[1]
                self._add_inflight(slot, -lost_n)
                self._requeue(lost_msg, lost_idx)
            self._add_inflight(slot, -entry[2])
            slot.responded_bytes += entry[2]
            self._sample_rtt(now - entry[3], now)
        slot.last_progress, slot.stalls = now, 0
        msg = self.pending.get(seq)
        if msg is None or offset % msg.chunk or offset // msg.chunk >= msg.nchunks:
            return
        idx = offset // msg.chunk
        if busy:
            if not msg.acked[idx]:
                self._requeue(msg, idx)
                msg.paused_until = now + msg.backoff_s
                msg.backoff_s = min(2 * msg.backoff_s, BACKOFF_MAX_S)
            return
        msg.backoff_s = BACKOFF_START_S
        if not msg.acked[idx]:
            msg.acked[idx] = 1
            msg.acked_count += 1
            if msg.acked_count == msg.nchunks:
                self._finish(msg, None)
            else:
                self._check_transmitted(msg)

    def heard(self, stream: int, now: float) -> None:
        """A data chunk of the peer's came in on ``stream``: its connection is alive, so what this side has
        unanswered on it is queued behind the peer's data (answered in order), not lost."""
        if 0 <= stream < len(self.slots):
            slot = self.slots[stream]
            slot.last_progress, slot.stalls = now, 0

    def stream_lost(self, stream: int, now: float) -> None:
        """A stream's connection broke (or stalled): resend everything it carried unanswered."""
        slot = self.slots[stream]
        slot.up = False
        while slot.inflight:
            msg, idx, n, _ = slot.inflight.popitem(last=False)[1]
            self._add_inflight(slot, -n)
            self._requeue(msg, idx)
        slot.last_progress = now

    # ------------------------------------------------------------ time

    def next_wakeup(self, now: float) -> float | None:
        """When pump() could make progress again without a response arriving (None: only on events)."""
        if not self.dispatching or self.counters.inflight_bytes >= self.max_inflight_bytes:
            return None
        times = [s.retry_at for s in self.slots if s.retry_at > now]
        times += [m.paused_until for m in self.dispatching if m.paused_until > now]
        return min(times) if times else None

    def expire(self, now: float) -> None:
        """Resend from stalled streams, fail sends past their deadline, drop cancelled ones."""
        for slot in self.slots:
            self._estimate_rate(slot, now)
            # a slow stream may need longer than ack_timeout_s to carry a few chunks
            patience = self.ack_timeout_s
            if slot.rate_estimate > 0:
                patience = max(patience, 4 * slot.last_chunk / slot.rate_estimate)
            patience *= 2 ** min(slot.stalls, MAX_BACKOFF_DOUBLINGS)
            if slot.inflight and now - slot.last_progress > patience:
                slot.stalls += 1
                log.info(
                    "stream %d to %s stalled (nothing heard for %.1f s): resending %d chunks",
                    slot.index,
                    self.peer,
                    patience,
                    len(slot.inflight),
                )
                up = slot.up
                self.stream_lost(slot.index, now)
                slot.up = up
        for msg in list(self.pending.values()):
            if msg.future.cancelled():
                self._finish(msg, None)
            elif now >= msg.deadline:
                step, microbatch, kind = msg.key
                self._finish(
                    msg,
                    LinkError(
                        f"send step={step} microbatch={microbatch} kind={kind} to {self.peer} not acknowledged "
                        f"within {msg.timeout_s:g} s ({msg.acked_count}/{msg.nchunks} chunks acknowledged; "
                        "is the peer up and receiving?)"
                    ),
                )

    def _estimate_rate(self, slot: StreamSlot, now: float) -> None:
        """Peak response rate of a stream, decaying by half every RATE_HALF_LIFE_S (so idle gaps keep it)."""
        slot.response_meter.sample(slot.responded_bytes, now)
        decay = 0.5 ** ((now - slot.rate_sampled_at) / RATE_HALF_LIFE_S) if slot.rate_sampled_at else 0.0
        slot.rate_sampled_at = now
        slot.rate_estimate = max(slot.response_meter.rate(), slot.rate_estimate * decay)

    def close(self, error: Exception) -> None:
        """Fail every pending send with ``error``."""
        for msg in list(self.pending.values()):
            self._finish(msg, error)
        self.dispatching.clear()
