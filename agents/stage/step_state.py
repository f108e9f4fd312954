"""What one training step of a stage keeps between its actions, and the clock its timeline starts from."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from geosched.schedule import Event, IdleGap

Microbatch = tuple[Tensor, Tensor]
"""(inputs (b, T) int64, targets (b, T) int64), as :mod:`geosched.data` produces them."""


def same_instant(tries: int = 5, within_s: float = 50e-6) -> tuple[float, float]:
    """(wall clock, perf_counter) read at one instant, so timelines of several processes line up on the wall
    clock: the wall clock read between two perf_counter reads, whose midpoint is taken, retried while a
    preemption (a loaded host) puts more than ``within_s`` between them; the tightest pair wins."""
    best: tuple[float, float, float] | None = None
    for _ in range(tries):
        before = time.perf_counter()
        wall = time.time()
        after = time.perf_counter()
        if best is None or after - before < best[0]:
            best = (after - before, wall, (before + after) / 2)
        if after - before <= within_s:
            break
    assert best is not None
    return best[1], best[2]


class StepState:
    """What one step keeps between actions: stage inputs/outputs and gradients per microbatch."""

    def __init__(self, step: int, microbatches: Sequence[Microbatch] | None) -> None:
        self.step = step
        self.microbatches = microbatches
        self.inputs: dict[int, Tensor] = {}  # received activations (requires_grad)
        self.outputs: dict[int, Tensor] = {}  # stage outputs; the loss on the last stage
        self.output_grads: dict[int, Tensor] = {}  # received gradients of the outputs
        self.input_grads: dict[int, Tensor] = {}  # gradients to send upstream
        self.weight_work: dict[int, tuple[Any, int]] = {}  # what W needs, kept by I, and the bytes it holds
        self.weights_done: set[int] = set()  # microbatches whose W ran (at its action, or early in a wait)
        self.losses: list[float] = []
        self.events: list[Event] = []
        self.gaps: list[IdleGap] = []
        self.t0 = 0.0  # perf_counter at the start of the step
        self.filled_until = 0.0  # perf_counter when the last prefill chunk of this step ended
        self.loss_scale: float | None = None  # fp16: the scale this step's gradients carry
        self.skipped = False  # fp16: the stages agreed that some gradient was not finite
        self.overflowed = False  # fp16: an input gradient this stage sent was not finite (zeros went instead)
        self.grad_norm: float | None = None  # the gradients' global norm before clipping (agreed at STEP)

    def microbatch(self, mb: int) -> Microbatch:
        """Microbatch ``mb`` (the first and last stages only: run_step checked that they have them)."""
        assert self.microbatches is not None
        return self.microbatches[mb]
