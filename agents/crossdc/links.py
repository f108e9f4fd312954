"""The WanLinks of one rank to its lane partners in the neighbouring DCs of its stage's chain.

A rank whose stage syncs across DCs (``role.sync``, :class:`~geosched.hierarchical.SyncRole`)
and owns a lane has up to two gradient links: it *listens* for its partner in
the previous DC of the chain (endpoint :func:`~agents.layout.sync_name`,
published like a pipeline endpoint, so a rehearsal's router may hand out a WAN
emulator relay's address instead) and *connects* to its partner in the next
DC. The links are ordinary multi-stream :class:`~agents.wan.link.WanLink` s with
the plan's TCP streams for that DC pair, CURVE when keys are given (the
listener admits only the partner's public key, the connector only talks to
the partner's), messages of kind ``"allreduce"``. Open them in two phases as
the pipeline links are: :meth:`SyncLinks.listen` binds (before the job
starts), :meth:`SyncLinks.connect` connects and waits for the previous
partner. Example::

    links = SyncLinks(role, addresses=book, bind_host="127.0.0.1")
    links.listen(); links.connect()
    links.links   # {-1: link to chain[position - 1], +1: link to chain[position + 1]} (those that exist)
    links.close()
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from agents.layout import RankRole, sync_link_id, sync_name
from agents.sockets import CurveClient, CurveServer
from agents.wan.config import WanLinkConfig
from agents.wan.link import WanLink
from geosched.endpoint import tcp_endpoint
from geosched.hierarchical import SyncPeer

log = logging.getLogger(__name__)


class Endpoints(Protocol):
    """Where ranks publish what they listen on and look up their peers (``agents.stage.transport.AddressBook``)."""

    def publish(self, name: str, endpoint: str) -> None: ...

    def lookup(self, name: str, timeout_s: float) -> str: ...


class SyncLinks:
    """A rank's gradient links to its lane partners (see the module docstring); close with :meth:`close`."""

    def __init__(
        self,
        role: RankRole,
        *,
        addresses: Endpoints,
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        curve_server: Callable[[int], CurveServer] | None = None,
        curve_client: Callable[[int], CurveClient] | None = None,
        connect_timeout_s: float = 60.0,
        recv_timeout_s: float = 120.0,
        wan_config: dict[str, Any] | None = None,
        stopping: Callable[[], bool] | None = None,
    ) -> None:
        assert role.sync is not None, f"rank {role.rank} does not sync across DCs"
        self.role, self.sync = role, role.sync
        self.addresses = addresses
        self.bind_host, self.advertise_host = bind_host, advertise_host or bind_host
        self.curve_server, self.curve_client = curve_server, curve_client
        self.connect_timeout_s, self.recv_timeout_s = connect_timeout_s, recv_timeout_s
        self.wan_config = dict(wan_config or {})
        self.links: dict[int, WanLink] = {}
        self.stopping = stopping  # polled while waiting for the partner (WanLink.wait_peer)

    def _config(self, peer: SyncPeer, listener_rank: int, streams: int, **security: Any) -> WanLinkConfig:
        """The link to ``peer`` (``security``: its CURVE side, if any)."""
        options: dict[str, Any] = {
            "connect_timeout_s": self.connect_timeout_s,
            "recv_timeout_s": self.recv_timeout_s,
            "peer_name": f"stage {self.role.stage} replica {peer.replica} (rank {peer.rank} in {peer.dc}), gradients",
            **self.wan_config,
            **{key: value for key, value in security.items() if value is not None},
        }
        return WanLinkConfig(link_id=sync_link_id(listener_rank), streams=streams, **options)

    def listen(self) -> None:
        """Bind the link for the previous DC's partner (if any) and publish its endpoint."""
        peer = self.sync.prev
        if peer is None:
            return
        server = self.curve_server(peer.rank) if self.curve_server is not None else None
        config = self._config(peer, self.role.rank, 1, curve_server=server)  # the connecting side picks the streams
        link = WanLink.listen(tcp_endpoint(self.bind_host, 0), config)
        self.links[-1] = link
        name = sync_name(self.role.stage, self.role.replica, self.role.tp_rank)
        self.addresses.publish(name, tcp_endpoint(self.advertise_host, link.port))

    def connect(self) -> None:
        """Connect to the next DC's partner (if any), then wait until the previous one has connected."""
        peer = self.sync.next
        if peer is not None:
            endpoint = self.addresses.lookup(
                sync_name(self.role.stage, peer.replica, self.role.tp_rank), self.connect_timeout_s
            )
            client = self.curve_client(peer.rank) if self.curve_client is not None else None
            self.links[+1] = WanLink.connect(endpoint, self._config(peer, peer.rank, peer.streams, curve_client=client))
            log.debug("rank %d: gradient link to rank %d via %s", self.role.rank, peer.rank, endpoint)
        if -1 in self.links:
            self.links[-1].wait_peer(self.connect_timeout_s, self.stopping)

    def close(self) -> None:
        """Close both links (idempotent)."""
        for link in self.links.values():
            link.close()
        self.links.clear()
