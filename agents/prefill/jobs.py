"""A prefill request as the service computes it: its position, KV cache, and the chunk it is part-way through.

A chunk runs half a block at a time (:meth:`geosched.model.StageModule.forward_cached_steps`:
attention, then MLP), so the training thread can have its core back at the next
half when its message arrives (``preempt``): training then waits for half a
block, not one chunk, and the chunk carries on from there in the next bubble.
On a GPU each half is waited for (:func:`~agents.prefill.model.settle`) before ``preempt`` is asked.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from agents.prefill.model import settle
from agents.prefill.protocol import PrefillRequest, PrefillResponse
from geosched.model import KVCache, StageModule

Reply = bytes | Callable[[PrefillResponse], None]
"""Where a response goes: a ZeroMQ client's routing id, or a callback (a front end such as agents.prefill.http)."""


class ChunkSpan(NamedTuple):
    """One prefill chunk (or the part of one before training took its core back) run inside ``fill``
    (``time.perf_counter`` seconds); ``tokens`` is 0 for a part that finished no tokens yet."""

    start: float
    end: float
    tokens: int
    request_id: str


@dataclass
class _Job:
    """A queued or running prefill."""

    req: PrefillRequest
    identity: Reply
    arrived: float  # time.monotonic()
    deadline: float  # time.monotonic()
    kv_bytes: int
    pos: int = 0
    kv: KVCache | None = None
    logits: torch.Tensor | None = None
    chunks: int = 0
    compute_s: float = 0.0
    bubble_s: float = 0.0
    started: float | None = None
    steps: Generator[int, None, tuple[torch.Tensor, KVCache]] | None = None  # the chunk part-way through
    chunk_tokens: int = 0  # its tokens
    chunk_s: float = 0.0  # seconds computed on it so far

    @property
    def remaining(self) -> int:
        return self.req.tokens.numel() - self.pos

    def advance(self, model: StageModule, tokens: int, preempt: Callable[[], bool] | None = None) -> int:
        """Run the chunk part-way through, else a new one of ``tokens``, half a block at a time; stop after a
        half once ``preempt()`` is true. Returns the tokens the chunk finished (0: stopped part-way)."""
        device = next(model.parameters()).device
        if self.steps is None:
            x = self.req.tokens[self.pos : self.pos + tokens].view(1, -1).to(device)  # (1, t) int64
            self.steps, self.chunk_tokens, self.chunk_s = model.forward_cached_steps(x, self.kv, self.pos), tokens, 0
        started = time.perf_counter()
        try:
            with torch.no_grad():  # around each next(): grad mode must not leak out of the generator
                while True:
                    next(self.steps)
                    settle(device)
                    if preempt is not None and preempt():
                        return 0
        except StopIteration as done:
            logits, kv = done.value  # (1, t, V), per layer (1, H, pos+t, D)
        finally:
            self.chunk_s += time.perf_counter() - started
        self.kv, self.logits, self.pos = kv, logits[0, -1], self.pos + self.chunk_tokens  # last position (V,)
        self.steps = None
        self.chunks += 1
        return self.chunk_tokens
