"""The rendezvous store a data-parallel group's rank 0 hosts, listening on one address only.

torch's ``TCPStore`` server binds every interface whatever host it is given,
and anyone who reaches it may read and write any key (docs/security.md). It
accepts a listening socket instead (``master_listen_fd``): :func:`listening_store`
binds that socket to the agent's own bind address, so a rehearsal's store
listens on 127.0.0.1 and a host's on the address its peers use, not on every
network the machine has.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def listening_store(host: str, port: int, world_size: int | None, timeout: timedelta) -> Any:
    """A ``TCPStore`` server listening on ``host`` only (``port`` 0: a free one, its ``.port``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=1024)
    bound = listener.getsockname()[1]
    fd = listener.detach()  # the store owns it from here
    try:
        return dist.TCPStore(  # type: ignore[attr-defined]  # torch.distributed re-exports it implicitly
            host, bound, world_size, True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd
        )
    except BaseException:
        os.close(fd)
        raise
