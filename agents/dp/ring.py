"""The seeds' all-reduce algorithms on point-to-point sends, with element counts.

Three ways for G ranks, each holding N elements, to end with the element-wise
sum (or average) on every rank:

* :func:`ring_allreduce` -- split the tensor into G segments; G-1
  reduce-scatter steps, each passing one segment to the next rank (which adds
  it to its own copy), leave rank r owning the full sum of segment (r+1) mod G;
  G-1 all-gather steps then pass the finished segments around the ring.
  Every rank sends 2(G-1)N/G elements (up to segment rounding), whatever G is.
* :func:`all_to_all_allreduce` -- everyone sends everything to everyone and
  sums locally: G(G-1)N elements in total, (G-1)N per rank.
* :func:`gather_broadcast_allreduce` -- everyone sends to one root, which sums
  and sends the result back: 2(G-1)N elements through the root.

All three work in place on any floating or integer dtype and any length
(including lengths smaller than G), count what they send and receive in an
:class:`ElementCounter`, and run on the default process group unless given
another. :func:`ring_allreduce_hook` plugs the ring into
``DistributedDataParallel.register_comm_hook`` so the same training code runs
on the native or the ring path. Failures surface as the backend's
RuntimeError; :meth:`agents.dp.group.DataParallelGroup.guard` turns them
into a CollectiveError that names the missing rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from geosched.errors import InputError

Op = Literal["sum", "avg"]

#: Sub-chunk size the ring pipelines each segment into, so that adding chunk k
#: overlaps receiving chunk k+1. 1 MiB measured best for gloo on loopback
#: (64 MiB, G=2, 2 busy cores: 4 MiB and 128 KiB chunks were both slower).
DEFAULT_CHUNK_BYTES = 1 << 20


@dataclass
class ElementCounter:
    """Elements (and bytes) one rank sent and received; accumulates over calls."""

    sent_elements: int = 0
    received_elements: int = 0
    sent_bytes: int = 0
    calls: int = 0

    def reset(self) -> None:
        """Zero every count."""
        self.sent_elements = self.received_elements = self.sent_bytes = self.calls = 0


# ---------------------------------------------------------------- formulas


def segment_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``n`` elements into ``parts`` contiguous (start, end) ranges.

    The first ``n % parts`` segments get one element more, so sizes differ by
    at most one; segments are empty when ``n < parts``.
    """
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_elements_per_rank(n: int, g: int) -> float:
    """Theory: elements each rank sends in a ring all-reduce, 2(G-1)N/G."""
    return 2.0 * (g - 1) * n / g


def ring_elements_sent(n: int, g: int, rank: int) -> int:
    """Exact elements ``rank`` sends in :func:`ring_allreduce` (segment rounding included).

    Reduce-scatter sends every segment except (r+1) mod G, all-gather every
    segment except (r+2) mod G.
    """
    if g == 1:
        return 0
    sizes = [e - s for s, e in segment_bounds(n, g)]
    return 2 * n - sizes[(rank + 1) % g] - sizes[(rank + 2) % g]


def all_to_all_elements_total(n: int, g: int) -> int:
    """Theory: elements sent in total by :func:`all_to_all_allreduce`, G(G-1)N."""
    return g * (g - 1) * n


def gather_broadcast_root_elements(n: int, g: int) -> int:
    """Theory: elements through the root (received + sent) in gather-then-broadcast, 2(G-1)N."""
    return 2 * (g - 1) * n


# ---------------------------------------------------------------- helpers


def _check_tensor(tensor: torch.Tensor, op: str) -> None:
    if op not in ("sum", "avg"):
        raise InputError(f"all-reduce op must be 'sum' or 'avg' (got {op!r})")
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise InputError(f"all-reduce needs a floating or integer tensor (got {tensor.dtype}); cast it first")


def _divide(t: torch.Tensor, g: int) -> None:
    """In-place average of a summed slice; integers round toward zero."""
    if t.is_floating_point():
        t.div_(g)
    else:
        t.div_(g, rounding_mode="trunc")


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous view of ``tensor`` (a copy when it is not contiguous)."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def _write_back(flat: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """Copy ``flat`` into ``tensor`` unless it already is ``tensor``'s storage; return ``tensor``."""
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


def _begin(
    tensor: torch.Tensor, op: str, group: dist.ProcessGroup | None, counter: ElementCounter | None
) -> tuple[dist.ProcessGroup | None, int, int]:
    """Check the arguments of an all-reduce, count the call; return ``(group, rank, size)``."""
    _check_tensor(tensor, op)
    if counter is not None:
        counter.calls += 1
    if group is None and not dist.is_initialized():
        return None, 0, 1
    return group, dist.get_rank(group), dist.get_world_size(group)


def _exchange(
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    peer_send: int,
    peer_recv: int,
    group: dist.ProcessGroup | None,
    counter: ElementCounter | None,
) -> tuple[list[dist.Work | None], list[dist.Work]]:
    """Post irecvs (tensor, tag) from ``peer_recv`` and isends (tensor, tag) to ``peer_send``.

    Returns (one work or None per receive, the send works); empty tensors
    post nothing. Peers are ranks within ``group``.
    """
    ops: list[dist.P2POp] = []
    for t, tag in recvs:
        if t.numel():
            ops.append(dist.P2POp(dist.irecv, t, group=group, group_peer=peer_recv, tag=tag))
    for t, tag in sends:
        if t.numel():
            ops.append(dist.P2POp(dist.isend, t, group=group, group_peer=peer_send, tag=tag))
    if counter is not None:
        counter.received_elements += sum(t.numel() for t, _ in recvs)
        sent = sum(t.numel() for t, _ in sends)
        counter.sent_elements += sent
        counter.sent_bytes += sent * (sends[0][0].element_size() if sends else 0)
    works = iter(dist.batch_isend_irecv(ops) if ops else [])
    recv_works = [next(works) if t.numel() else None for t, _ in recvs]
    return recv_works, list(works)


_SCRATCH: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A receive buffer of ``numel`` elements, reused across calls (grows, never shrinks)."""
    buf = _SCRATCH.get((dtype, device))
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[(dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def release_scratch() -> None:
    """Free the cached receive buffers (they are reallocated on the next call)."""
    _SCRATCH.clear()


def _wait(works: Sequence[dist.Work | None]) -> None:
    for w in works:
        if w is not None:
            w.wait()


# ---------------------------------------------------------------- ring


def ring_allreduce(
    tensor: torch.Tensor,
    op: Op = "sum",
    group: dist.ProcessGroup | None = None,
    counter: ElementCounter | None = None,
    chunk_elements: int | None = None,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place with the seeds' ring; returns ``tensor``.

    There are 2(G-1) steps; in step s rank r sends segment (r-s) mod G to rank
    r+1 and receives segment (r-s-1) mod G from rank r-1. In the first G-1
    steps (reduce-scatter) the received segment is added to the local one,
    which leaves rank r owning the full sum of segment (r+1) mod G; in the
    last G-1 (all-gather) it is received straight into place. What a step
    sends is always what the step before received, so each segment moves in
    sub-chunks of about ``chunk_elements`` (default: 1 MiB worth) that flow
    independently: adding or forwarding chunk k overlaps receiving chunk k+1,
    and the all-gather starts before the reduce-scatter ends. Average divides
    only the owned segment. Receives of the reduce-scatter land in one reused
    scratch buffer (see :func:`release_scratch`).
    """
    group, rank, g = _begin(tensor, op, group, counter)
    if g == 1 or tensor.numel() == 0:
        return tensor
    flat = _flat(tensor)
    segments = segment_bounds(flat.numel(), g)
    longest = max(hi - lo for lo, hi in segments)
    chunk = chunk_elements or max(1, DEFAULT_CHUNK_BYTES // flat.element_size())
    n_chunks = max(1, -(-longest // max(1, int(chunk))))
    # chunks[seg][k]: the same count for every segment, so chunk k lines up across steps
    chunks = [[(lo + a, lo + b) for a, b in segment_bounds(hi - lo, n_chunks)] for lo, hi in segments]
    slot = -(-longest // n_chunks)
    recv_buf = _scratch(n_chunks * slot, flat.dtype, flat.device)
    nxt, prv, steps = (rank + 1) % g, (rank - 1) % g, 2 * (g - 1)
    send_works: list[dist.Work] = []

    def post(step: int, k: int) -> tuple[dist.Work | None, torch.Tensor]:
        s_lo, s_hi = chunks[(rank - step) % g][k]
        r_lo, r_hi = chunks[(rank - step - 1) % g][k]
        if step < g - 1:  # reduce-scatter: into the preallocated buffer, then add
            recv = recv_buf[k * slot : k * slot + (r_hi - r_lo)]
        else:  # all-gather: straight into place
            recv = flat[r_lo:r_hi]
        tag = step * n_chunks + k
        recv_works, sends = _exchange([(flat[s_lo:s_hi], tag)], [(recv, tag)], nxt, prv, group, counter)
        send_works.extend(sends)
        return recv_works[0], recv

    pending = [post(0, k) for k in range(n_chunks)]
    for step in range(steps):
        following = []
        for k, (work, recv) in enumerate(pending):
            if work is not None:
                work.wait()
            if step < g - 1:
                lo, hi = chunks[(rank - step - 1) % g][k]
                flat[lo:hi].add_(recv)
                if step == g - 2 and op == "avg":
                    _divide(flat[lo:hi], g)
            if step + 1 < steps:
                following.append(post(step + 1, k))
        pending = following
    _wait(send_works)

    return _write_back(flat, tensor)


# ---------------------------------------------------------------- naive schemes


def all_to_all_allreduce(
    tensor: torch.Tensor,
    op: Op = "sum",
    group: dist.ProcessGroup | None = None,
    counter: ElementCounter | None = None,
) -> torch.Tensor:
    """Naive all-reduce: every rank sends its whole tensor to every other rank.

    Round k (1..G-1): send to rank r+k, receive from rank r-k into one reused
    buffer, add. (G-1)N elements leave each rank, G(G-1)N in total.
    """
    group, rank, g = _begin(tensor, op, group, counter)
    if g == 1:
        return tensor
    flat = _flat(tensor)
    scratch = _scratch(2 * flat.numel(), flat.dtype, flat.device)
    original, buf = scratch[: flat.numel()].copy_(flat), scratch[flat.numel() :]
    for k in range(1, g):
        recv_works, send_works = _exchange([(original, 0)], [(buf, 0)], (rank + k) % g, (rank - k) % g, group, counter)
        _wait([*recv_works, *send_works])
        flat.add_(buf)
    if op == "avg":
        _divide(flat, g)
    return _write_back(flat, tensor)


def gather_broadcast_allreduce(
    tensor: torch.Tensor,
    op: Op = "sum",
    group: dist.ProcessGroup | None = None,
    counter: ElementCounter | None = None,
    root: int = 0,
) -> torch.Tensor:
    """Naive all-reduce through one root: gather to ``root``, sum there, send back.

    The root receives (G-1)N and sends (G-1)N elements: 2(G-1)N through one
    rank, which is why it does not scale.
    """
    group, rank, g = _begin(tensor, op, group, counter)
    if g == 1:
        return tensor
    if not 0 <= root < g:
        raise InputError(f"gather root must be in [0, {g}) (got {root})")
    flat = _flat(tensor)
    if rank == root:
        buf = _scratch(flat.numel(), flat.dtype, flat.device)
        for peer in range(g):
            if peer != root:
                _wait(_exchange([], [(buf, 0)], peer, peer, group, counter)[0])
                flat.add_(buf)
        if op == "avg":
            _divide(flat, g)
        works: list[dist.Work | None] = []
        for peer in range(g):
            if peer != root:
                works += _exchange([(flat, 0)], [], peer, peer, group, counter)[1]
        _wait(works)
    else:
        _wait(_exchange([(flat, 0)], [], root, root, group, counter)[1])
        _wait(_exchange([], [(flat, 0)], root, root, group, counter)[0])
    return _write_back(flat, tensor)


# ---------------------------------------------------------------- DDP hook


@dataclass
class RingHookState:
    """State for :func:`ring_allreduce_hook`: the group and this rank's element counter."""

    group: dist.ProcessGroup | None = None
    counter: ElementCounter = field(default_factory=ElementCounter)
    chunk_elements: int | None = None


def ring_allreduce_hook(
    state: RingHookState,
    bucket: dist.GradBucket,  # type: ignore[name-defined]  # torch.distributed re-exports it implicitly
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the gradient bucket with :func:`ring_allreduce`.

    Usage: ``ddp.register_comm_hook(RingHookState(), ring_allreduce_hook)``.
    """
    buffer = bucket.buffer()
    ring_allreduce(buffer, "avg", state.group, state.counter, state.chunk_elements)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut


# DDP compares the hook's annotations with the real objects, not the strings
# that ``from __future__ import annotations`` leaves.
ring_allreduce_hook.__annotations__.update(
    bucket=dist.GradBucket,  # type: ignore[attr-defined]  # torch.distributed re-exports it implicitly
    state=RingHookState,
    **{"return": torch.futures.Future[torch.Tensor]},
)
