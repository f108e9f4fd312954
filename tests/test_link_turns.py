"""Pipelines taking turns on a shared WAN link: tickets in a real TCPStore, real WanLinks through one emulated
link (agents.stage.turns)."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from polling import wait_for

from agents.layout import layout_roles
from agents.stage.turns import LinkTurns, shared_link_turns
from agents.wan.config import WanLinkConfig
from agents.wan.link import WanLink
from agents.wanem.emulator import LinkShape, WanEmulator
from geosched.errors import InputError, LinkError


@pytest.fixture
def store() -> Iterator[Any]:
    """A TCPStore on a random port (the stage group's store)."""
    master = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield master


def client(store: Any) -> Any:
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))


def fake_send(log: list[tuple[str, int, int, float]], holder: int, k: int) -> Any:
    """A send that is 'on the wire' for a few ms (transmitted then), acknowledged a little later; it logs its
    begin and end."""

    def start(transmitted: concurrent.futures.Future[None]) -> concurrent.futures.Future[None]:
        ack: concurrent.futures.Future[None] = concurrent.futures.Future()
        log.append(("begin", holder, k, time.monotonic()))

        def wire() -> None:
            time.sleep(0.003)
            log.append(("end", holder, k, time.monotonic()))
            transmitted.set_result(None)
            time.sleep(0.002)
            ack.set_result(None)

        threading.Thread(target=wire, daemon=True).start()
        return ack

    return start


def test_holders_get_the_link_one_message_at_a_time_first_ready_first_served(store) -> None:
    holders, messages = 3, 6
    log: list[tuple[str, int, int, float]] = []
    turns = [LinkTurns(lambda: client(store), "us->eu") for _ in range(holders)]
    acks: list[concurrent.futures.Future[None]] = []

    def sender(p: int) -> None:  # each holder reaches its sends at its own pace, as a schedule would
        rng = random.Random(p)
        for k in range(messages):
            time.sleep(rng.uniform(0, 0.01))
            acks.append(turns[p].submit(fake_send(log, p, k)))

    threads = [threading.Thread(target=sender, args=(p,)) for p in range(holders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    concurrent.futures.wait(acks, timeout=30)
    assert all(a.done() and a.exception() is None for a in acks)
    ordered = sorted(log, key=lambda e: e[3])
    assert [e[0] for e in ordered] == ["begin", "end"] * (holders * messages)  # never two on the link at once
    for p in range(holders):  # each holder's own messages in its order
        assert [k for what, q, k, _ in ordered if what == "begin" and q == p] == list(range(messages))
    for t in turns:  # a turn is recorded once the next holder's key is set, maybe after the ack
        assert wait_for(lambda t=t: len(t.grants) == messages, 10)
    tickets = sorted((g[0], g[1], p) for p, t in enumerate(turns) for g in t.grants)
    assert [g[0] for g in tickets] == list(range(holders * messages))  # every ticket drawn once
    granted = [p for _, _, p in sorted(tickets, key=lambda g: g[1])]
    assert granted == [p for what, p, _, _ in ordered if what == "begin"]  # the link went by ticket
    for t in turns:
        t.close()


def test_a_holder_that_dies_holding_a_ticket_fails_the_next_in_one_line(store) -> None:
    dead = client(store)
    assert dead.add("turn/us->eu/next", 1) == 1  # it drew ticket 0 and never passed the turn on
    log: list[tuple[str, int, int, float]] = []
    alive = LinkTurns(lambda: client(store), "us->eu", timeout_s=1.0)
    ack = alive.submit(fake_send(log, 1, 0))
    with pytest.raises(LinkError, match="the replica holding ticket 0 did not pass the turn on within 1 s"):
        ack.result(timeout=10)
    assert log == []  # it never got the link
    later = alive.submit(fake_send(log, 1, 1))
    with pytest.raises(LinkError, match="stopped at ticket 1"):
        later.result(timeout=1)


def test_a_failed_send_passes_the_turn_on(store) -> None:
    first = LinkTurns(lambda: client(store), "eu->us")
    second = LinkTurns(lambda: client(store), "eu->us")

    def broken(transmitted: concurrent.futures.Future[None]) -> concurrent.futures.Future[None]:
        failed: concurrent.futures.Future[None] = concurrent.futures.Future()
        failed.set_exception(LinkError("link 3 to peer is closed"))  # what a closed WanLink's send does
        return failed

    log: list[tuple[str, int, int, float]] = []
    bad = first.submit(broken)
    assert wait_for(lambda: len(first.grants) == 1, 10)  # ticket 0
    good = second.submit(fake_send(log, 1, 0))
    with pytest.raises(LinkError, match="is closed"):
        bad.result(timeout=10)
    assert good.result(timeout=10) is None and [e[0] for e in log] == ["begin", "end"]

    def refused(transmitted: concurrent.futures.Future[None]) -> concurrent.futures.Future[None]:
        raise InputError("tensor of 9 bytes is over wan.max_tensor_bytes (8)")  # what start_send raises at once

    with pytest.raises(InputError, match="max_tensor_bytes"):
        first.submit(refused).result(timeout=10)
    assert second.submit(fake_send(log, 1, 1)).result(timeout=10) is None  # the turn went on
    first.close()
    with pytest.raises(LinkError, match="closed"):
        first.submit(broken).result(timeout=1)
    second.close()


def test_ranks_of_one_stage_take_turns_on_each_wan_direction_they_send_on() -> None:
    roles = layout_roles(["us", "eu", "us"], [(0, 1), (1, 2), (2, 3)], dp=2)
    by = {(r.stage, r.replica): r for r in roles}
    master = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=30))
    made = {key: shared_link_turns(role, "127.0.0.1", master.port, timeout_s=5) for key, role in by.items()}
    try:
        assert set(made[0, 1]) == {1} and made[0, 1][1].direction == "us->eu"
        middle = made[1, 0]  # both neighbours in us: one direction, one sequence of turns for both
        assert set(middle) == {0, 2} and middle[0] is middle[2] and middle[0].direction == "eu->us"
        assert made[2, 1][1].direction == "us->eu"
        solo = layout_roles(["us", "eu"], [(0, 1), (1, 2)], dp=1)
        assert shared_link_turns(solo[0], "127.0.0.1", master.port, timeout_s=5) == {}
    finally:
        for turns in made.values():
            for t in set(turns.values()):
                t.close()


def test_real_links_through_one_emulated_link_deliver_in_the_order_the_link_was_granted(store) -> None:
    """Two replicas' links share one emulated 8 MB/s link: each message has it alone, and they arrive in the
    order of their turns, replica 1 (ready first) first, then as each reaches its next send."""
    shape = LinkShape(rtt_ms=2.0, link_bytes_per_s=8e6)
    servers, clients = [], []
    try:
        for replica in range(2):
            config = WanLinkConfig(link_id=replica, recv_timeout_s=30.0, send_timeout_s=30.0)
            servers.append(WanLink.listen("tcp://127.0.0.1:0", config))
        routes = {f"r{i}": (("127.0.0.1", s.port), shape) for i, s in enumerate(servers)}
        with WanEmulator(routes, link_ends={name: ("us", "eu") for name in routes}) as emulator:
            for i, server in enumerate(servers):
                host, port = emulator.address(f"r{i}")
                config = WanLinkConfig(link_id=i, streams=2, recv_timeout_s=30.0, send_timeout_s=30.0)
                clients.append(WanLink.connect(f"tcp://{host}:{port}", config))
                server.wait_peer(10.0)
            turns = [LinkTurns(lambda: client(store), "us->eu") for _ in range(2)]
            arrived: list[tuple[float, int, int]] = []
            receives = []
            for i, server in enumerate(servers):
                for k in range(3):
                    future = server.start_recv(step=0, microbatch=k, kind="activation")
                    future.add_done_callback(lambda _f, i=i, k=k: arrived.append((time.monotonic(), i, k)))
                    receives.append(future)
            tensor = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: 150 ms of the link
            acks = []
            for i in (1, 0):
                if i == 0:
                    time.sleep(0.2)
                for k in range(3):
                    link = clients[i]
                    acks.append(
                        turns[i].submit(
                            lambda tr, link=link, k=k: link.start_send(tensor, step=0, microbatch=k, transmitted=tr)
                        )
                    )
            for future in receives:
                assert torch.equal(future.result(timeout=30), tensor)
            assert all(a.result(timeout=30) is None for a in acks)
            assert wait_for(lambda: sum(len(t.grants) for t in turns) == 6, 10)
            by_ticket = sorted((g[0], i) for i, t in enumerate(turns) for g in t.grants)
            assert by_ticket[0][1] == 1  # ready 0.2 s before replica 0
            assert [i for _, i, _ in sorted(arrived)] == [i for _, i in by_ticket]
            for t in turns:
                t.close()
    finally:
        for link in clients + servers:
            link.close()


def test_a_store_slowed_by_a_flood_of_strangers_connections_is_said(store, caplog) -> None:
    """An attacker's trial: 3,000 empty connections to the group's store (torch's TCPStore serves them one at a
    time) made each of its operations take 3 s for minutes and the pipeline 14x slower, with nothing logged."""
    import socket

    turns = LinkTurns(lambda: client(store), "us->eu", where=f"127.0.0.1:{store.port}")
    log: list[tuple[str, int, int, float]] = []
    try:
        turns.submit(fake_send(log, 0, 0)).result(30)  # connected, a quick turn: nothing said
        strangers = []
        for i in range(3000):  # from other loopback addresses, as from other hosts
            conn = socket.socket()
            conn.setblocking(False)
            conn.bind((f"127.4.{i // 250}.{i % 250 + 1}", 0))
            conn.connect_ex(("127.0.0.1", store.port))
            strangers.append(conn)
        for conn in strangers:
            conn.close()
        with caplog.at_level("WARNING", logger="agents.stage.turns"):
            turns.submit(fake_send(log, 0, 1)).result(60)
        said = [r.getMessage() for r in caplog.records if r.name == "agents.stage.turns"]
        assert len(said) == 1 and f"group's store (127.0.0.1:{store.port}) took" in said[0], said
        assert "flooding its port" in said[0] and "docs/security.md" in said[0]
    finally:
        turns.close()
