"""Measured peak memory of a stage: what the planner's memory model predicts, counted on the real tensors.

The planner predicts a stage's peak as model state (weights, gradients, the
optimizer state: each ZeRO shard only) plus the activations its in-flight
microbatches keep for backward (:func:`geosched.memory.stage_memory_bytes`).
:class:`MemoryMeter` measures the same two terms, on CPU and GPU alike:

* model state: the bytes of the stage's parameters, their gradients and every
  tensor in the optimizer's state, read from the tensors after a step (ZeRO 2:
  its slice of the gradients; the buckets it stages during a backward count
  as activations do, while they live);
* activations: every tensor autograd saves for backward during a forward
  (``torch.autograd.graph.saved_tensors_hooks``), counted once per storage
  while the graph holds it (the saved handle uncounts it when autograd frees
  it, in ``__del__``: after B or I; a ``weakref.finalize`` per saved tensor
  cost the stage about 4 % of its step), and what a zero-bubble I keeps
  outside the graph for its W (the linear layers' inputs, from the forward
  on, and output gradients, :mod:`geosched.wgrad`: :meth:`MemoryMeter.adjust`
  and :meth:`MemoryMeter.hold`). The
  handle holds a detached view: an op that saves its own output (softmax)
  would otherwise tie the graph to itself through the handle, a cycle
  Python's collector cannot see into, and the graph would never be freed.
  Parameters saved by an op are model state, not counted twice.

The peak of a step is the most state + live activations seen during it.
Activations are counted in the first ``counted_steps`` steps only (default 1):
every later step runs the same schedule on tensors of the same shapes, so it
holds the same activations, and its peak is its state + the largest count seen.
Counting costs: on a tensor-parallel stage each saved DTensor's detach goes
through DTensor's dispatch, and with the hooks on every step a demo tp 2 stage's
forward took 16.5 ms of CPU instead of 11.5 (its iteration, median of five
launches, 0.85 s instead of 0.74). On
CUDA the allocator's own ``max_memory_allocated`` is reported beside it.
torch has no allocator statistics for CPU tensors, which is why the counting
is done here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from agents.dp.group import local_tensor
from agents.dp.zero import optimizer_state_bytes
from agents.dp.zero2 import ShardedGradAdamW


class _Saved:
    """A tensor saved for backward, held by autograd until the graph is freed; uncounted when it goes."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: Tensor, meter: MemoryMeter, key: int) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class MemoryMeter:
    """Peak bytes of one stage: model state plus the activations autograd keeps (see the module docstring)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, counted_steps: int = 1) -> None:
        self.module, self.optimizer, self.counted_steps = module, optimizer, counted_steps
        self._params = {local_tensor(p).untyped_storage().data_ptr() for p in module.parameters()}
        self._held: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved handles alive]
        self.live = 0  # activation bytes held now (by autograd, or kept for a zero-bubble W)
        self.live_peak = 0  # the most activation bytes autograd held at once in a counted step
        self.steps = 0  # steps started
        self.state = self.state_bytes()
        self.peak = self.state
        if isinstance(optimizer, ShardedGradAdamW):  # its buckets' staging lives while backwards run
            optimizer.on_staging = self.adjust

    @property
    def counting(self) -> bool:
        """Whether this step counts its activations (one of the first ``counted_steps``; before any step too)."""
        return self.steps <= self.counted_steps

    def state_bytes(self) -> int:
        """Parameters, their gradients and the optimizer's state (this rank's shards), in bytes."""
        total = optimizer_state_bytes(self.optimizer)
        if isinstance(self.optimizer, ShardedGradAdamW):
            total += self.optimizer.gradient_bytes()  # its slice of the gradients (the parameters' are transient)
        for p in self.module.parameters():
            total += _nbytes(p)
            if p.grad is not None:
                total += _nbytes(p.grad)
        return total

    def start_step(self) -> None:
        """Start a step's peak from the state now (gradients and optimizer state exist after the first step);
        past the counted steps, the peak is that state + the activations the counted steps held at most."""
        self.steps += 1
        self.state = self.state_bytes()
        self.peak = self.state + (self.live if self.counting else max(self.live, self.live_peak))

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Count what autograd saves for backward inside this block (wrap each forward); past the counted
        steps, nothing (no hooks)."""
        if not self.counting:
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, tensor: Tensor) -> Any:
        try:
            storage = local_tensor(tensor).untyped_storage()
            key = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor without real storage (a wrapper subclass): not held
            return tensor
        if key in self._params or storage.nbytes() == 0:
            return tensor
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = [storage.nbytes(), 0]
            self.live += held[0]
            self.live_peak = max(self.live_peak, self.live)
            self.peak = max(self.peak, self.state + self.live)
        held[1] += 1
        return _Saved(tensor.detach(), self, key)  # a saved output keeps no grad_fn: no cycle through the graph

    def _release(self, key: int) -> None:
        held = self._held.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            self.live -= held[0]
            del self._held[key]

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` of activations kept outside autograd (a zero-bubble I's work for its W) until
        :meth:`let_go`."""
        self.live += nbytes
        if self.counting:
            self.live_peak = max(self.live_peak, self.live)
        self.peak = max(self.peak, self.state + self.live)

    def let_go(self, nbytes: int) -> None:
        """What :meth:`hold` counted is freed."""
        self.live -= nbytes

    def adjust(self, nbytes: int) -> None:
        """Bytes held outside autograd changed by ``nbytes`` (held if positive, let go if negative): ZeRO 2's
        staged gradients and a zero-bubble stage's layer inputs kept for W, counted with the activations, as
        they too live only while backwards run."""
        if nbytes >= 0:
            self.hold(nbytes)
        else:
            self.let_go(-nbytes)

    def report(self) -> dict[str, int]:
        """This step's figures: ``peak_bytes`` (state + activations), ``state_bytes``; on CUDA also
        ``cuda_max_allocated_bytes`` (the allocator's peak since the last report)."""
        state = self.state_bytes()
        out = {"peak_bytes": max(self.peak, state + self.live), "state_bytes": state}
        device = next((p.device for p in self.module.parameters()), None)
        if device is not None and device.type == "cuda":
            out["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)
        return out


def _nbytes(tensor: Tensor) -> int:
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def _unpack(saved: Any) -> Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved
