"""Receive side of a WAN link: validate chunk headers, reassemble, deliver in order.

Pure bookkeeping, no sockets: the link's I/O thread asks :meth:`RecvState.begin_chunk`
where a chunk's bytes go (a slice of the destination tensor, so the frame is
copied exactly once, straight from the socket), then reports the checksum
verdict with :meth:`RecvState.finish_chunk`.

Delivery is exactly once and in order per key ``(step, microbatch, kind)``:
each message carries ``prev``, the sequence number of the previous message
with the same key that the sender had not yet seen fully acknowledged (or -1).
A complete message is handed out only once ``prev`` is complete too, and
messages of one key leave in sequence order. A message whose recv is already
posted is assembled directly in the caller's ``out`` tensor; otherwise it is
staged within ``max_staged_bytes`` (beyond that the chunk is refused "busy"
and the sender retries later). Each staged message costs its bytes and
:data:`MESSAGE_OVERHEAD_BYTES`, so the budget bounds how many messages wait
as well: a peer sending empty tensors under fresh keys, which nobody receives,
once grew its receiver by a gigabyte with nothing staged.
"""

from __future__ import annotations

import heapq
import logging
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

from agents.wan.metrics import Dropped, LinkCounters
from geosched.errors import LinkError, LinkTimeout, ProtocolError
from geosched.wire import (
    byte_array,
    check_tensor_spec,
    dtype_from_name,
    empty_tensor,
    require_shape,
)

log = logging.getLogger(__name__)

KINDS = ("activation", "gradient", "control", "allreduce")
"""Message kinds: pipeline activations and gradients, control messages, pieces of a cross-DC gradient all-reduce."""
Key = tuple[int, int, str]  # (step, microbatch, kind)
MESSAGE_OVERHEAD_BYTES = 4096
"""What a staged message costs besides its bytes (its bookkeeping, tensor and views hold about 1.4 KiB)."""
U63 = (1 << 63) - 1
_T = TypeVar("_T")


class ChunkHeader(NamedTuple):
    """A validated data-chunk header."""

    seq: int
    key: Key
    prev: int
    floor: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    total: int
    chunk: int
    offset: int
    length: int
    crc: int  # CRC32C of the payload, or -1: the sender sent none (WanLinkConfig.checksum)
    tx: int


class RejectedChunk(Dropped):
    """A chunk header that fails validation; ``reason`` is the drop counter it bumps."""


# integer fields of a data header and their lowest allowed value (all are below 2**63; crc -1: none sent)
_INT_FIELDS = (
    ("seq", 0), ("step", 0), ("mb", 0), ("prev", -1), ("floor", 0), ("total", 0),
    ("chunk", 1), ("offset", 0), ("length", 0), ("crc", -1), ("tx", 0),
)  # fmt: skip


def parse_chunk_header(h: dict[str, Any], *, max_tensor_bytes: int, max_chunk_bytes: int) -> ChunkHeader:
    """Validate a data header before anything is allocated; raises RejectedChunk naming the bad field."""
    values = []
    for name, lowest in _INT_FIELDS:  # hot path: one plain loop instead of a helper call per field
        value = h.get(name)
        if type(value) is not int or not lowest <= value <= U63:
            raise RejectedChunk("bad_header", f"header field {name!r} missing, not an int, or out of range")
        values.append(value)
    seq, step, microbatch, prev, floor, total, chunk, offset, length, crc, tx = values
    kind, dtype_name = h.get("kind"), h.get("dtype")
    if type(kind) is not str or type(dtype_name) is not str or crc > 0xFFFFFFFF:
        raise RejectedChunk("bad_header", "header fields 'kind'/'dtype' must be strings and 'crc' 32-bit")
    try:
        shape = require_shape(h, "shape")
    except ProtocolError as exc:
        raise RejectedChunk("bad_header", str(exc)) from None
    if kind not in KINDS:
        raise RejectedChunk("bad_spec", f"kind {kind[:20]!r} is not one of {KINDS}")
    if chunk > max_chunk_bytes:
        raise RejectedChunk("oversize", f"chunk size {chunk} over the limit of {max_chunk_bytes}")
    try:
        dtype = dtype_from_name(dtype_name)
        check_tensor_spec(dtype, shape, max_bytes=max_tensor_bytes, nbytes=total)
    except ProtocolError as exc:
        raise RejectedChunk("bad_spec", str(exc)) from None
    if offset % chunk or (offset >= total and not (total == offset == 0)):
        raise RejectedChunk("bad_spec", f"offset {offset} not a chunk boundary inside {total} bytes")
    if length != min(chunk, total - offset):
        raise RejectedChunk("bad_spec", f"length {length} != min(chunk {chunk}, {total} - offset {offset})")
    if prev >= seq:
        raise RejectedChunk("bad_spec", f"prev {prev} must precede seq {seq}")
    return ChunkHeader(
        seq, (step, microbatch, kind), prev, floor, dtype, tuple(shape), total, chunk, offset, length, crc, tx
    )


@dataclass(eq=False)
class PostedRecv:
    """A recv the consumer is waiting on."""

    key: Key
    future: Future[torch.Tensor]
    out: torch.Tensor | None
    deadline: float
    timeout_s: float
    bound: InMessage | None = None
    out_array: np.ndarray | None = field(init=False, default=None)  # flat uint8 view of ``out``

    def __post_init__(self) -> None:
        if self.out is not None:  # made where the recv is posted: off the I/O thread, whose torch calls run cold
            self.out_array = byte_array(self.out)


@dataclass(eq=False)
class InMessage:
    """A message being reassembled (or complete and waiting for its consumer)."""

    seq: int
    key: Key
    prev: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    total: int
    chunk: int
    nchunks: int
    tensor: torch.Tensor
    array: np.ndarray  # flat uint8 view of tensor
    staged: bool  # counts against max_staged_bytes
    last_progress: float
    received: set[int] = field(default_factory=set)
    posted: PostedRecv | None = None

    def __lt__(self, other: InMessage) -> bool:  # heap order: sequence number
        return self.seq < other.seq

    @property
    def cost(self) -> int:
        """What it counts against ``max_staged_bytes`` while staged."""
        return self.total + MESSAGE_OVERHEAD_BYTES


class RecvState:
    """Reassembly and in-order delivery for one link direction (owned by the I/O thread)."""

    def __init__(
        self,
        counters: LinkCounters,
        *,
        peer: str,
        max_staged_bytes: int,
        stale_message_s: float,
    ) -> None:
        self.counters = counters
        self.peer = peer
        self.max_staged_bytes = max_staged_bytes
        self.stale_message_s = stale_message_s
        self.assembling: dict[int, InMessage] = {}
        self.ready: dict[Key, list[InMessage]] = {}
        self.posted: dict[Key, list[PostedRecv]] = {}
        self.done_floor = 0  # every seq below is complete or abandoned
        self.done_above: set[int] = set()

    # ------------------------------------------------------------ sequence bookkeeping

    def is_done(self, seq: int) -> bool:
        """True if message ``seq`` is complete (or was abandoned by its sender)."""
        return seq < self.done_floor or seq in self.done_above

    def _mark_done(self, seq: int) -> None:
        if seq >= self.done_floor:
            self.done_above.add(seq)
        self._slide_floor()

    def _slide_floor(self) -> None:
        while self.done_floor in self.done_above:
            self.done_above.discard(self.done_floor)
            self.done_floor += 1

    def advance_floor(self, floor: int) -> None:
        """The sender says every seq below ``floor`` is finished on its side: forget them."""
        if floor <= self.done_floor:
            return
        for seq in [s for s in self.assembling if s < floor]:
            self._abandon(self.assembling[seq])
        self.done_floor = floor
        self.done_above = {s for s in self.done_above if s >= floor}
        self._slide_floor()
        for key in list(self.ready):  # a ready message whose ``prev`` the sender gave up on may go now
            self._deliver(key)

    # ------------------------------------------------------------ chunks

    def begin_chunk(self, c: ChunkHeader, now: float) -> tuple[str, InMessage | None, np.ndarray | None]:
        """Decide a chunk's fate: ("write", msg, dest slice), ("dup"|"busy"|"bad_spec", None, None)."""
        self.advance_floor(c.floor)
        if self.is_done(c.seq):
            return "dup", None, None
        msg = self.assembling.get(c.seq)
        if msg is None:
            msg = self._start_message(c, now)
            if msg is None:
                return "busy", None, None
        elif (msg.key, msg.prev, msg.dtype, msg.shape, msg.chunk) != (c.key, c.prev, c.dtype, c.shape, c.chunk):
            return "bad_spec", None, None
        if c.offset in msg.received:
            return "dup", None, None
        return "write", msg, msg.array[c.offset : c.offset + c.length]

    def finish_chunk(self, msg: InMessage, offset: int, length: int, now: float) -> None:
        """Record a chunk whose bytes landed and whose checksum matched; complete the message if whole."""
        if offset in msg.received or msg.seq not in self.assembling:
            return
        msg.received.add(offset)
        msg.last_progress = now
        self.counters.bytes_received += length
        self.counters.chunks_received += 1
        if len(msg.received) == msg.nchunks:
            self._complete(msg)

    def _start_message(self, c: ChunkHeader, now: float) -> InMessage | None:
        posted = self._bindable_posted(c.key, c.seq, c.prev)
        if posted is not None and posted.out is not None and _mismatch(posted.out, c.dtype, c.shape):
            self._pop_posted(posted)
            fail_future(
                posted.future,
                _out_mismatch(posted.out, c.dtype, c.shape),
            )
            posted = None
        if posted is not None and posted.out is not None and posted.out_array is not None:
            tensor, array = posted.out, posted.out_array
        elif posted is None and self.counters.staged_bytes + c.total + MESSAGE_OVERHEAD_BYTES > self.max_staged_bytes:
            return None
        else:
            tensor = empty_tensor(c.dtype, c.shape)
            array = byte_array(tensor)
        staged = posted is None  # nobody waits for it yet: it counts against max_staged_bytes
        nchunks = max(1, -(-c.total // c.chunk))
        msg = InMessage(c.seq, c.key, c.prev, c.dtype, c.shape, c.total, c.chunk, nchunks, tensor, array, staged, now)
        if staged:
            self.counters.staged_bytes += msg.cost
        if posted is not None:
            self._pop_posted(posted)
            posted.bound, msg.posted = msg, posted
        self.assembling[c.seq] = msg
        return msg

    def _bindable_posted(self, key: Key, seq: int, prev: int) -> PostedRecv | None:
        """The posted recv that message ``seq`` would satisfy right now, if it is next in line."""
        waiting = self.posted.get(key)
        while waiting and waiting[0].future.cancelled():
            waiting.pop(0)
        if not waiting or self.ready.get(key) or (prev >= 0 and not self.is_done(prev)):
            return None
        if any(m.key == key and m.seq < seq for m in self.assembling.values()):
            return None
        return waiting[0]

    def _complete(self, msg: InMessage) -> None:
        del self.assembling[msg.seq]
        self._mark_done(msg.seq)
        self.counters.messages_received += 1
        posted = msg.posted
        if posted is not None:
            msg.posted = posted.bound = None
            if not resolve_future(posted.future, msg.tensor):
                self._push_ready(msg)  # the consumer gave up at the last moment: keep the message
        else:
            self._push_ready(msg)
        self._deliver(msg.key)  # only its key's next message waited on it (``prev`` links a key's messages)

    def _push_ready(self, msg: InMessage) -> None:
        if not msg.staged:  # it was bound to a recv that went away: now it is staged data
            msg.tensor = msg.tensor.clone()
            msg.array = byte_array(msg.tensor)
            msg.staged = True
            self.counters.staged_bytes += msg.cost
        heapq.heappush(self.ready.setdefault(msg.key, []), msg)

    def _abandon(self, msg: InMessage) -> None:
        self.assembling.pop(msg.seq, None)
        self._mark_done(msg.seq)
        if msg.staged:
            self.counters.staged_bytes -= msg.cost
        if msg.posted is not None:  # the consumer keeps waiting for the next message of its key
            posted, msg.posted = msg.posted, None
            posted.bound = None
            self.posted.setdefault(posted.key, []).insert(0, posted)
        self.counters.drop("stale")
        self._deliver(msg.key)  # its key's next message no longer waits on it

    # ------------------------------------------------------------ consumers

    def post(self, posted: PostedRecv) -> None:
        """Register a recv; it is served now if its message is ready, or bound to one in flight."""
        if posted.future.cancelled():
            return
        self.posted.setdefault(posted.key, []).append(posted)
        self._deliver(posted.key)
        if posted.future.done() or posted.bound is not None:
            return
        candidates = [m for m in self.assembling.values() if m.key == posted.key and m.posted is None]
        if not candidates:
            return
        msg = min(candidates)
        if self._bindable_posted(msg.key, msg.seq, msg.prev) is not posted:
            return
        if posted.out is not None:
            if _mismatch(posted.out, msg.dtype, msg.shape):
                return  # served (and refused) when the message completes
            out_array = posted.out_array
            assert out_array is not None  # set with out
            out_array[:] = msg.array  # the bytes received so far; later chunks land in out directly
            msg.tensor, msg.array = posted.out, out_array
        if msg.staged:
            msg.staged = False
            self.counters.staged_bytes -= msg.cost
        self._pop_posted(posted)
        posted.bound, msg.posted = msg, posted

    def _deliver(self, key: Key) -> None:
        waiting, ready = self.posted.get(key), self.ready.get(key)
        while waiting and ready:
            msg = ready[0]
            if msg.prev >= 0 and not self.is_done(msg.prev):
                return
            posted = waiting.pop(0)
            if posted.future.cancelled():
                continue
            if posted.out is not None and _mismatch(posted.out, msg.dtype, msg.shape):
                fail_future(
                    posted.future,
                    _out_mismatch(posted.out, msg.dtype, msg.shape),
                )
                continue
            result = msg.tensor
            if posted.out is not None and posted.out_array is not None:
                posted.out_array[:] = msg.array
                result = posted.out
            if resolve_future(posted.future, result):
                heapq.heappop(ready)
                self.counters.staged_bytes -= msg.cost
        if not waiting:
            self.posted.pop(key, None)
        if not ready:
            self.ready.pop(key, None)

    def _pop_posted(self, posted: PostedRecv) -> None:
        waiting = self.posted.get(posted.key)
        if waiting and posted in waiting:
            waiting.remove(posted)
            if not waiting:
                del self.posted[posted.key]

    # ------------------------------------------------------------ time

    def expire(self, now: float) -> None:
        """Fail recvs past their deadline (LinkError) and drop messages stuck without progress."""
        for waiting in list(self.posted.values()):
            for posted in list(waiting):
                if posted.future.cancelled():
                    self._pop_posted(posted)
                elif now >= posted.deadline:
                    self._pop_posted(posted)
                    fail_future(posted.future, self._timeout_error(posted))
        for msg in list(self.assembling.values()):
            consumer = msg.posted
            if consumer is not None and (consumer.future.cancelled() or now >= consumer.deadline):
                self._unbind(msg)
                fail_future(consumer.future, self._timeout_error(consumer))
            elif consumer is None and now - msg.last_progress > self.stale_message_s:
                log.warning(
                    "dropping message seq=%d %s from %s: no progress for %.0f s",
                    msg.seq,
                    msg.key,
                    self.peer,
                    self.stale_message_s,
                )
                self._abandon(msg)

    def _unbind(self, msg: InMessage) -> None:
        """Detach a half-assembled message from a recv that gave up; keep its bytes as staged data."""
        posted, msg.posted = msg.posted, None
        if posted is not None:
            posted.bound = None
            if posted.out is not None:
                msg.tensor = msg.tensor.clone()
                msg.array = byte_array(msg.tensor)
        msg.staged = True
        self.counters.staged_bytes += msg.cost

    def _timeout_error(self, posted: PostedRecv) -> LinkError:
        step, microbatch, kind = posted.key
        return LinkTimeout(
            f"recv step={step} microbatch={microbatch} kind={kind} from {self.peer} "
            f"timed out after {posted.timeout_s:g} s (is the peer sending? raise recv_timeout_s if it is slow)"
        )

    def take_posted(self) -> list[PostedRecv]:
        """Remove and return every waiting recv (unbinding half-assembled messages), oldest first."""
        taken = [p for waiting in self.posted.values() for p in waiting]
        for msg in self.assembling.values():
            if msg.posted is not None:
                taken.append(msg.posted)
                self._unbind(msg)
        self.posted.clear()
        return taken

    def close(self, error: Exception) -> None:
        """Fail every waiting recv with ``error`` and drop all buffers."""
        for waiting in self.posted.values():
            for posted in waiting:
                fail_future(posted.future, error)
        for msg in self.assembling.values():
            if msg.posted is not None:
                fail_future(msg.posted.future, error)
        self.posted.clear()
        self.assembling.clear()
        self.ready.clear()
        self.counters.staged_bytes = 0


def _mismatch(out: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    return out.dtype != dtype or tuple(out.shape) != shape


def _out_mismatch(out: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> ProtocolError:
    return ProtocolError(f"recv out= is {out.dtype} {list(out.shape)} but the peer sent {dtype} {list(shape)}")


def resolve_future(future: Future[_T], value: _T) -> bool:
    """Set a future's result; False if the consumer cancelled it meanwhile."""
    try:
        future.set_result(value)
    except InvalidStateError:  # cancelled by the consumer meanwhile
        return False
    return True


def fail_future(future: Future[Any], error: BaseException) -> None:
    """Set a future's exception unless it is already done or cancelled."""
    try:
        future.set_exception(error)
    except InvalidStateError:
        pass


def monotonic() -> float:
    """The clock every deadline in the link uses."""
    return time.monotonic()
