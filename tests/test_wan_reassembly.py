"""The receiving side's reassembly and delivery (agents.wan.recv.RecvState), chunk by chunk, without sockets.

A message waits for the earlier message of its key (``prev``); these cases check that it goes out as soon
as that one is complete or given up, whichever event unblocks it, and that a recv posted with ``out``
receives straight into it.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch

from agents.wan.metrics import LinkCounters
from agents.wan.recv import MESSAGE_OVERHEAD_BYTES, ChunkHeader, PostedRecv, RecvState

SHAPE = (2, 3)
NBYTES = 2 * 3 * 4


def _state() -> RecvState:
    return RecvState(LinkCounters(1, "listen", "peer"), peer="peer", max_staged_bytes=1 << 20, stale_message_s=60.0)


def _chunk(seq: int, key: tuple[int, int, str], prev: int, floor: int = 0) -> ChunkHeader:
    return ChunkHeader(seq, key, prev, floor, torch.float32, SHAPE, NBYTES, NBYTES, 0, NBYTES, -1, seq)


def _deliver_chunk(state: RecvState, c: ChunkHeader, value: float) -> None:
    verdict, msg, view = state.begin_chunk(c, 0.0)
    assert verdict == "write" and msg is not None and view is not None
    view[:] = np.frombuffer(torch.full(SHAPE, value).numpy().tobytes(), dtype=np.uint8)
    state.finish_chunk(msg, c.offset, c.length, 0.0)


def _post(state: RecvState, key: tuple[int, int, str], out: torch.Tensor | None = None) -> Future[torch.Tensor]:
    future: Future[torch.Tensor] = Future()
    state.post(PostedRecv(key, future, out, 1e9, 60.0))
    return future


def test_a_message_waiting_on_its_keys_earlier_one_goes_when_that_one_completes() -> None:
    state, key, other = _state(), (0, 0, "activation"), (0, 1, "activation")
    first, second = _post(state, key), _post(state, key)
    _deliver_chunk(state, _chunk(1, key, prev=0), 2.0)  # the later one arrives first
    _deliver_chunk(state, _chunk(2, other, prev=-1), 9.0)  # another key completing does not release it
    assert not first.done() and not second.done()
    _deliver_chunk(state, _chunk(0, key, prev=-1), 1.0)
    assert float(first.result(0)[0, 0]) == 1.0 and float(second.result(0)[0, 0]) == 2.0


def test_a_message_whose_earlier_one_the_sender_gave_up_goes_when_the_floor_passes_it() -> None:
    state, key, other = _state(), (0, 0, "gradient"), (0, 1, "gradient")
    waiting = _post(state, key)
    _deliver_chunk(state, _chunk(1, key, prev=0), 5.0)  # seq 0 never comes: its sender gave up on it
    assert not waiting.done()
    _deliver_chunk(state, _chunk(2, other, prev=-1, floor=1), 7.0)  # a later chunk says seq 0 is finished
    assert float(waiting.result(0)[0, 0]) == 5.0


def test_a_recv_posted_with_out_receives_straight_into_it() -> None:
    state, key = _state(), (3, 0, "activation")
    out = torch.zeros(SHAPE)
    future = _post(state, key, out)
    _deliver_chunk(state, _chunk(0, key, prev=-1), 4.0)
    assert future.result(0) is out and torch.equal(out, torch.full(SHAPE, 4.0))
    assert state.counters.staged_bytes == 0  # never held anywhere else


def test_empty_messages_nobody_receives_are_bounded_by_the_staging_budget() -> None:
    """A peer (a rank's key is enough) sent empty tensors under fresh keys: each was complete at once, counted 0
    bytes and waited forever; 246,000 of them grew the receiver by 340 MiB with nothing staged. Each staged
    message now costs MESSAGE_OVERHEAD_BYTES too, so past the budget its chunks are refused busy."""
    state = _state()  # a 1 MiB budget
    verdicts = []
    for seq in range(1_000):
        empty = ChunkHeader(seq, (seq, 0, "activation"), -1, 0, torch.float32, (0,), 0, 1, 0, 0, -1, seq)
        verdict, msg, _ = state.begin_chunk(empty, 0.0)
        verdicts.append(verdict)
        if msg is not None:
            state.finish_chunk(msg, 0, 0, 0.0)
    kept = (1 << 20) // MESSAGE_OVERHEAD_BYTES
    assert verdicts.count("write") == kept and verdicts.count("busy") == 1_000 - kept
    assert state.counters.staged_bytes == kept * MESSAGE_OVERHEAD_BYTES
    assert float(_post(state, (0, 0, "activation")).result(0).numel()) == 0  # a consumer takes one: room again
    assert state.counters.staged_bytes == (kept - 1) * MESSAGE_OVERHEAD_BYTES
