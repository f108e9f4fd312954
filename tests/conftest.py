"""Shared pytest fixtures: one torch thread for tiny models, a loopback WanLink pair."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one intra-op thread, and the 2 CI cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def link_pair():
    """A listening and a connected WanLink on loopback (no relay: the intra-DC path)."""
    from agents.stage.transport import link_id
    from agents.wan.config import WanLinkConfig
    from agents.wan.link import WanLink

    config = WanLinkConfig(link_id=link_id(0, 0), streams=1, connect_timeout_s=10)
    listener = WanLink.listen("tcp://127.0.0.1:0", config)
    connector = WanLink.connect(f"tcp://127.0.0.1:{listener.port}", config)
    yield listener, connector
    connector.close()
    listener.close()
