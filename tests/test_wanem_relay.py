"""The WAN emulator's relay: real sockets on 127.0.0.1, random ports, real threads.

Timing is only checked as lower bounds the shaping guarantees by design
(a delay can be longer under load, never shorter), never as speed.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from agents.wanem.emulator import LinkShape, WanEmulator, WanRelay, shape_for_link
from geosched.errors import InputError


class EchoServer:
    """A threaded TCP echo server on a random port; echoes until the client half-closes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self.conns: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            thread = threading.Thread(target=self._echo, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        try:
            while data := conn.recv(1 << 20):
                conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)
        except OSError:  # reset by the relay: expected in fault tests
            pass
        finally:
            conn.close()

    def wait_idle(self) -> None:
        """Wait until every accepted connection has ended (and its socket is closed)."""
        for thread in self.threads[1:]:
            thread.join(5)

    def close(self) -> None:
        for sock in [self.sock, *self.conns]:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept() or recv()
            except OSError:
                pass
            sock.close()
        for thread in self.threads:
            thread.join(5)


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


def round_trip(port: int, payload: bytes, timeout: float = 20.0) -> bytes:
    """Send ``payload`` through the relay to the echo server, half-close, return all that comes back."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        received = bytearray()

        def read() -> None:
            while data := sock.recv(1 << 20):
                received.extend(data)

        reader = threading.Thread(target=read)
        reader.start()
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        reader.join(timeout)
        assert not reader.is_alive(), "echo did not finish"
        return bytes(received)


SHAPES = {
    "unshaped": LinkShape(),
    "delay+window": LinkShape(rtt_ms=4, window_bytes=300_000),
    "delay+link-cap": LinkShape(rtt_ms=2, link_bytes_per_s=100e6),
    "all": LinkShape(rtt_ms=2, link_bytes_per_s=100e6, window_bytes=200_000),
}


@pytest.mark.parametrize("name", SHAPES)
def test_concurrent_transfers_arrive_intact_both_ways(echo: EchoServer, name: str) -> None:
    payloads = [os.urandom(n) for n in (1, 1000, 300_000, 3_000_000)]
    results: dict[int, bytes] = {}
    with WanRelay(echo.address, SHAPES[name]) as relay:
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, round_trip(relay.port, payloads[i])))
            for i in range(len(payloads))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        stats = relay.stats()
    assert [results.get(i) == p for i, p in enumerate(payloads)] == [True] * len(payloads)
    total = sum(map(len, payloads))
    assert stats["bytes_to_target"] == total and stats["bytes_to_client"] == total
    assert stats["connections_total"] == len(payloads)


def test_delay_window_and_link_cap_are_lower_bounds(echo: EchoServer) -> None:
    with WanRelay(echo.address, LinkShape(rtt_ms=100)) as relay:
        start = time.monotonic()
        assert round_trip(relay.port, b"ping") == b"ping"
        assert time.monotonic() - start >= 0.1  # RTT/2 to the echo server, RTT/2 back
    # 400 kB through a 100 kB window at RTT 20 ms: at least 3 more RTTs after the first window
    with WanRelay(echo.address, LinkShape(rtt_ms=20, window_bytes=100_000)) as relay:
        start = time.monotonic()
        assert len(round_trip(relay.port, bytes(400_000))) == 400_000
        assert time.monotonic() - start >= 0.06
    # 1 MB at 5 MB/s: the last byte leaves >= 0.2 s after the first could
    with WanRelay(echo.address, LinkShape(link_bytes_per_s=5e6)) as relay:
        start = time.monotonic()
        assert len(round_trip(relay.port, bytes(1_000_000))) == 1_000_000
        assert time.monotonic() - start >= 0.19


def test_reset_connections_resets_clients_and_new_connections_work(echo: EchoServer) -> None:
    with WanRelay(echo.address, LinkShape(rtt_ms=2)) as relay:
        clients = [socket.create_connection(("127.0.0.1", relay.port), timeout=10) for _ in range(3)]
        try:
            for sock in clients:  # one exchange each: the relay has them all connected
                sock.sendall(b"hello")
                assert sock.recv(16) == b"hello"
            assert relay.stats()["connections_open"] == 3
            assert relay.reset_connections() == 3
            for sock in clients:
                with pytest.raises(ConnectionResetError):
                    sock.recv(16)
        finally:
            for sock in clients:
                sock.close()
        payload = os.urandom(100_000)
        assert round_trip(relay.port, payload) == payload
        stats = relay.stats()
    assert stats["resets"] == 3 and stats["reset_events"] == 1 and stats["connections_total"] == 4


def test_reset_every_s_resets_repeatedly(echo: EchoServer) -> None:
    with WanRelay(echo.address, LinkShape(), reset_every_s=0.2) as relay:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as sock:
                sock.sendall(b"x")
                assert sock.recv(1) == b"x"
                with pytest.raises(ConnectionResetError):
                    while sock.recv(16):  # nothing more comes until the periodic reset
                        pass
        assert relay.stats()["resets"] >= 3


def test_unreachable_target_resets_the_client() -> None:
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        dead = placeholder.getsockname()  # closed below: nothing listens there any more
    with WanRelay(dead, LinkShape()) as relay:
        with pytest.raises(ConnectionResetError):  # in connect() or in recv(), whichever the RST reaches
            with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as sock:
                sock.recv(16)
        assert relay.stats()["connect_failures"] == 1


def test_a_dead_target_is_one_warning_per_outage_and_its_return_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """A DC's agents killed behind a relay: its survivors reconnect every ~100 ms, and each failure to reach the
    target was a warning at powers of two (16 lines on a launch's console in 3 s, from two relays)."""
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        dead = placeholder.getsockname()
    caplog.set_level(logging.WARNING, logger="agents.wanem")
    with WanRelay(dead, LinkShape()) as relay:
        for _ in range(6):
            with pytest.raises(ConnectionResetError):
                with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as sock:
                    sock.recv(16)
        with socket.create_server(dead) as back:  # the target answers again
            with socket.create_connection(("127.0.0.1", relay.port), timeout=10):
                back.settimeout(10)
                back.accept()[0].close()
        deadline = time.monotonic() + 10
        while "reachable again" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relay.stats()["connect_failures"] == 6
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and f"cannot reach target {dead[0]}:{dead[1]}" in warnings[0], warnings
    assert f"target {dead[0]}:{dead[1]} reachable again after 6 failed connects in" in warnings[1]  # shown too


def test_a_relay_whose_supervisor_names_lost_targets_logs_an_outage_at_info(caplog: pytest.LogCaptureFixture) -> None:
    """A launch names its lost agents itself; its relays' 'cannot reach target' warnings came among its progress
    lines during each elastic recovery (an operator's trial)."""
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        dead = placeholder.getsockname()
    caplog.set_level(logging.INFO, logger="agents.wanem")
    with WanRelay(dead, LinkShape(), outage_level=logging.INFO) as relay:
        with pytest.raises(ConnectionResetError):
            with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as sock:
                sock.recv(16)
        assert relay.stats()["connect_failures"] == 1
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "cannot reach target" in r.getMessage()]
    assert [level for level, _ in said] == [logging.INFO], said


def _open_fds() -> set[str]:
    return {
        f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}"
        for fd in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{fd}")
    }


def test_close_leaves_no_thread_or_socket(echo: EchoServer) -> None:
    threads_before, fds_before = set(threading.enumerate()), _open_fds()
    relay = WanRelay(echo.address, LinkShape(rtt_ms=10, window_bytes=50_000), reset_every_s=5).start()
    idle = socket.create_connection(("127.0.0.1", relay.port), timeout=10)
    idle.sendall(b"x")
    assert idle.recv(1) == b"x"
    relay.close()
    relay.close()  # idempotent
    idle.close()
    echo.wait_idle()
    assert set(threading.enumerate()) - threads_before == set()
    assert _open_fds() - fds_before == set()
    never_started = WanRelay(echo.address, LinkShape())
    never_started.close()
    assert _open_fds() - fds_before == set()


def test_set_shape_applies_to_new_traffic(echo: EchoServer) -> None:
    with WanRelay(echo.address, LinkShape()) as relay:
        relay.set_shape(LinkShape(rtt_ms=100))
        start = time.monotonic()
        assert round_trip(relay.port, b"slow now") == b"slow now"
        assert time.monotonic() - start >= 0.1


class _Link:
    """Stands in for a config link: only the attributes shape_for_link reads."""

    def __init__(
        self, between: tuple[str, str], bandwidth_gbps: float, rtt_ms: float, per_connection_gbps: float
    ) -> None:
        self.between, self.bandwidth_gbps = between, bandwidth_gbps
        self.rtt_ms, self.per_connection_gbps = rtt_ms, per_connection_gbps
        self.egress_usd_per_gb = 0.02


def test_shape_for_link_scales_bandwidth_and_keeps_delay() -> None:
    shape = shape_for_link(_Link(("us", "eu"), 100, 40, 12.5), scale=0.01)
    assert shape.rtt_ms == 40
    assert shape.link_bytes_per_s == pytest.approx(100e9 / 8 * 0.01)
    # one connection: 125 Mb/s at 40 ms through a 1 Gb/s queue, whose window leaves W / B after its first byte
    assert shape.window_bytes == int(12.5e9 / 8 * 0.01 * 0.040 / (1 - 12.5 / 100))
    assert shape_for_link(_Link(("a", "b"), 1, 0, 0.5)).window_bytes is None
    assert shape_for_link(_Link(("a", "b"), 1, 10, 1)).window_bytes is None  # one connection fills the link
    with pytest.raises(InputError, match="scale"):
        shape_for_link(_Link(("a", "b"), 1, 10, 0.5), scale=0)


def test_bad_shapes_name_the_field() -> None:
    with pytest.raises(InputError, match="rtt_ms"):
        LinkShape(rtt_ms=-1)
    with pytest.raises(InputError, match="link_bytes_per_s"):
        LinkShape(link_bytes_per_s=0)
    with pytest.raises(InputError, match="window_bytes"):
        LinkShape(window_bytes=0)


def test_emulator_routes_each_link_and_shares_its_capacity(echo: EchoServer) -> None:
    links = [_Link(("us", "eu"), 0.08, 4, 0.04), _Link(("eu", "ap"), 0.08, 6, 0.04)]
    targets = {("us", "eu"): echo.address, ("eu", "us"): echo.address, ("eu", "ap"): echo.address}
    fds_before = _open_fds()
    with WanEmulator.from_links(links, targets, scale=1.0) as emu:
        assert set(emu.relays) == {"us-eu", "eu-us", "eu-ap"}
        us_eu, eu_us = emu.relays["us-eu"], emu.relays["eu-us"]
        assert us_eu.pacers[0] is eu_us.pacers[1] and us_eu.pacers[1] is eu_us.pacers[0]
        assert emu.relays["eu-ap"].shape.rtt_ms == 6
        payload = os.urandom(200_000)
        for route in emu.relays:
            assert round_trip(emu.address(route)[1], payload) == payload
        stats = emu.stats()
        assert all(s["bytes_to_target"] == len(payload) for s in stats.values())
    echo.wait_idle()
    assert _open_fds() - fds_before == set()
    with pytest.raises(InputError, match="no WAN link between 'us' and 'ap'"):
        WanEmulator.from_links(links, {("us", "ap"): echo.address})


def test_clients_that_vanish_do_not_hurt_the_relay(echo: EchoServer) -> None:
    with WanRelay(echo.address, LinkShape(rtt_ms=2)) as relay:
        for i in range(40):
            sock = socket.create_connection(("127.0.0.1", relay.port), timeout=10)
            if i % 2:  # half of them reset at once, the others send garbage and close
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:
                sock.sendall(os.urandom(1000))
            sock.close()
        payload = os.urandom(50_000)
        assert round_trip(relay.port, payload) == payload
        deadline = time.monotonic() + 10
        while relay.stats()["connections_open"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert relay.stats()["connections_open"] == 0
        assert relay.stats()["connections_total"] == 41


def test_connections_past_the_bound_are_reset_and_counted(echo: EchoServer, monkeypatch) -> None:
    """Anyone who reaches a relay is relayed; at most MAX_CONNECTIONS at once (each holds two 256 KiB buffers), the
    rest reset and counted while the ones held are still served."""
    import agents.wanem.emulator as emulator

    monkeypatch.setattr(emulator, "MAX_CONNECTIONS", 4)
    with WanRelay(echo.address, LinkShape()) as relay:
        held = [socket.create_connection(("127.0.0.1", relay.port), timeout=10) for _ in range(4)]
        for sock in held:  # each connected through to the echo server
            sock.sendall(b"x")
            assert sock.recv(1) == b"x"
        with pytest.raises(ConnectionResetError):
            with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as extra:
                extra.sendall(b"y")
                extra.recv(1)
        assert relay.stats()["refused_connections"] == 1
        held[0].sendall(b"z")
        assert held[0].recv(1) == b"z"
        for sock in held:
            sock.close()
