"""ZeRO stage 2 (P_os+g) for a pipeline stage: :class:`ShardedGradAdamW` (see :mod:`agents.dp.zero`).

Gradients are reduce-scattered in buckets *during* each microbatch's backward and only this replica's
``1/dp`` slice of them is kept between microbatches (Rajbhandari et al. 2020, sec. 5.2; DeepSpeed's stage 2
does the same with its "IPG" buckets). A parameter's gradient is copied into its bucket's staging buffer as
soon as autograd has accumulated it (``register_post_accumulate_grad_hook``) and the parameter's ``.grad``
is dropped; when every parameter of a bucket has given its gradient, the bucket is reduce-scattered
(asynchronously, at most :data:`IN_FLIGHT` buckets at once) into the slice's accumulator and its staging
freed. So a stage never holds its whole gradient: its peak is the ``1/dp`` accumulator plus a few buckets
(:data:`geosched.memory.GRADIENT_BUCKET_BYTES` each, or one parameter larger than that),
:func:`geosched.memory.stage_memory_bytes`.

Under a pipeline's gradient accumulation that is one reduce-scatter per microbatch instead of one per step
(the cost model charges it: :meth:`geosched.pipeline_costs.PipelineCosts.reduce_scatter_s`), which is why
the planner picks ZeRO 2 only where memory binds. The runtime calls :meth:`backward_done` after each
backward (B, or a zero-bubble W) to send whatever the hooks did not (parameters whose gradients are set
by hand, as a zero-bubble W does, reach a bucket through :meth:`grad_ready` or, at the latest, there).
Every replica of a stage runs the same schedule on the same graph, so they launch the same buckets in
the same order; buckets hold either the linear layers' weights or the other parameters, never both, so
a zero-bubble I (which gives only the others) completes buckets without waiting for its W.

Each bucket is sharded on its own: replica r owns slice r of every bucket (padded to a multiple of dp),
steps an AdamW on those slices (views of one flat parameter buffer that the module's parameters are
views of, too) and all-gathers every bucket after the step. Written by hand: ``ZeroRedundancyOptimizer``
is ZeRO 1 only, and FSDP shards the parameters too and drives its collectives from its own forward and
backward hooks, which does not fit a runtime that runs the schedule's actions itself. gloo has both flat
collectives in torch 2.13 (:data:`agents.dp.group.reduce_scatter_flat`).

With tensor parallelism the parameters are DTensors: the buffers hold their local shards and the slices
are shared over ``replicas`` (the stage mesh's "dp" sub-group), as in :mod:`agents.dp.zero`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from agents.dp.group import DataParallelGroup, all_gather_flat, local_tensor, reduce_scatter_flat
from agents.dp.shards import hyperparameters, tp_sharded
from geosched.errors import ConfigError
from geosched.grad_clip import square_sum
from geosched.memory import GRADIENT_BUCKET_BYTES
from geosched.optim import MasterAdamW, divides_before_sum, gradient_dtype

IN_FLIGHT = 1
"""Reduce-scatters left running while the next bucket fills: the staging held is this many buckets + one."""


@dataclass
class _Bucket:
    """Parameters whose gradients travel together, and the slice of them each replica owns."""

    params: list[int]  # indices into ShardedGradAdamW.params, in the order they sit in the bucket
    start: int  # where the bucket begins in the flat parameter buffer
    shard_numel: int  # S: each replica's slice; the bucket spans size x S elements
    staging: torch.Tensor | None = None  # (size x S,) gradients given since the last reduce-scatter
    given: set[int] = field(default_factory=set)  # parameters in staging since then


class ShardedGradAdamW(torch.optim.Optimizer):
    """ZeRO-2: gradients reduce-scattered bucket by bucket as backward makes them, AdamW on this replica's
    slices, every bucket all-gathered into the parameters after the step.

    It is both the runtime's optimizer (:meth:`step`) and its gradient sync (:meth:`allreduce_gradients`,
    which here finishes the reduce-scatters and averages). All parameters share one dtype and device (a
    stage's do). ``on_staging``, when set, is told every change of the staging bytes (the memory meter).
    """

    whole_class_name = "AdamW"
    """The class a whole state is saved as: any level loads it."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        group: DataParallelGroup,
        *,
        lr: float,
        replicas: dist.ProcessGroup | None = None,
        linear: set[int] | None = None,
        bucket_bytes: int = GRADIENT_BUCKET_BYTES,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        super().__init__(self.params, {"lr": lr})
        local = [local_tensor(p) for p in self.params]
        kinds = {(t.dtype, t.device) for t in local}
        if len(kinds) != 1:
            raise ConfigError(
                f"ZeRO-2 needs parameters of one dtype and device; this stage has {sorted(map(str, kinds))}"
            )
        ((dtype, device),) = kinds
        grad_dtype = gradient_dtype(self.params[0])  # fp32 for bf16 weights with job.grad_dtype fp32
        self.group, self.replicas = group, replicas
        self.rank, self.size = (
            (group.rank, group.size) if replicas is None else (dist.get_rank(replicas), dist.get_world_size(replicas))
        )
        self.native_avg = group.backend == "nccl"
        self.shapes = [t.shape for t in local]  # local shapes: what the flat buffers hold
        self.buckets = _plan_buckets(local, linear or set(), bucket_bytes // grad_dtype.itemsize, self.size)
        self.where: list[tuple[int, int]] = [(0, 0)] * len(self.params)  # param -> (bucket, offset in the buffer)
        for b, bucket in enumerate(self.buckets):
            offset = bucket.start
            for index in bucket.params:
                self.where[index] = (b, offset)
                offset += local[index].numel()
        padded = sum(bucket.shard_numel * self.size for bucket in self.buckets)
        self.flat_params = torch.zeros(padded, dtype=dtype, device=device)  # (sum of size x S,)
        with torch.no_grad():
            for p, t, (_, offset) in zip(self.params, local, self.where):
                view = self.flat_params[offset : offset + t.numel()].view(t.shape)
                view.copy_(t)
                _rehome(p, view)  # the module's parameter (its local shard) is now a view of the flat buffer
        self.shards = [  # views too: stepping a slice updates the module's parameters in place
            nn.Parameter(self.flat_params[self._slice(bucket, self.rank)]) for bucket in self.buckets
        ]
        for shard in self.shards:
            if grad_dtype != dtype:
                shard.grad_dtype = grad_dtype  # its gradient in fp32, as its parameters' are
            shard.grad = torch.zeros(shard.shape, dtype=grad_dtype, device=device)  # (S,) summed over the replicas
        self.inner = MasterAdamW(self.shards, lr=lr)  # bf16 slices: fp32 masters of this replica's slices
        self.on_staging: Callable[[int], None] | None = None
        self._in_flight: list[tuple[Any, int, torch.Tensor, torch.Tensor]] = []  # (work, bucket, out, staging)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self.grad_ready) for p in self.params]
        self._split_runs = self._runs_of(tp_sharded)  # (shard, start, end): gradients split over the tp ranks
        self._whole: dict[str, Any] | None = None

    @property
    def local_optimizer(self) -> torch.optim.Optimizer:
        """The AdamW stepping this replica's slices (its state is what this replica holds)."""
        return self.inner

    def gradient_bytes(self) -> int:
        """The gradient this replica keeps between microbatches: its slice of every bucket."""
        return sum(grad.numel() * grad.element_size() for shard in self.shards if (grad := shard.grad) is not None)

    def _slice(self, bucket: _Bucket, rank: int) -> slice:
        return slice(bucket.start + rank * bucket.shard_numel, bucket.start + (rank + 1) * bucket.shard_numel)

    def _runs_of(self, chosen: Callable[[nn.Parameter], bool]) -> list[tuple[int, int, int]]:
        """(shard, start, end): the stretches of this replica's slices that hold the ``chosen`` parameters."""
        runs = []
        for b, bucket in enumerate(self.buckets):
            mine = self._slice(bucket, self.rank)
            for index in bucket.params:
                if not chosen(self.params[index]):
                    continue
                offset = self.where[index][1]
                start, end = max(offset, mine.start), min(offset + self.shapes[index].numel(), mine.stop)
                if start < end:
                    runs.append((b, start - mine.start, end - mine.start))
        return runs

    def grad_square_sum(self, *, whole: bool = True) -> float:
        """The sum of the squares of this replica's gradient slices (after :meth:`allreduce_gradients`).
        ``whole`` False leaves out the parameters every tp rank holds whole (tp rank 0 counts those), so a sum
        over a tensor-parallel stage's group counts every element once."""
        grads = [shard.grad for shard in self.shards]  # the accumulators, allocated once
        if whole:
            return square_sum(grad for grad in grads if grad is not None)
        return square_sum(grad[start:end] for b, start, end in self._split_runs if (grad := grads[b]) is not None)

    # -- gradients, as backward makes them -----------------------------------------------------

    def grad_ready(self, param: torch.Tensor) -> None:
        """``param``'s ``.grad`` holds its gradient (autograd's hook, or a zero-bubble W): stage it, drop it,
        and reduce-scatter its bucket if that was the bucket's last parameter."""
        grad = param.grad
        if grad is None:
            return
        index = self._index[id(param)]
        b, offset = self.where[index]
        bucket = self.buckets[b]
        if bucket.staging is None:
            bucket.staging = torch.zeros(bucket.shard_numel * self.size, dtype=grad.dtype, device=grad.device)
            self._staged(bucket.staging.numel() * bucket.staging.element_size())
        view = bucket.staging[offset - bucket.start : offset - bucket.start + self.shapes[index].numel()]
        with torch.no_grad():
            view.add_(local_tensor(grad).reshape(-1))
        param.grad = None
        bucket.given.add(index)
        if len(bucket.given) == len(bucket.params):
            self._launch(b)

    def backward_done(self) -> None:
        """After a microbatch's backward (B, or W): stage the gradients no hook gave, reduce-scatter every
        bucket holding any, wait for all of them."""
        for p in self.params:
            if p.grad is not None:
                self.grad_ready(p)
        for b, bucket in enumerate(self.buckets):
            if bucket.staging is not None:
                self._launch(b)
        while self._in_flight:
            self._finish()

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        staging, bucket.staging, bucket.given = bucket.staging, None, set()
        assert staging is not None
        out = torch.empty(bucket.shard_numel, dtype=staging.dtype, device=staging.device)  # (S,)
        op = dist.ReduceOp.AVG if self.native_avg else dist.ReduceOp.SUM
        if not self.native_avg and divides_before_sum(staging):
            staging.div_(self.size)
        with self.group.guard("ZeRO-2 gradient reduce-scatter"):
            work = reduce_scatter_flat(out, staging, op=op, group=self.replicas, async_op=True)
        self._in_flight.append((work, b, out, staging))
        while len(self._in_flight) > IN_FLIGHT:
            self._finish()

    def _finish(self) -> None:
        work, b, out, staging = self._in_flight.pop(0)
        with self.group.guard("ZeRO-2 gradient reduce-scatter"):
            work.wait()
        grad = self.shards[b].grad
        assert grad is not None
        grad.add_(out)
        self._staged(-staging.numel() * staging.element_size())

    def _staged(self, nbytes: int) -> None:
        if self.on_staging is not None:
            self.on_staging(nbytes)

    def allreduce_gradients(self, module: nn.Module) -> None:
        """The runtime's ALL_REDUCE: finish the reduce-scatters; each slice then holds the replicas' average
        (NCCL averages each microbatch's; gloo sums, divided here). ``module`` holds these parameters."""
        self.backward_done()
        if not self.native_avg:
            for shard in self.shards:
                assert shard.grad is not None
                if not divides_before_sum(shard.grad):  # fp16 divided each microbatch's before its sum
                    shard.grad.div_(self.size)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the slices' gradients (kept allocated: they are the accumulators) and drop any parameter's."""
        for p in self.params:
            p.grad = None
        for shard in self.shards:
            assert shard.grad is not None
            shard.grad.zero_()

    # -- the step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """AdamW on this replica's slices, then every bucket all-gathered into the parameters."""
        loss = closure() if closure is not None else None
        self.inner.param_groups[0].update(hyperparameters(self))  # e.g. an LR schedule set on this optimizer
        self.inner.step()
        with self.group.guard("ZeRO-2 parameter all-gather"):  # the input must not alias the output
            works = [
                all_gather_flat(
                    self.flat_params[bucket.start : bucket.start + bucket.shard_numel * self.size],
                    shard.detach().clone(),
                    group=self.replicas,
                    async_op=True,
                )
                for bucket, shard in zip(self.buckets, self.shards)
            ]
            for work in works:
                work.wait()
        return loss

    # -- checkpoints: the whole stage's AdamW state ----------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every replica's slices of the AdamW state on replica ``to`` (every replica must call it)."""
        self._whole = None
        first = self.inner.state.get(self.shards[0], {})  # empty on every replica before the first step
        gathered: dict[str, torch.Tensor] = {}  # key -> the whole padded flat (sum of size x S,)
        for key, value in first.items():
            if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                continue
            pieces = []
            for shard in self.shards:
                mine = self.inner.state[shard][key]
                parts = [torch.empty_like(mine) for _ in range(self.size)] if self.rank == to else None
                with self.group.guard("ZeRO-2 state gather"):
                    dist.gather(mine, parts, group=self.replicas, group_dst=to)
                pieces.extend(parts or [])
            if self.rank == to:
                gathered[key] = torch.cat(pieces)
        if self.rank != to:
            return
        state: dict[int, dict[str, Any]] = {}
        if first:
            for index, (shape, (_, offset)) in enumerate(zip(self.shapes, self.where)):
                state[index] = {  # own tensors per parameter, as plain AdamW has (a checkpoint refuses shared ones)
                    key: gathered[key][offset : offset + shape.numel()].view(shape).clone()
                    if key in gathered
                    else value.clone()
                    if isinstance(value, torch.Tensor)
                    else value
                    for key, value in first.items()
                }
        group = {**hyperparameters(self.inner), "params": list(range(len(self.params)))}
        self._whole = {"state": state, "param_groups": [group]}

    def whole_state_dict(self) -> dict[str, Any]:
        """The whole stage's state as plain AdamW's ``state_dict`` (after :meth:`consolidate_state_dict`)."""
        if self._whole is None:
            raise RuntimeError(f"rank {self.rank}: call consolidate_state_dict(to={self.rank}) first")
        whole, self._whole = self._whole, None
        return whole

    def load_whole_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep this replica's slices of a whole-stage AdamW ``state_dict`` (checked before anything changes;
        DTensor values, a tensor-parallel stage's, give their local shards)."""
        entries: dict[int, dict[str, Any]] = state_dict["state"]
        if entries and sorted(entries) != list(range(len(self.params))):
            raise ValueError(f"the optimizer state covers {len(entries)} of {len(self.params)} parameters, not all")
        states: dict[int, dict[str, Any]] = {}
        for b, bucket in enumerate(self.buckets):
            mine = self._slice(bucket, self.rank)
            shard_state: dict[str, Any] = {}
            for key, first in (entries[0] if entries else {}).items():
                if not (isinstance(first, torch.Tensor) and first.dim() > 0):
                    shard_state[key] = first.clone() if isinstance(first, torch.Tensor) else first  # AdamW's step
                    continue
                buffer = torch.zeros(bucket.shard_numel, dtype=first.dtype, device=self.flat_params.device)  # (S,)
                for index in bucket.params:
                    offset = self.where[index][1]
                    lo, hi = max(offset, mine.start), min(offset + self.shapes[index].numel(), mine.stop)
                    if lo < hi:  # this parameter overlaps this replica's slice
                        value = local_tensor(entries[index][key]).reshape(-1)
                        buffer[lo - mine.start : hi - mine.start] = value[lo - offset : hi - offset]
                shard_state[key] = buffer
            if entries:
                states[b] = shard_state
        (group,) = state_dict["param_groups"]
        hyper = {key: value for key, value in group.items() if key != "params"}
        self.inner.load_state_dict(
            {"state": states, "param_groups": [{**hyper, "params": list(range(len(self.shards)))}]}
        )
        self.param_groups[0]["lr"] = hyper["lr"]


def _plan_buckets(local: list[torch.Tensor], linear: set[int], cap_numel: int, size: int) -> list[_Bucket]:
    """Buckets of at most ``cap_numel`` elements (a larger parameter alone), filled in backward order (the last
    parameters first, as DDP does), the ``linear`` parameters (indices) apart from the others, each padded to
    a multiple of ``size`` and laid one after another in the flat buffer."""
    buckets: list[_Bucket] = []
    start = 0

    def close(indices: list[int]) -> None:
        nonlocal start
        numel = sum(local[i].numel() for i in indices)
        shard = -(-numel // size)
        buckets.append(_Bucket(indices, start, shard))
        start += shard * size

    for kind in (True, False):
        current: list[int] = []
        filled = 0
        for index in reversed(range(len(local))):
            if (index in linear) != kind:
                continue
            n = local[index].numel()
            if current and filled + n > cap_numel:
                close(current)
                current, filled = [], 0
            current.append(index)
            filled += n
        if current:
            close(current)
    return buckets


def linear_parameters(module: nn.Module, params: list[nn.Parameter]) -> set[int]:
    """Indices into ``params`` of the ``nn.Linear`` weights and biases: the ones a zero-bubble W gives."""
    ids = {id(t) for layer in module.modules() if isinstance(layer, nn.Linear) for t in layer.parameters()}
    return {i for i, p in enumerate(params) if id(p) in ids}


def _rehome(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``view`` (the parameter's local shape, holding its values) the storage of ``param``, in place:
    ``param.data`` for a plain parameter; a DTensor's local shard can only be swapped, so the DTensor is
    (``torch.utils.swap_tensors``: the same Python object, which the optimizer and the module keep)."""
    if not isinstance(param, DTensor):
        param.data = view
        return
    grad_dtype = gradient_dtype(param)
    rehomed = nn.Parameter(DTensor.from_local(view, param.device_mesh, param.placements, run_check=False))
    torch.utils.swap_tensors(param, rehomed)
    if gradient_dtype(param) != grad_dtype:  # swapped away with the rest: fp32 gradients of bf16/fp16 weights
        param.grad_dtype = grad_dtype
    assert local_tensor(param).data_ptr() == view.data_ptr()
