"""How a pipeline stage moves tensors to and from its neighbour stages.

The stage runtime only sees the small :class:`StageTransport` protocol:
``send`` (queues, never waits for the wire), ``recv`` (blocks, with a
timeout), ``poll`` (has it arrived? the prefill service uses it between
chunks to learn whether training can resume) and byte counters per peer.

:class:`LinkTransport` implements it over one :class:`~agents.wan.link.WanLink`
per neighbour: pipeline replica r of stage s talks to replica r of stage
s +- 1, each pair over its own link. Between DCs the link goes through the
WAN (a WAN emulator relay in tests and ``geosched launch``); between two
stages in the same DC it is the same WanLink over the DC network (loopback on
one machine) with one stream and no relay: one code path, measured, with
exactly-once delivery, and fast enough for activations (torch.distributed
p2p would tie the two stages into one process group, which the DP group
already uses).

The downstream stage listens, the upstream one connects. Endpoints are
exchanged through an :class:`AddressBook`: a listener publishes its bound
endpoint (port 0: the OS picks a free one) and the connector looks it up.
:class:`StoreAddressBook` keeps them in a torch ``TCPStore``; with
``routed=True`` a router (see :class:`RelayRouter`) sits between publish and
lookup and may hand out a WAN relay's address instead.

Where the plan compresses a WAN link (``plan.links[i].compression``, which
reaches both ends as ``RankRole.compress_prev`` / ``compress_next``), the
transport sends each tensor to that peer as its :mod:`agents.wan.compress`
payload (a uint8 message: one fp32 scale per 64 values, one byte a value) and
decodes what it receives from it into the boundary tensor the runtime expects
(:func:`boundary_codecs`: the stage boundary's dtype and shape, a tp rank's
1/t slice of it), refusing in one line anything else. The codec runs on the
calling (training) thread, where the cost model charges it.

A stage on a GPU (``device``, :mod:`agents.stage.device`) hands the transport device tensors: each leaves
for the host after its codec (so a compressed link copies only the payload) and what arrives goes to the
device before its codec decodes it; the links themselves move host memory.

Where a WAN link is shared by the replicas of a stage (:meth:`LinkTransport.take_turns`), each send waits for
the rank's turn on it (:mod:`agents.stage.turns`) on a thread of its own, not the caller's.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch import Tensor

from agents.layout import RankRole, pipe_name, sync_name
from agents.stage.turns import LinkTurns
from agents.wan.compress import TensorCodec
from agents.wan.link import WanLink
from geosched.config import JobSpec
from geosched.endpoint import tcp_address, tcp_endpoint
from geosched.errors import LinkError, ProtocolError, StageError
from geosched.model import PRECISION_DTYPES

log = logging.getLogger(__name__)

ROUTED_PREFIXES = ("pipe/", "sync/")
"""Endpoints a router may put a relay in front of: pipeline links and cross-DC gradient links."""
KIND_NAMES = {"F": "activation", "B": "gradient"}
"""Message kinds of the schedule ("F" activation, "B" gradient) -> WanLink kinds."""
VALUE_KIND = "control"
"""The WanLink kind of a step's agreement values (the gradients' square sum, :meth:`LinkTransport.send_value`)."""


class StageTransport(Protocol):
    """Moves activations ("F") and gradients ("B") between a stage and its neighbours."""

    def send(self, tensor: Tensor, peer_stage: int, kind: str, step: int, microbatch: int) -> None:
        """Queue ``tensor`` for ``peer_stage``; returns at once (do not modify the tensor afterwards)."""
        ...

    def recv(self, peer_stage: int, kind: str, step: int, microbatch: int, timeout: float | None = None) -> Tensor:
        """Block until the message from ``peer_stage`` arrives; LinkError after ``timeout`` seconds."""
        ...

    def poll(self, peer_stage: int, kind: str, step: int, microbatch: int) -> bool:
        """True once the message has fully arrived (a later ``recv`` will not wait). The first poll of a message
        may post its receive: the runtime polls each receive an action or two before it needs it."""
        ...

    def bytes_sent(self) -> dict[int, int]:
        """Bytes queued for each peer stage so far."""
        ...

    def send_value(self, value: float, peer_stage: int, step: int) -> None:
        """Queue ``step``'s one value for ``peer_stage`` (:mod:`agents.stage.step_agreement`); returns at once."""
        ...

    def recv_value(self, peer_stage: int, step: int, timeout: float | None = None) -> float:
        """``step``'s value from ``peer_stage``; LinkError after ``timeout`` seconds."""
        ...

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued send is acknowledged by its peer."""
        ...

    def close(self) -> None:
        """Release the links."""
        ...


def link_id(upstream_stage: int, replica: int) -> int:
    """The id both ends of the link between stage s and s+1 of pipeline replica r agree on."""
    return ((upstream_stage + 1) << 16) | replica


def boundary_codecs(job: JobSpec, role: RankRole) -> dict[int, TensorCodec]:
    """The rank's compressed links (peer stage -> codec), as its plan says, each for the one tensor a pipeline
    link carries both ways: (microbatch, seq_len, hidden / tp) at the job's precision (activations forward,
    their gradients back; a tp rank sends its slice)."""
    shape = (job.batch, job.model.seq_len, job.model.hidden // role.tp_size)
    dtype = PRECISION_DTYPES[job.precision]
    codecs = {role.stage - 1: role.compress_prev, role.stage + 1: role.compress_next}
    return {peer: TensorCodec(codec, dtype, shape) for peer, codec in codecs.items() if codec != "none"}


class LinkTransport:
    """A :class:`StageTransport` over one WanLink per neighbour stage.

    Receives are posted on the link as soon as they are polled or awaited, so a
    message lands straight in its tensor. Sends return a future at once; a
    failed send is raised by the next call (and by :meth:`flush`). ``codecs``:
    the peers whose links travel compressed, and how (:func:`boundary_codecs`).
    """

    def __init__(
        self,
        links: Mapping[int, WanLink],
        *,
        stage: int,
        codecs: Mapping[int, TensorCodec] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.links = dict(links)
        self.stage = stage
        self.codecs = dict(codecs or {})
        self.device = None if device is None or device.type == "cpu" else device  # None: tensors stay on the host
        self._sent = {peer: 0 for peer in self.links}
        self._pending_sends: list[tuple[str, concurrent.futures.Future[None]]] = []
        self._posted: dict[tuple[int, str, int, int], concurrent.futures.Future[Tensor]] = {}
        self.turns: dict[int, LinkTurns] = {}  # peers whose link this rank shares, taking turns (take_turns)

    def take_turns(self, turns: Mapping[int, LinkTurns]) -> None:
        """From now on, send to these peers only in this rank's turns on their shared link
        (:mod:`agents.stage.turns`)."""
        self.turns.update(turns)

    def _link(self, peer: int) -> WanLink:
        link = self.links.get(peer)
        if link is None:
            raise StageError(f"stage {self.stage} has no link to stage {peer} (links to {sorted(self.links)})")
        return link

    def send(self, tensor: Tensor, peer_stage: int, kind: str, step: int, microbatch: int) -> None:
        """Queue the tensor on the link to ``peer_stage``."""
        self._raise_failed_sends()
        link = self._link(peer_stage)
        codec = self.codecs.get(peer_stage)
        if codec is not None:
            try:
                tensor = codec.encode(tensor)  # (4 nb + n,) uint8: what crosses the WAN
            except ProtocolError as exc:
                raise StageError(
                    f"stage {self.stage}: {KIND_NAMES[kind]} of step {step} microbatch {microbatch} for stage "
                    f"{peer_stage} cannot travel {codec.codec}: {exc}"
                ) from None
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")  # the links move host memory; waits for the kernels that made it
        turns = self.turns.get(peer_stage)
        if turns is None:
            future = link.start_send(tensor, step=step, microbatch=microbatch, kind=KIND_NAMES[kind])
        else:
            future = turns.submit(
                lambda transmitted: link.start_send(
                    tensor, step=step, microbatch=microbatch, kind=KIND_NAMES[kind], transmitted=transmitted
                )
            )
        self._sent[peer_stage] += tensor.numel() * tensor.element_size()
        self._pending_sends.append((f"{kind} step {step} microbatch {microbatch} to stage {peer_stage}", future))

    def _posted_recv(self, peer: int, kind: str, step: int, microbatch: int) -> concurrent.futures.Future[Tensor]:
        key = (peer, kind, step, microbatch)
        future = self._posted.get(key)
        if future is None:
            codec = self.codecs.get(peer)
            out = codec.buffer() if codec is not None else None  # a payload of another size is refused
            future = self._link(peer).start_recv(step=step, microbatch=microbatch, kind=KIND_NAMES[kind], out=out)
            self._posted[key] = future
        return future

    def poll(self, peer_stage: int, kind: str, step: int, microbatch: int) -> bool:
        """Post the receive if needed; True if it has completed."""
        return self._posted_recv(peer_stage, kind, step, microbatch).done()

    def recv(self, peer_stage: int, kind: str, step: int, microbatch: int, timeout: float | None = None) -> Tensor:
        """The tensor of ``(step, microbatch, kind)`` from ``peer_stage``."""
        self._raise_failed_sends()
        future = self._posted_recv(peer_stage, kind, step, microbatch)
        codec = self.codecs.get(peer_stage)
        try:
            tensor = future.result(timeout=timeout)
            del self._posted[(peer_stage, kind, step, microbatch)]
            if self.device is not None:
                tensor = tensor.to(self.device)
            return tensor if codec is None else codec.decode(tensor)
        except concurrent.futures.TimeoutError:
            raise LinkError(
                f"stage {self.stage}: no {KIND_NAMES[kind]} for step {step} microbatch {microbatch} from stage "
                f"{peer_stage} ({self._link(peer_stage).peer}) within {timeout:g} s; is that stage running?"
            ) from None
        except ProtocolError as exc:  # only compressed links expect a given message; the plan says both ends do
            expected = codec.describe() if codec is not None else "uncompressed tensor"
            raise LinkError(
                f"stage {self.stage}: the {KIND_NAMES[kind]} of step {step} microbatch {microbatch} from stage "
                f"{peer_stage} ({self._link(peer_stage).peer}) is not the {expected} this link carries: {exc}"
            ) from None

    def bytes_sent(self) -> dict[int, int]:
        """Bytes queued per peer stage since the transport was made."""
        return dict(self._sent)

    def send_value(self, value: float, peer_stage: int, step: int) -> None:
        """Queue ``step``'s value for ``peer_stage``: one fp64, never compressed, outside any turns (it is
        not a message of the schedule)."""
        self._raise_failed_sends()
        future = self._link(peer_stage).start_send(
            torch.tensor([value], dtype=torch.float64), step=step, microbatch=0, kind=VALUE_KIND
        )
        self._pending_sends.append((f"the agreement value of step {step} to stage {peer_stage}", future))

    def recv_value(self, peer_stage: int, step: int, timeout: float | None = None) -> float:
        """``step``'s value from ``peer_stage``: a square sum, so a negative one is refused (NaN and infinity
        are not: they say that a gradient was not finite)."""
        self._raise_failed_sends()
        out = torch.zeros(1, dtype=torch.float64)  # a payload of another size is refused by the link
        future = self._link(peer_stage).start_recv(step=step, microbatch=0, kind=VALUE_KIND, out=out)
        try:
            value = float(future.result(timeout=timeout)[0])
        except concurrent.futures.TimeoutError:
            raise LinkError(
                f"stage {self.stage}: no agreement value for step {step} from stage {peer_stage} "
                f"({self._link(peer_stage).peer}) within {timeout:g} s; is that stage running?"
            ) from None
        if value < 0:
            raise ProtocolError(
                f"stage {self.stage}: the gradients' square sum of step {step} from stage {peer_stage} must not "
                f"be negative, got {value}"
            )
        return value

    def _raise_failed_sends(self) -> None:
        still = []
        for what, future in self._pending_sends:
            if not future.done():
                still.append((what, future))
            elif future.exception() is not None:
                raise LinkError(f"stage {self.stage}: sending {what} failed: {future.exception()}")
        self._pending_sends = still

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every send has been acknowledged; LinkError naming the first that failed."""
        for what, future in self._pending_sends:
            try:
                future.result(timeout=timeout)
            except concurrent.futures.TimeoutError:
                raise LinkError(f"stage {self.stage}: {what} not acknowledged within {timeout:g} s") from None
            except LinkError as exc:
                raise LinkError(f"stage {self.stage}: sending {what} failed: {exc}") from None
        self._pending_sends = []

    def close(self) -> None:
        """Close every link and turn (pending operations fail with LinkError)."""
        for turns in set(self.turns.values()):
            turns.close()
        self.turns.clear()
        for link in self.links.values():
            link.close()
        self.links.clear()
        self._posted.clear()


# ---------------------------------------------------------------------------- addresses


class AddressBook(Protocol):
    """Where ranks publish the endpoints they listen on and look up their peers'."""

    def publish(self, name: str, endpoint: str) -> None:
        """Make ``endpoint`` known under ``name``."""
        ...

    def lookup(self, name: str, timeout_s: float) -> str:
        """The endpoint published under ``name``; waits up to ``timeout_s`` for it."""
        ...


class StoreAddressBook:
    """An :class:`AddressBook` in a torch ``TCPStore`` (host it with ``is_master=True``, port 0 is fine).

    With ``routed=True``, link endpoints (pipeline and cross-DC gradient links, :data:`ROUTED_PREFIXES`)
    are published under ``bound/<name>``
    and looked up under ``<name>``: a :class:`RelayRouter` fills in the
    address peers should connect to (a WAN relay's, or the bound one).
    ``prefix`` keeps the names of successive runs on one store apart.
    """

    def __init__(self, store: Any, *, routed: bool = False, prefix: str = "") -> None:
        self.store = store
        self.routed = routed
        self.prefix = prefix

    @classmethod
    def connect(
        cls, host: str, port: int, *, routed: bool = False, prefix: str = "", timeout_s: float = 60.0
    ) -> StoreAddressBook:
        """A client of the store at ``host:port``."""
        import torch.distributed as dist

        store = dist.TCPStore(  # type: ignore[attr-defined]  # torch.distributed re-exports it implicitly
            host, port, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
        return cls(store, routed=routed, prefix=prefix)

    def key(self, name: str) -> str:
        """The store key of ``name``."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def publish(self, name: str, endpoint: str) -> None:
        """Write ``endpoint`` under ``name`` (or ``bound/<name>`` when routed)."""
        if self.routed and name.startswith(ROUTED_PREFIXES):
            name = f"bound/{name}"
        self.store.set(self.key(name), endpoint)

    def set_route(self, name: str, endpoint: str) -> None:
        """Router side: the endpoint peers of ``name`` connect to."""
        self.store.set(self.key(name), endpoint)

    def lookup(self, name: str, timeout_s: float) -> str:
        """Wait for ``name`` and return it; LinkError naming it after ``timeout_s``."""
        key = self.key(name)
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
            endpoint: str = self.store.get(key).decode()  # the store holds bytes
            return endpoint
        except RuntimeError as exc:  # torch reports store timeouts as RuntimeError subclasses
            raise LinkError(
                f"no endpoint published as {name!r} within {timeout_s:g} s ({str(exc).splitlines()[0]}); "
                f"is the peer rank running?"
            ) from None


@dataclass(frozen=True)
class Route:
    """One pipeline link to route: the listener's name and, if it crosses the WAN, its shape."""

    name: str
    relay_shape: Any | None  # agents.wanem.emulator.LinkShape, or None for a direct (intra-DC) link


def pipeline_routes(roles: Sequence[RankRole], wan_shape: Callable[[str, str], Any | None]) -> list[Route]:
    """The links a :class:`~agents.stage.transport.RelayRouter` routes: one per (stage >= 1, replica, tp rank).

    ``wan_shape(prev_dc, dc)`` gives the relay's LinkShape for a link between
    two DCs (None: connect directly); links inside a DC never get a relay.
    """
    return [
        Route(pipe_name(r.stage, r.replica, r.tp_rank), None if r.prev_dc == r.dc else wan_shape(r.prev_dc, r.dc))
        for r in roles
        if r.prev_dc is not None  # every stage but the first
    ]


def sync_routes(roles: Sequence[RankRole], wan_shape: Callable[[str, str], Any | None]) -> list[Route]:
    """The cross-DC gradient links (data parallelism across DCs) a RelayRouter routes: one per listening rank,
    shaped by ``wan_shape(client DC, listener DC)``."""
    return [
        Route(sync_name(r.stage, r.replica, r.tp_rank), wan_shape(r.sync.prev.dc, r.dc))
        for r in roles
        if r.sync is not None and r.sync.prev is not None
    ]


class RelayRouter:
    """Routes pipeline endpoints of a routed :class:`StoreAddressBook`, starting WAN relays where asked.

    Give it its own store client (``StoreAddressBook.connect``): a TCPStore
    client must not be shared between threads. For each :class:`Route` it
    waits for the listener's ``bound/<name>``, starts
    a :class:`~agents.wanem.emulator.WanRelay` to it when the route has a shape, and
    publishes the address to connect to under ``<name>``. Runs in a
    background thread; :meth:`close` stops the relays.
    """

    def __init__(
        self,
        book: StoreAddressBook,
        routes: Iterable[Route],
        *,
        timeout_s: float = 120.0,
        make_relay: Callable[[tuple[str, int], Any], Any] | None = None,
    ) -> None:
        self.book = book
        self.routes = list(routes)
        self.timeout_s = timeout_s
        self.make_relay = make_relay or _start_relay
        self.relays: dict[str, Any] = {}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="geosched-relay-router", daemon=True)

    def start(self) -> RelayRouter:
        """Route in the background."""
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for route in self.routes:
                bound = self.book.lookup(f"bound/{route.name}", self.timeout_s)
                if route.relay_shape is None:
                    self.book.set_route(route.name, bound)
                    continue
                relay = self.make_relay(tcp_address(bound), route.relay_shape)
                self.relays[route.name] = relay
                self.book.set_route(route.name, tcp_endpoint(relay.host, relay.port))
                log.info("route %s: %s via relay %s:%d", route.name, bound, relay.host, relay.port)
        except BaseException as exc:  # noqa: BLE001 - reported by close()
            self.error = exc
            log.error("relay router failed: %s", exc)

    def close(self) -> None:
        """Stop routing and close the relays."""
        self._thread.join(timeout=1.0)
        for relay in self.relays.values():
            relay.close()
        self.relays.clear()

    def __enter__(self) -> RelayRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _start_relay(target: tuple[str, int], shape: Any) -> Any:
    from agents.wanem.emulator import WanRelay

    return WanRelay(target, shape).start()
