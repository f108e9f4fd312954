"""CrossDcSync: the ALL_REDUCE of a stage whose replicas live in several DCs: hierarchical, bucketed, over WanLinks.

The algorithm is data in :mod:`geosched.hierarchical` (lanes, the chain over
the DCs, which region goes to whom at which tick, the summation order); this
module runs it. One :meth:`CrossDcSync.allreduce_gradients` (the runtime's
``ALL_REDUCE``, once per step after the stage's last backward):

1. the gradients become views into persistent flat buckets (``bucket_cap_mb``,
   backward order, as DDP buckets them), each padded as its
   :class:`~geosched.hierarchical.Lanes` say;
2. every bucket's in-DC reduce-scatter starts at once (gloo/NCCL, asynchronous):
   in-DC replica ``i < lanes`` receives its DC's sum of lane ``i``;
3. the position's operations run as soon as they are ready
   (:class:`~geosched.hierarchical.ChainProgress`): every receive is posted up
   front (a result straight into its place in the lane, a partial sum into a
   scratch buffer), sends are queued on the links and never wait, and bucket
   ``b``'s reduce-scatter is awaited only before its first operation, so
   bucket ``b``'s lane crosses the WAN while later buckets are still being
   reduced in the DC; a bucket's in-DC all-gather starts as soon as its lane is
   final (its ``done`` operation) and overlaps the next buckets' WAN traffic;
4. it waits for the all-gathers and for every send to be acknowledged (the
   buffers are the gradients the optimizer reads and the next step zeroes).

The ALL_REDUCE action follows the stage's own last backward, so within a stage
nothing overlaps the backward; across stages it does, as the schedule allows:
a later stage reaches its ALL_REDUCE first and syncs while earlier stages still
run their backward passes.

Why hand-written: no library runs a hierarchical all-reduce over our own WAN
links. torch.distributed's collectives (gloo, NCCL, and the hierarchical
algorithms built on them, as in Horovod or NCCL's trees) bring their own
transports: one connection per peer pair, no relay in between, no CURVE, no
resends across a reset link, and every DC in one process group. The WAN part
must ride the :class:`~agents.wan.link.WanLink` s: K TCP streams per link (what
fills a long link), exactly-once chunks, CURVE, bounded sizes, and in a
rehearsal the WAN emulator's relays shaped like the plan's links. So the
library does what it is good at (inside a DC) and this module the rest.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agents.dp.group import (
    DEFAULT_BUCKET_CAP_MB,
    DataParallelGroup,
    adopt_grads,
    all_gather_flat,
    local_tensor,
    reduce_scatter_flat,
)
from agents.wan.link import WanLink
from geosched.errors import GeoschedError, LinkError, StageError
from geosched.hierarchical import (
    DONE,
    RECV,
    RECV_ADD,
    SCALE,
    SEND,
    ChainProgress,
    Lanes,
    Op,
    SyncRole,
    chain_ops,
    check_ops,
    choose_piece_numel,
)
from geosched.optim import divides_before_sum, gradient_dtype

log = logging.getLogger(__name__)

KIND = "allreduce"
"""The WanLink message kind of every piece (``step`` = the sync's round, ``microbatch`` = the op's tag)."""


class _Bucket:
    """A flat gradient buffer of same-dtype parameters, padded for the in-DC reduce-scatter, and its lane.

    It holds the local gradients: a DTensor parameter's (tensor parallelism) is its shard's. On a GPU the
    in-DC collectives run on the device buffers and the WAN operations on ``wan``, the lane's copy in pinned
    host memory (the links move host memory): filled from the lane once the DC's reduce-scatter is in, copied
    back when the lane is final, before its all-gather."""

    def __init__(self, params: list[nn.Parameter], layout: Lanes, exchanges: bool) -> None:
        dtype, device = gradient_dtype(params[0]), params[0].device
        self.params, self.layout = params, layout
        self.flat = torch.zeros(layout.padded, dtype=dtype, device=device)  # (dc_replicas * lane,), zero padding
        self.views, offset = [], 0
        for p in params:
            shape = local_tensor(p).shape
            self.views.append(self.flat[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()
        one = layout.dc_replicas == 1
        lane = self.flat if one else torch.zeros(layout.lane_numel, dtype=dtype, device=device)
        self.lane = lane  # (lane,) this replica's piece
        on_host = device.type == "cpu"
        self.wan = lane if on_host or not exchanges else torch.empty(layout.lane_numel, dtype=dtype, pin_memory=True)
        self.scratch = torch.empty(layout.lane_numel, dtype=dtype) if exchanges else None  # partial sums received

    def to_host(self) -> None:
        """The DC's reduced lane into ``wan``, where the WAN operations run (a no-op on the CPU)."""
        if self.wan is not self.lane:
            self.wan.copy_(self.lane)

    def from_host(self) -> None:
        """The final lane back from ``wan`` onto the device, for the all-gather (a no-op on the CPU)."""
        if self.wan is not self.lane:
            self.lane.copy_(self.wan)


class CrossDcSync:
    """The gradient sync of one rank of a stage synced across DCs (see the module docstring).

    ``links``: this rank's gradient links by chain direction (-1 previous DC, +1 next), from
    :class:`~agents.crossdc.links.SyncLinks`; ``group``: the stage's in-DC group (None: one replica here);
    ``replicas``: the sub-group of it the in-DC collectives run over (tensor parallelism: the mesh's "dp"
    group, this tp rank of every replica here; None: the whole group). With tensor parallelism every tp
    rank syncs its local shards: tp rank j's lane partners are tp rank j of the other DCs' replicas.
    """

    def __init__(
        self,
        sync: SyncRole,
        links: Mapping[int, WanLink],
        group: DataParallelGroup | None,
        *,
        replicas: dist.ProcessGroup | None = None,
        name: str,
        timeout_s: float = 120.0,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    ) -> None:
        k = len(sync.chain)
        if sync.lane is not None:
            need = {d for d, there in ((-1, sync.position > 0), (+1, sync.position < k - 1)) if there}
            if set(links) != need:
                raise StageError(f"{name}: gradient links {sorted(links)} but chain position needs {sorted(need)}")
        size = 1 if group is None else group.size if replicas is None else dist.get_world_size(replicas)
        if size != sync.dc_replicas:
            raise StageError(f"{name}: in-DC group of {size} for {sync.dc_replicas} replicas")
        self.sync, self.links, self.group, self.name = sync, dict(links), group, name
        self.replicas, self.in_dc = replicas, size
        self.timeout_s, self.bucket_cap_mb = timeout_s, bucket_cap_mb
        self.round = 0  # WanLink "step" of the messages: every rank of the chain counts its syncs alike
        self.bytes_sent: dict[str, int] = {}  # peer DC -> payload bytes queued on the gradient links so far
        self._key: tuple[int, ...] | None = None
        self._buckets: list[_Bucket] = []
        self._ops: list[Op] = []

    # ------------------------------------------------------------ one sync

    def allreduce_gradients(self, module: nn.Module) -> None:
        """Replace every ``.grad`` of ``module`` by its mean over the stage's replicas in every DC."""
        buckets = self._prepare([p for p in module.parameters() if p.requires_grad])
        for bucket in buckets:
            adopt_grads(bucket.params, bucket.views)
            if divides_before_sum(bucket.flat):  # fp16: every replica's part of the mean before any sum
                bucket.flat.div_(self.sync.replicas)
        try:
            works = [self._collective("reduce-scatter", reduce_scatter_flat, b.lane, b.flat) for b in buckets]
            gathers = self._exchange(buckets, works)
            for work in gathers:
                self._wait_work(work, "in-DC all-gather")
        finally:
            self.round += 1

    def _exchange(self, buckets: Sequence[_Bucket], works: list[Any]) -> list[Any]:
        """Run this position's operations; return the in-DC all-gathers started."""
        posted: dict[int, concurrent.futures.Future[torch.Tensor]] = {}
        for op in self._ops:  # every receive lands where it belongs: nothing is staged
            if op.kind in (RECV, RECV_ADD):
                bucket = buckets[op.bucket]
                into = bucket.scratch if op.kind == RECV_ADD else bucket.wan
                assert into is not None
                posted[op.tag] = self.links[op.peer].start_recv(
                    step=self.round, microbatch=op.tag, kind=KIND, out=into[op.lo : op.hi], timeout_s=self.timeout_s
                )
        sends: list[tuple[Op, concurrent.futures.Future[None]]] = []
        gathers: list[Any] = []
        reduced = 0  # buckets whose in-DC reduce-scatter has been awaited
        progress = ChainProgress(self._ops)
        while not progress.finished:
            ready = progress.ready(lambda op: posted[op.tag].done())
            if not ready:  # every region waits for a message: sleep until one comes (or fails)
                waiting = [posted[op.tag] for op in progress.waiting()]
                concurrent.futures.wait(
                    waiting, timeout=self.timeout_s + 10.0, return_when=concurrent.futures.FIRST_COMPLETED
                )
                if not any(future.done() for future in waiting):
                    raise LinkError(f"{self.name}: no cross-DC gradient piece arrived within {self.timeout_s:g} s")
                continue
            for op in ready:
                while reduced <= op.bucket:
                    self._wait_work(works[reduced], "in-DC reduce-scatter")
                    buckets[reduced].to_host()
                    reduced += 1
                self._run(op, buckets[op.bucket], posted, sends, gathers)
                progress.ran(op)
        for index in range(reduced, len(buckets)):  # a replica without a lane only relays its DC's reduction
            self._wait_work(works[index], "in-DC reduce-scatter")
            gathers.append(self._collective("all-gather", all_gather_flat, buckets[index].flat, buckets[index].lane))
        for op, future in sends:
            self._wait(future, op)
        return gathers

    def _run(self, op: Op, bucket: _Bucket, posted: dict[int, Any], sends: list[Any], gathers: list[Any]) -> None:
        """One operation on ``bucket``'s lane (its receive, if any, has arrived)."""
        region = bucket.wan[op.lo : op.hi]
        if op.kind == SEND:
            sends.append((op, self.links[op.peer].start_send(region, step=self.round, microbatch=op.tag, kind=KIND)))
            peer = self.sync.next if op.peer > 0 else self.sync.prev
            assert peer is not None  # chain_ops only sends to neighbours that exist
            self.bytes_sent[peer.dc] = self.bytes_sent.get(peer.dc, 0) + region.numel() * region.element_size()
        elif op.kind in (RECV, RECV_ADD):
            self._wait(posted.pop(op.tag), op)
            if op.kind == RECV_ADD:
                assert bucket.scratch is not None
                region.add_(bucket.scratch[op.lo : op.hi])  # partial + own: addition commutes bit for bit
        elif op.kind == SCALE:
            if not divides_before_sum(region):  # fp16 was divided before the sums
                region.div_(self.sync.replicas)
        elif op.kind == DONE:
            bucket.from_host()
            gathers.append(self._collective("all-gather", all_gather_flat, bucket.flat, bucket.lane))

    # ------------------------------------------------------------ buckets and their plan

    def _prepare(self, params: list[nn.Parameter]) -> list[_Bucket]:
        """The buckets (and this position's operations) for ``params``, built on first use."""
        key = tuple(id(p) for p in params)
        if key == self._key:
            return self._buckets
        sync, cap = self.sync, max(1, int(self.bucket_cap_mb * 2**20))
        groups: list[list[nn.Parameter]] = []
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        size: dict[torch.dtype, int] = {}
        for p in reversed(params):  # backward order, as DDP does
            dtype = gradient_dtype(p)  # fp32 gradients of bf16 weights
            current = by_dtype.setdefault(dtype, [])
            if not current:
                groups.append(current)
            current.append(p)
            size[dtype] = size.get(dtype, 0) + local_tensor(p).numel() * dtype.itemsize
            if size[dtype] >= cap:
                del by_dtype[dtype], size[dtype]
        exchanges = sync.lane is not None and len(sync.chain) > 1
        self._buckets = [
            _Bucket(g, Lanes(sum(local_tensor(p).numel() for p in g), sync.dc_replicas, sync.lanes), exchanges)
            for g in groups
        ]
        self._ops = []
        if sync.lane is not None:
            lanes = [b.layout.lane_numel for b in self._buckets]
            piece = choose_piece_numel(lanes, self._buckets[0].flat.element_size())
            k = len(sync.chain)
            plans = [chain_ops(p, k, lanes, piece) for p in range(k)]
            check_ops(plans)  # the schedule cannot deadlock and every message has its receiver
            self._ops = plans[sync.position]
        self._key = key
        log.debug("%s: %d gradient buckets, %d cross-DC operations per step", self.name, len(groups), len(self._ops))
        return self._buckets

    # ------------------------------------------------------------ waiting, with names

    def _collective(self, what: str, fn: Any, output: torch.Tensor, source: torch.Tensor) -> Any:
        """Start an in-DC collective (None with one replica in the DC: the lane is the bucket)."""
        if self.group is None or self.in_dc == 1:
            return None
        with self.group.guard(f"{self.name}: in-DC {what}"):
            return fn(output, source, group=self.replicas, async_op=True)

    def _wait_work(self, work: Any, what: str) -> None:
        if work is None:
            return
        assert self.group is not None
        with self.group.guard(f"{self.name}: {what}"):
            work.wait()

    def _wait(self, future: concurrent.futures.Future[Any], op: Op) -> None:
        """The result of a link future; failures name the op and the DC at the other end."""
        peer = self.sync.next if op.peer > 0 else self.sync.prev
        where = f"{self.name}: cross-DC {op} with rank {peer.rank if peer else '?'} in {peer.dc if peer else '?'}"
        try:
            future.result(timeout=self.timeout_s + 10.0)  # the link enforces timeout_s; this guards a dead thread
        except concurrent.futures.TimeoutError:
            raise LinkError(f"{where}: the link's I/O thread did not answer within {self.timeout_s + 10:g} s") from None
        except GeoschedError as exc:
            cls = type(exc)
            try:
                raise cls(f"{where}: {exc}") from None
            except TypeError:
                raise LinkError(f"{where}: {exc}") from None
