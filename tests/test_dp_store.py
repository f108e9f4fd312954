"""A data-parallel group's store listens on the address it is given only (torch's binds every interface)."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from agents.dp.store import listening_store


def test_the_store_listens_on_its_host_only_and_serves_there() -> None:
    store = listening_store("127.0.0.1", 0, None, timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))  # type: ignore[attr-defined]
    client.set("joined/1", "yes")
    assert store.get("joined/1") == b"yes"
    with pytest.raises(ConnectionRefusedError):  # 127.0.0.2: this host too, another address; nothing listens there
        socket.create_connection(("127.0.0.2", store.port), timeout=5).close()
