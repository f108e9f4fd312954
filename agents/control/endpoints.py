"""Endpoints exchanged over the control plane: the address book an agent's worker looks its peers up in.

A rank publishes the endpoints it binds (its link listener, its group's
store) in its retained status; its peers learn them from those statuses and
look them up once the coordinator has started the job, through a route when
the ``start`` command gives one (a WAN emulator relay). No extra service: the
broker the job already uses carries them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from typing import Any

from geosched.errors import LinkError


class AgentStopping(LinkError):
    """The agent is shutting down; lookups and training end."""


class MqttAddressBook:
    """An :class:`~agents.stage.transport.AddressBook` over the control plane, used from the worker thread.

    ``publish`` puts an endpoint into this agent's retained status (through
    ``announce``, a coroutine run on the agent's loop). ``lookup`` waits until
    the coordinator has started the job (:meth:`open_gate`), then returns the
    route for the name if one was given, else the endpoint some live peer
    published; peers' endpoints arrive through :meth:`learn`.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        announce: Callable[[dict[str, str]], Any],
        overrides: Mapping[str, str] | None = None,
    ) -> None:
        self._loop, self._announce = loop, announce
        self._cond = threading.Condition()
        self.own: dict[str, str] = {}
        self._seen: dict[str, str] = {}
        self.found: dict[str, str] = {}  # what each lookup answered (the store a group was formed at, say)
        self._routes: dict[str, str] = dict(overrides or {})
        self._gate = False
        self._stopping: str | None = None

    def publish(self, name: str, endpoint: str) -> None:
        """Add ``endpoint`` to this agent's status (waits until it is handed to the client)."""
        with self._cond:
            self.own[name] = endpoint
            self._seen[name] = endpoint  # a rank may look up what it hosts (replica 0's group store)
            own = dict(self.own)
            self._cond.notify_all()
        future = asyncio.run_coroutine_threadsafe(self._announce(own), self._loop)
        future.result(timeout=30)

    def lookup(self, name: str, timeout_s: float) -> str:
        """The address to reach ``name`` at, once the job started; LinkError after ``timeout_s``."""
        with self._cond:
            self._cond.wait_for(lambda: self._gate or self._stopping is not None)
            found = self._cond.wait_for(
                lambda: self._stopping is not None or name in self._routes or name in self._seen, timeout=timeout_s
            )
            if self._stopping is not None:
                raise AgentStopping(f"agent stopping ({self._stopping}) while looking up {name!r}")
            if not found:
                raise LinkError(
                    f"no live agent published the endpoint {name!r} within {timeout_s:g} s "
                    "after the job started; is that rank running?"
                )
            self.found[name] = self._routes.get(name) or self._seen[name]
            return self.found[name]

    def learn(self, endpoints: Mapping[str, str]) -> None:
        """Loop side: endpoints from a live peer's status."""
        with self._cond:
            self._seen.update({str(k): str(v) for k, v in endpoints.items()})
            self._cond.notify_all()

    def open_gate(self, routes: Mapping[str, str]) -> None:
        """Loop side: the job started; ``routes`` override endpoints (e.g. WAN relays)."""
        with self._cond:
            self._routes.update({str(k): str(v) for k, v in routes.items()})
            self._gate = True
            self._cond.notify_all()

    def stop(self, reason: str) -> None:
        """Make every waiting and future lookup raise :class:`AgentStopping`."""
        with self._cond:
            self._stopping = reason
            self._cond.notify_all()
