"""Intra-datacenter data parallelism: one process group per pipeline stage's replicas.

Each geosched process has exactly one data-parallel (DP) group, the replicas
of its pipeline stage in its datacenter, so the default torch.distributed
process group *is* that DP group. :func:`join_group` forms it from a
:class:`GroupSpec` (group name, replica index, group size, store address):

    spec = GroupSpec("eu/stage2", rank=r, size=4, store_host="10.0.0.5", store_port=29500)
    with join_group(spec) as group:
        ddp = group.wrap(stage_module, bucket_cap_mb=25)       # native, bucketed, averaged
        with group.accumulate():                               # no sync per microbatch
            ...forward/backward microbatches...
            group.sync_on_next_backward()                      # the iteration's last backward syncs
            torch.autograd.backward(out, grad)
        # or, for runtimes that drive backward themselves on the bare module:
        group.allreduce_gradients(stage_module)

Replica 0 hosts the TCPStore unless ``host_store=False``; the backend is gloo
unless ``backend="nccl"`` asks for NCCL (the agents do for stages on a GPU, :mod:`agents.stage.device`).
Every rank beats a heartbeat counter in the store; when a collective fails or
times out, :meth:`DataParallelGroup.guard` reads the heartbeats and raises a
CollectiveError naming the rank(s) that stopped. A group of size 1 needs no
torch.distributed at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from agents.dp import ring
from agents.dp.health import HeartbeatMonitor, store_timeout, wait_for_listener
from agents.dp.spec import GroupSpec, choose_backend
from agents.dp.store import listening_store
from geosched.errors import CollectiveError, ConfigError
from geosched.memory import GRADIENT_BUCKET_BYTES
from geosched.optim import divides_before_sum, gradient_dtype

log = logging.getLogger(__name__)

DEFAULT_BUCKET_CAP_MB = GRADIENT_BUCKET_BYTES / 2**20  # DDP's 25 MiB, ZeRO 2's bucket too

# The flat collectives under the names of the torch at hand: torch 2.13 calls them reduce_scatter_single and
# all_gather_single, earlier releases (GPU hosts bring their own CUDA build, torch >= 2.4) reduce_scatter_tensor
# and all_gather_into_tensor.
reduce_scatter_flat: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``(output, input, op=SUM, group=None, async_op=False)``: ``input`` (size x n,) reduced, slice ``rank`` out."""
all_gather_flat: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``(output, input, group=None, async_op=False)``: every rank's ``input`` (n,) into ``output`` (size x n,)."""


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: its local shard of a tensor-parallel DTensor (an alias of the same
    storage: in-place updates reach the DTensor), else the tensor itself."""
    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def adopt_grads(params: Iterable[nn.Parameter], views: Iterable[torch.Tensor]) -> None:
    """Make each parameter's gradient its view into a flat buffer (copying it in; a missing gradient counts
    as zeros), so one collective on the buffer reduces them all.

    A view has the parameter's local shape; a DTensor parameter (tensor parallelism) gets a DTensor gradient
    whose local shard is the view, so backward accumulates into the buffer.
    """
    with torch.no_grad():
        for p, view in zip(params, views):
            grad = p.grad
            if grad is not None and local_tensor(grad).data_ptr() == view.data_ptr():
                continue
            if grad is None:
                view.zero_()
            else:
                view.copy_(local_tensor(grad))
            p.grad = (
                DTensor.from_local(view, p.device_mesh, p.placements, run_check=False)
                if isinstance(p, DTensor)
                else view
            )


class DataParallelGroup:
    """A joined data-parallel group: native DDP, explicit bucketed all-reduce, the seeds' ring.

    Made by :func:`join_group`; use it as a context manager so the process
    group is destroyed on exit. With ``size == 1`` every method is a no-op
    and torch.distributed is never initialised.
    """

    def __init__(self, spec: GroupSpec, backend: str) -> None:
        self.spec = spec
        self.backend = backend
        self.rank, self.size = spec.rank, spec.size
        self.counter = ring.ElementCounter()
        self._store: dist.Store | None = None  # type: ignore[name-defined]  # torch.distributed re-exports it implicitly
        self._monitor: HeartbeatMonitor | None = None
        self._wrapped: list[nn.parallel.DistributedDataParallel] = []
        self._buckets: dict[tuple[int, ...], _GradientBuckets] = {}

    @property
    def device(self) -> torch.device:
        """The device collectives run on: this process's GPU for NCCL, else the CPU."""
        return torch.device("cuda", self.spec.local_rank) if self.backend == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------ lifecycle

    def _join(self) -> None:
        spec = self.spec
        if spec.size == 1:
            return
        if dist.is_initialized():
            raise CollectiveError(
                "torch.distributed is already initialised in this process; "
                "each process joins exactly one data-parallel group"
            )
        master = spec.host_store and spec.rank == 0
        where = f"{spec.store_host}:{spec.store_port}"
        try:
            if not master:  # TCPStore's own connect retries can overrun the timeout
                wait_for_listener(spec.store_host, spec.store_port, spec.timeout_s)
            base = (
                listening_store(spec.store_host, spec.store_port, spec.size, store_timeout(spec.timeout_s))
                if master
                else dist.TCPStore(  # type: ignore[attr-defined]  # torch.distributed re-exports it implicitly
                    spec.store_host, spec.store_port, spec.size, False, timeout=store_timeout(spec.timeout_s)
                )
            )
        except Exception as exc:  # noqa: BLE001 - translated at the boundary
            who = "rank 0 (the store host) is missing" if spec.host_store else "the external store is down"
            text = str(exc).strip().splitlines()
            raise CollectiveError(
                f"group {spec.name!r}: rank {spec.rank} could not reach the store at {where} within "
                f"{spec.timeout_s:g} s: {who} ({text[0] if text else type(exc).__name__})"
            ) from None
        if master and spec.store_port == 0:  # the OS picked the port; peers learn it from self.spec
            spec = self.spec = dataclasses.replace(spec, store_port=base.port)
        self._store = dist.PrefixStore(spec.name, base)  # type: ignore[attr-defined]  # torch.distributed re-exports it implicitly
        self._monitor = HeartbeatMonitor(spec)
        self._monitor.start()
        try:
            self._rendezvous()
            if self.backend == "nccl":
                torch.cuda.set_device(spec.local_rank)
            with self.guard("init_process_group"):
                dist.init_process_group(
                    self.backend,
                    store=self._store,
                    rank=spec.rank,
                    world_size=spec.size,
                    timeout=store_timeout(spec.timeout_s),
                    device_id=self.device if self.backend == "nccl" else None,
                )
        except BaseException:
            self.close()
            raise
        log.info(
            "joined group %s as rank %d of %d (%s, store %s)", spec.name, spec.rank, spec.size, self.backend, where
        )

    def _rendezvous(self) -> None:
        """Every rank announces itself; after timeout_s the missing ones are named."""
        assert self._store is not None
        spec = self.spec
        self._store.set(f"joined/{spec.rank}", self._where())
        keys = [f"joined/{r}" for r in range(spec.size)]
        try:
            self._store.wait(keys, store_timeout(spec.timeout_s))
        except Exception:  # noqa: BLE001 - a timeout; find out who is missing
            try:
                missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            except Exception:  # noqa: BLE001
                missing = [0] if spec.host_store else []
            raise CollectiveError(
                f"group {spec.name!r}: rank(s) {missing or 'unknown'} did not join within "
                f"{spec.timeout_s:g} s (rank {spec.rank} of {spec.size} waited at "
                f"{spec.store_host}:{spec.store_port}); start them or lower the group size"
            ) from None
        if self.backend == "nccl":
            self._check_one_gpu_each(keys)

    def _where(self) -> str:
        """What this rank announces as it joins: its host and GPU under NCCL (two ranks must not share one)."""
        return f"{socket.gethostname()} cuda:{self.spec.local_rank}" if self.backend == "nccl" else "1"

    def _check_one_gpu_each(self, keys: list[str]) -> None:
        """ConfigError (one line, exit 2) if two ranks of the group announced the same GPU of one host: NCCL
        refuses a communicator with two ranks on one device, after a long wait and at length."""
        assert self._store is not None
        first: dict[str, int] = {}
        for rank, key in enumerate(keys):
            where = self._store.get(key).decode(errors="replace")[:200]  # a name in one line, whatever was written
            if where in first:
                raise ConfigError(
                    f"group {self.spec.name!r}: ranks {first[where]} and {rank} are both on GPU {where}, and NCCL "
                    "needs one GPU per rank; give each rank of the group its own GPU (geosched agent --device "
                    "cuda:N), re-plan with fewer ranks per stage (--tp 1 --dp 1), or train on the CPU (--device cpu)"
                )
            first[where] = rank

    def close(self) -> None:
        """Destroy the process group and stop the heartbeat; safe to call twice.

        The replica hosting the store keeps it up until every replica has
        said it is leaving (or a few heartbeats passed), so nobody's last
        store call hits a closed socket.
        """
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 - closing after a failure
                log.debug("destroy_process_group failed: %s", exc)
        if self._monitor is not None:
            self._monitor.stop()
            if self._store is not None:
                self._leave(grace_s=self._monitor.stale_s)
            self._monitor = None
        self._store = None
        self._wrapped.clear()
        self._buckets.clear()

    def _leave(self, grace_s: float) -> None:
        assert self._store is not None
        try:
            self._store.add("left", 1)
            if self.spec.host_store and self.rank == 0:
                deadline = time.monotonic() + grace_s
                while self._store.add("left", 0) < self.size and time.monotonic() < deadline:
                    time.sleep(0.02)
        except Exception as exc:  # noqa: BLE001 - the store is already gone
            log.debug("leaving the store failed: %s", exc)

    def __enter__(self) -> DataParallelGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Turn a backend failure inside the block into a CollectiveError naming the missing rank(s)."""
        try:
            yield
        except RuntimeError as exc:
            if self._monitor is None:
                raise
            missing, why = self._monitor.missing_ranks(wait_s=self._monitor.stale_s + 1.0)
            text = str(exc).strip().splitlines()
            cause = f"missing rank(s) {missing}: {why}" if missing else why or "no rank missed its heartbeat"
            raise CollectiveError(
                f"{what} failed in group {self.spec.name!r} (rank {self.rank} of {self.size}, "
                f"timeout {self.spec.timeout_s:g} s): {cause}; "
                f"backend said: {text[0] if text else type(exc).__name__}"
            ) from None

    # ------------------------------------------------------------ collectives

    def barrier(self) -> None:
        """Wait for every replica (a CollectiveError names any that never comes)."""
        if self.size > 1:
            with self.guard("barrier"):
                dist.barrier()

    def allreduce(self, tensor: torch.Tensor, op: ring.Op = "sum") -> torch.Tensor:
        """Native (library) all-reduce of ``tensor`` in place; ``op`` is "sum" or "avg"."""
        if self.size == 1:
            return tensor
        native_avg = op == "avg" and self.backend == "nccl" and tensor.is_floating_point()
        early = op == "avg" and not native_avg and divides_before_sum(tensor)
        if early:
            tensor.div_(self.size)
        with self.guard("all-reduce"):
            dist.all_reduce(tensor, dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM)
        if op == "avg" and not native_avg and not early:
            ring._divide(tensor, self.size)
        return tensor

    def sum(self, value: float) -> float:
        """The sum of every rank's ``value`` (one single-element fp64 all-reduce; the same on every rank)."""
        if self.size == 1:
            return value
        return float(self.allreduce(torch.tensor([value], dtype=torch.float64, device=self.device)))

    def ring_allreduce(self, tensor: torch.Tensor, op: ring.Op = "sum") -> torch.Tensor:
        """The seeds' ring all-reduce in place; elements sent go to ``self.counter``."""
        if self.size == 1:
            return tensor
        with self.guard("ring all-reduce"):
            return ring.ring_allreduce(tensor, op, counter=self.counter)

    # ------------------------------------------------------------ gradients

    def wrap(
        self,
        module: nn.Module,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        comm_hook: str = "native",
    ) -> nn.Module:
        """Wrap a stage module in DistributedDataParallel on this group (the module itself when size 1).

        Gradients are averaged in buckets of ``bucket_cap_mb`` during
        backward (``.grad`` tensors are views into DDP's buckets, no copies),
        also when backward is driven with
        ``torch.autograd.backward(outputs, grad_tensors)``. ``comm_hook="ring"``
        routes the buckets through the seeds' ring instead of the library's all-reduce.
        """
        if comm_hook not in ("native", "ring"):
            raise ConfigError(f"comm_hook: must be 'native' or 'ring' (got {comm_hook!r})")
        if self.size == 1:
            return module
        ddp = nn.parallel.DistributedDataParallel(
            module,
            device_ids=[self.spec.local_rank] if self.backend == "nccl" else None,
            bucket_cap_mb=bucket_cap_mb,
            forward_sync_buffers=False,
            gradient_as_bucket_view=True,
        )
        if comm_hook == "ring":
            ddp.register_comm_hook(ring.RingHookState(counter=self.counter), ring.ring_allreduce_hook)
        self._wrapped.append(ddp)
        return ddp

    def _targets(self, module: nn.Module | None) -> list[nn.parallel.DistributedDataParallel]:
        if module is None:
            return list(self._wrapped)
        if module not in self._wrapped:
            raise ConfigError("module: pass the module returned by group.wrap(...)")
        return [module]

    @contextlib.contextmanager
    def accumulate(self, module: nn.Module | None = None) -> Iterator[None]:
        """Inside this block, forwards/backwards of wrapped modules accumulate gradients without syncing.

        ``module`` is one module returned by :meth:`wrap` (default: all of
        them). Call :meth:`sync_on_next_backward` before the iteration's last backward.
        """
        if self.size == 1:
            yield
            return
        targets = self._targets(module)
        saved = [ddp.require_backward_grad_sync for ddp in targets]
        for ddp in targets:
            ddp.require_backward_grad_sync = False
        try:
            yield
        finally:
            for ddp, old in zip(targets, saved):
                ddp.require_backward_grad_sync = old

    def sync_on_next_backward(self, module: nn.Module | None = None) -> None:
        """Make the next backward through wrapped modules all-reduce the accumulated gradients.

        In a pipeline the iteration's last *backward* should sync, but DDP
        decides at forward time; this arms DDP's reducer now, whatever forward
        came last (GPipe runs every forward before the first backward). Use it
        inside :meth:`accumulate`.
        """
        if self.size == 1:
            return
        for ddp in self._targets(module):
            ddp.reducer.prepare_for_backward([])

    def allreduce_gradients(
        self, module: nn.Module | Iterable[nn.Parameter], bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    ) -> None:
        """Average the ``.grad`` of ``module``'s parameters across the group, in buckets.

        For runtimes that drive backward themselves: call once per iteration
        after the last backward. Gradients become views into persistent
        flat buckets (one all-reduce each, all in flight at once); a parameter
        without a gradient counts as zeros and gets one.
        """
        if self.size == 1:
            return
        params = [p for p in (module.parameters() if isinstance(module, nn.Module) else module) if p.requires_grad]
        key = (*(id(p) for p in params), int(bucket_cap_mb * 2**20))
        buckets = self._buckets.get(key)
        if buckets is None:
            buckets = self._buckets[key] = _GradientBuckets(params, bucket_cap_mb)
        with self.guard("gradient all-reduce"):
            buckets.allreduce(self.size, native_avg=self.backend == "nccl")


class _GradientBuckets:
    """Persistent flat buffers, one per bucket of same-dtype parameters; grads live in them as views."""

    def __init__(self, params: list[nn.Parameter], bucket_cap_mb: float) -> None:
        cap = max(1, int(bucket_cap_mb * 2**20))
        self.buckets: list[tuple[torch.Tensor, list[nn.Parameter], list[torch.Tensor]]] = []
        by_kind: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in reversed(params):  # backward order, as DDP does
            by_kind.setdefault((gradient_dtype(p), p.device), []).append(p)  # fp32 gradients of bf16 weights
        for (dtype, device), group in by_kind.items():
            current: list[nn.Parameter] = []
            size = 0
            for p in group:
                current.append(p)
                size += p.numel() * dtype.itemsize
                if size >= cap:
                    self._add_bucket(current, dtype, device)
                    current, size = [], 0
            if current:
                self._add_bucket(current, dtype, device)

    def _add_bucket(self, params: list[nn.Parameter], dtype: torch.dtype, device: torch.device) -> None:
        flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        views, offset = [], 0
        for p in params:
            views.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.buckets.append((flat, params, views))

    def allreduce(self, world: int, native_avg: bool) -> None:
        """Average every bucket across ranks, all in flight at once (NCCL: AVG; gloo: SUM, dividing after it,
        or before it in fp16: :func:`~geosched.optim.divides_before_sum`)."""
        works = []
        for flat, params, views in self.buckets:
            adopt_grads(params, views)
            if not native_avg and divides_before_sum(flat):
                flat.div_(world)
            works.append(dist.all_reduce(flat, dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM, async_op=True))
        for (flat, _, _), work in zip(self.buckets, works):
            work.wait()
            if not native_avg and not divides_before_sum(flat):
                flat.div_(world)


def join_group(spec: GroupSpec) -> DataParallelGroup:
    """Join the data-parallel group described by ``spec`` (rendezvous included) and return it.

    Use as ``with join_group(spec) as group:``; leaving the block destroys the
    process group. Raises CollectiveError naming any rank that did not join
    within ``spec.timeout_s``.
    """
    group = DataParallelGroup(spec, choose_backend(spec.backend))
    group._join()
    return group
