"""Shared pytest fixtures: one torch thread for tiny models, a loopback WanLink pair, the corpus dataset,
real MQTT brokers (Mosquitto and the embedded one; the helpers behind them are in ``mqtt_brokers``)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from mqtt_brokers import BROKER_KINDS, running_broker

if TYPE_CHECKING:
    from mqtt_brokers import RunningBroker

    from geosched.data import TextDataset

if os.environ.get("PYTEST_XDIST_WORKER"):
    # An xdist worker ignores SIGINT, and the processes the tests start would inherit that: `launch` and the
    # agents keep an ignored SIGINT ignored (as a background job's), so a test's Ctrl-C would do nothing.
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


@pytest.fixture(scope="module")
def dataset(request: pytest.FixtureRequest) -> TextDataset:
    """The shipped corpus as a TextDataset, cut as the test module's ``DATASET`` dict says (seq_len, seed)."""
    from geosched.data import TextDataset, default_corpus_paths

    return TextDataset(default_corpus_paths(), **request.module.DATASET)


@pytest.fixture(params=BROKER_KINDS)
def mqtt_broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RunningBroker]:
    """A running broker with password auth, once per kind (mosquitto, embedded)."""
    with running_broker(request.param, tmp_path) as broker:
        yield broker


@pytest.fixture
def mosquitto_broker(tmp_path: Path) -> Iterator[RunningBroker]:
    """A private Mosquitto with password auth (anonymous if mosquitto_passwd is missing)."""
    with running_broker("mosquitto", tmp_path) as broker:
        yield broker


@pytest.fixture
def embedded_broker() -> Iterator[RunningBroker]:
    """geosched's embedded broker on a background thread, with password auth."""
    with running_broker("embedded", None) as broker:
        yield broker
