"""Prometheus metrics: two real agents and the coordinator scraped over real HTTP, the health verdicts, the docs.

The end-to-end test runs the tiny job (us -> eu) with ``--metrics-bind
127.0.0.1:0`` (rank 0 and the coordinator over TLS, rank 1 plain HTTP) and
prefill on, scrapes each idle agent before the start (prefill metrics without
any step), answers one prefill request, trains 3 steps and scrapes again,
parsing everything with prometheus_client's own parser. The metrics server
cuts off a client that trickles its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import re
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import cli, log_tail, spawn_agent, stop_processes, tiny_plan, wait_for
from mqtt_brokers import agent_subprocess_env
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agents.metrics.families import AgentMetrics, JobMetrics
from agents.metrics.server import MetricsServer

ROOT = Path(__file__).resolve().parent.parent


TLS_FILES: list[Any] = []  # the test's TLS files (agents.tls.selfsigned.TlsFiles), once made


def _context(url: str) -> Any:
    """A client context trusting the test's CA for an https URL (None for http)."""
    from agents.tls.context import client_context

    return client_context(TLS_FILES[0].ca) if url.startswith("https://") else None


def scrape(url: str) -> dict[str, Any]:
    """name -> family of what ``url`` (a /metrics URL) serves, parsed by prometheus_client."""
    with urllib.request.urlopen(url, timeout=10, context=_context(url)) as response:
        return {f.name: f for f in text_string_to_metric_families(response.read().decode())}


def health(metrics_url: str) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON body) of the /health next to ``metrics_url``."""
    url = metrics_url.removesuffix("/metrics") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=10, context=_context(url)) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def value(families: dict[str, Any], name: str, sample: str | None = None, **labels: str) -> float:
    """The one sample ``sample`` (default ``name``) of family ``name`` whose labels include ``labels``."""
    found = [
        s.value
        for s in families[name].samples
        if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (name, labels, families[name].samples)
    return float(found[0])


@pytest.mark.slow
def test_agents_and_coordinator_serve_metrics_and_health_over_http(embedded_broker, tmp_path: Path):
    from agents.control.coordinator import start_job
    from agents.prefill.client import PrefillClient
    from agents.tls.context import server_context
    from agents.tls.selfsigned import write_rehearsal_tls

    url, job = embedded_broker.url_for("geosched"), "prom"
    plan = tiny_plan(tmp_path).read_text()
    TLS_FILES[:] = [files := write_rehearsal_tls(tmp_path / "tls")]
    flags = ("--metrics-bind", "127.0.0.1:0", "--prefill-bind", "tcp://127.0.0.1:0")
    tls = [("--metrics-tls-cert", str(files.cert), "--metrics-tls-key", str(files.key)), ("--metrics-insecure",)]
    agents = [spawn_agent(url, job, rank, dc, tmp_path, *flags, *tls[rank]) for rank, dc in enumerate(["us", "eu"])]
    job_metrics = JobMetrics(job)
    seen: dict[str, Any] = {}

    async def before_start(statuses: dict) -> dict:
        seen["urls"] = {rank: st.extra["endpoints"][f"metrics/r{rank}"] for rank, st in statuses.items()}
        seen["idle"] = {rank: await asyncio.to_thread(scrape, u) for rank, u in seen["urls"].items()}
        seen["idle_health"] = {rank: await asyncio.to_thread(health, u) for rank, u in seen["urls"].items()}
        seen["job_ready"] = await asyncio.to_thread(scrape, server.url())
        client = PrefillClient(statuses[0].extra["endpoints"]["prefill/r0"])
        try:  # answered at once by the idle service: one TTFT observation on rank 0
            seen["answer"] = await asyncio.to_thread(client.prefill, b"metrics please", deadline_s=10.0)
        finally:
            client.close()
        return {}

    try:
        context = server_context(files.cert, files.key, "--metrics-tls-cert")
        with MetricsServer("127.0.0.1", 0, job_metrics.registry, job_metrics.health, tls=context) as server:
            asyncio.run(
                start_job(
                    url,
                    job,
                    plan,
                    steps=3,
                    ready_timeout_s=60,
                    before_start=before_start,
                    out=None,
                    metrics=job_metrics,
                )
            )
            after = {rank: scrape(u) for rank, u in seen["urls"].items()}
            job_after, job_health = scrape(server.url()), health(server.url())
            agent_health = {rank: health(u) for rank, u in seen["urls"].items()}
    finally:
        stop_processes(agents)
    assert seen["urls"][0].startswith("https://127.0.0.1:") and seen["urls"][1].startswith("http://127.0.0.1:")
    assert server.url().startswith("https://") and all(u.endswith("/metrics") for u in seen["urls"].values())
    for rank, idle in seen["idle"].items():  # an idle agent: prefill metrics, no step yet
        assert value(idle, "geosched_prefill_queue_length") == 0, log_tail(tmp_path)
        assert value(idle, "geosched_prefill_requests", "geosched_prefill_requests_total", status="ok") == 0
        assert value(idle, "geosched_agent_state", state="ready") == 1
        assert "geosched_last_step" not in idle
        assert seen["idle_health"][rank] == (200, {**seen["idle_health"][rank][1], "status": "ok", "state": "ready"})
    assert value(seen["job_ready"], "geosched_job_ranks", state="ready") == 2
    assert seen["answer"].status == "ok"
    for rank, families in after.items():
        ours = {name for name in families if name.startswith("geosched_")}
        assert len(ours) >= 10, sorted(ours)
        assert families["geosched_step_seconds"].type == "histogram"
        assert value(families, "geosched_step_seconds", "geosched_step_seconds_count") == 3
        assert value(families, "geosched_last_step") == 2
        assert families["geosched_prefill_ttft_seconds"].type == "histogram"
        assert 0.0 <= value(families, "geosched_busy_fraction") <= 1.0
        assert value(families, "geosched_control_refused", "geosched_control_refused_total", reason="signature") == 0
        wan = [s for s in families["geosched_wan_sent_bytes"].samples if s.name.endswith("_total")]
        assert wan and all(s.labels["peer_dc"] == ("eu" if rank == 0 else "us") for s in wan)
        assert sum(s.value for s in wan) > 0
        assert {s.labels["reason"] for s in families["geosched_wan_dropped_frames"].samples} >= {"bad_checksum"}
        assert agent_health[rank][0] == 200 and agent_health[rank][1]["last_step"] == 2
    ttft = value(after[0], "geosched_prefill_ttft_seconds", "geosched_prefill_ttft_seconds_count")
    assert ttft == value(after[0], "geosched_prefill_requests", "geosched_prefill_requests_total", status="ok") >= 1
    assert "geosched_loss" in after[1] and "geosched_loss" not in after[0]  # the last stage has the loss
    assert value(job_after, "geosched_job_steps", "geosched_job_steps_total") == 3
    assert value(job_after, "geosched_job_step_seconds", "geosched_job_step_seconds_count") == 3
    assert value(job_after, "geosched_job_lost_metrics", "geosched_job_lost_metrics_total") == 0
    assert value(job_after, "geosched_job_last_step") == 2
    assert job_health[0] == 200 and job_health[1]["status"] == "ok"


def test_health_verdicts_and_routes_over_real_http():
    metrics = AgentMetrics(4, "unit", stale_s=10.0, grace_s=50.0)
    before = time.time()
    metrics.status({"state": "training"})
    assert metrics.health(True, now=before + 59)[0]  # before the first step: grace + stale
    ok, body = metrics.health(True, now=time.time() + 61)
    assert not ok and "no step ended for" in body["reason"] and "limit 60 s" in body["reason"]
    before = time.time()
    metrics.step({"step": 0, "iteration_s": 0.5, "busy_s": 0.2, "bubble_fraction": 0.6})
    assert metrics.health(True, now=before + 9)[0] and not metrics.health(True, now=time.time() + 11)[0]
    assert "event loop" in metrics.health(False)[1]["reason"]
    metrics.status({"state": "error", "message": "link to stage 1 lost"})
    assert metrics.health(True)[1]["reason"] == "state error: link to stage 1 lost"
    with MetricsServer("127.0.0.1", 0, metrics.registry, lambda: metrics.health(True)) as server:
        status, body = health(server.url())
        assert (status, body["status"], body["rank"]) == (503, "unhealthy", 4)
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(server.url().replace("/metrics", "/nope"), timeout=10)
        assert missing.value.code == 404 and missing.value.headers["Server"] == "geosched"  # no Python version
        assert value(scrape(server.url()), "geosched_busy_fraction") == pytest.approx(0.4)
        only = scrape(server.url() + "?name[]=geosched_busy_fraction&name[]=geosched_agent_info")
        assert set(only) == {"geosched_busy_fraction", "geosched_agent_info"}  # Prometheus' name[] filter


def test_a_slow_or_silent_client_neither_holds_the_metrics_server_nor_blocks_a_scrape(monkeypatch, tmp_path: Path):
    import agents.metrics.server as server_module
    from agents.tls.context import server_context
    from agents.tls.selfsigned import write_rehearsal_tls

    monkeypatch.setattr(server_module, "CLIENT_TIMEOUT_S", 0.5)
    TLS_FILES[:] = [files := write_rehearsal_tls(tmp_path)]
    metrics = AgentMetrics(2, "slow")
    context = server_context(files.cert, files.key, "--metrics-tls-cert")
    with MetricsServer("127.0.0.1", 0, metrics.registry, lambda: metrics.health(True), tls=context) as server:
        silent = socket.create_connection(("127.0.0.1", server.port), timeout=10)  # never says hello
        trickler = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        trickler.sendall(b"\x16\x03\x01")  # the first bytes of a TLS hello, and no more
        assert value(scrape(server.url()), "geosched_agent_info", rank="2") == 1  # served meanwhile
        started = time.monotonic()
        assert silent.recv(1) == b"" and trickler.recv(1) == b""  # both cut off at their deadline
        assert time.monotonic() - started < 5.0
        silent.close()
        trickler.close()
        assert health(server.url())[0] == 200


def test_one_address_holding_idle_connections_leaves_room_for_a_probe():
    """A client that opens connections and says nothing holds at most MAX_CLIENTS_PER_ADDRESS of the server's
    MAX_CLIENTS slots: a liveness probe from another address is still answered (it waited out 10 s before)."""
    from agents.metrics.server import MAX_CLIENTS_PER_ADDRESS

    metrics = AgentMetrics(3, "crowd")
    with MetricsServer("127.0.0.1", 0, metrics.registry, lambda: metrics.health(True)) as server:
        idle = []
        for _ in range(MAX_CLIENTS_PER_ADDRESS + 4):  # from 127.0.0.2: the loopback network, another address
            conn = socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=("127.0.0.2", 0))
            idle.append(conn)
        refused = sum(1 for conn in idle[MAX_CLIENTS_PER_ADDRESS:] if conn.recv(1) == b"")  # closed unanswered
        assert refused == 4
        assert health(server.url())[0] == 200  # from 127.0.0.1, at once
        for conn in idle:
            conn.close()


def test_a_flood_of_connections_is_answered_at_a_bounded_rate_and_scrapes_resume():
    """Beyond CONNECTIONS_BURST in a row from one address, connections are closed unanswered (before any TLS
    handshake) at more than CONNECTIONS_PER_S: a flood costs the agent's core little, and does not lock out a
    probe from another address (one shared bound did: 60 empty connects a second failed 19 of 20 scrapes)."""
    from agents.metrics.server import CONNECTIONS_BURST, CONNECTIONS_PER_S

    metrics = AgentMetrics(5, "flood")
    with MetricsServer("127.0.0.1", 0, metrics.registry, lambda: metrics.health(True)) as server:
        started, answered, closed = time.monotonic(), 0, 0
        for _ in range(300):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
                with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                    conn.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                try:
                    first = conn.recv(12)
                except ConnectionResetError:
                    first = b""
                answered, closed = answered + first.startswith(b"HTTP/1."), closed + (first == b"")
        elapsed = time.monotonic() - started
        assert answered + closed == 300 and closed > 0
        assert answered <= CONNECTIONS_BURST + CONNECTIONS_PER_S * elapsed + 1, (answered, elapsed)
        # another address (a Prometheus server, a liveness probe) is answered at once: the bound is per address
        probe = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10, source_address=("127.0.0.2", 0))
        probe.request("GET", "/health")
        assert probe.getresponse().status == 200
        probe.close()
        wait_for(lambda: _answers(server.url()), 10, "a scrape answered after the flood")


def _answers(url: str) -> bool:
    try:
        return health(url)[0] == 200
    except OSError:
        return False


def test_every_metric_is_documented_and_the_dashboard_uses_only_real_ones():
    """docs/metrics.md names every family both registries can expose; the Grafana dashboard queries no other."""
    agent = AgentMetrics(0, "docs")
    agent.step({"step": 0, "iteration_s": 1.0, "loss": 3.0, "bubble_fraction": 0.5, "busy_s": 0.5, "wan_bytes": 1})
    stream = {"index": 0, "up": True, "send_bytes_per_s": 0.0, "recv_bytes_per_s": 0.0}
    stream.update(dict.fromkeys(("bytes_sent", "bytes_received", "resends", "disconnects"), 0))
    agent.sources.update(
        control=lambda: {"received": 0, "connects": 1, "refused_unsigned": 0, "dropped_oversize": 0},
        links=lambda: [{"link_id": 1, "peer_stage": 1, "peer_dc": "eu", "streams": [stream], "drops": {"stale": 0}}],
        prefill=lambda: {"queue_len": 0, "http": {"open": 1, "inflight": 0, "timed_out": 2}},
    )
    job = JobMetrics("docs")
    job.watch([0], ["ready"], lambda: {}, lambda: {"received": 0})
    job.step_done(0, type("S", (), {"iteration_s": 1.0, "loss": 2.0, "bubble_fraction": 0.1, "wan_bytes": 5})(), [])
    names = {f.name for registry in (agent.registry, job.registry) for f in registry.collect()}
    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(geosched_[a-z_]+)", doc))
    exposed = {n + "_total" if n + "_total" in documented else n for n in names}
    assert exposed <= documented, sorted(exposed - documented)
    dashboard = (ROOT / "docs" / "grafana-dashboard.json").read_text()
    json.loads(dashboard)
    used = {re.sub(r"_(bucket|count|sum)$", "", n) for n in re.findall(r"geosched_[a-z_]+", dashboard)}
    assert used and used <= documented | names, sorted(used - documented - names)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["agent", "--mqtt", "mqtt://127.0.0.1:1", "--rank", "0", "--metrics-bind", "nowhere"], "--metrics-bind"),
        (
            ["agent", "--mqtt", "mqtt://127.0.0.1:1", "--rank", "0", "--metrics-bind", "127.0.0.1:PORT"]
            + ["--metrics-insecure"],
            "cannot serve",
        ),
        (["job", "start", "PLAN", "--mqtt", "mqtt://127.0.0.1:1", "--metrics-bind", ":70000"], "--metrics-bind"),
    ],
)
def test_bad_metrics_bind_is_one_line_and_exit_2(args: list[str], needle: str, tmp_path: Path):
    plan = str(tiny_plan(tmp_path))
    with socket.socket() as taken:  # a port something else holds
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = [a.replace("PORT", str(taken.getsockname()[1])).replace("PLAN", plan) for a in args]
        done = subprocess.run(
            cli(*args), capture_output=True, text=True, timeout=60, env=agent_subprocess_env(), cwd=ROOT
        )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and needle in lines[0], done.stderr


def test_fp16_skipped_steps_are_counted_and_the_loss_scale_shown():
    metrics = AgentMetrics(1, "job")
    for step, (skipped, scale) in enumerate([(True, 65536.0), (False, 32768.0), (True, 32768.0), (False, 16384.0)]):
        metrics.step({"step": step, "iteration_s": 0.1, "loss": 5.0, "loss_scale": scale, "skipped": skipped})
    text = generate_latest(metrics.registry).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert value(families, "geosched_skipped_steps", "geosched_skipped_steps_total") == 2
    assert value(families, "geosched_loss_scale") == 16384.0
    assert "geosched_learning_rate" not in families  # a report without a rate (an older agent's): no gauge
    plain = AgentMetrics(1, "job")  # bf16, fp32: no scale to show
    plain.step({"step": 0, "iteration_s": 0.1, "loss": 5.0, "loss_scale": None, "skipped": False, "lr": 2.5e-4})
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(plain.registry).decode())}
    assert "geosched_loss_scale" not in families
    assert value(families, "geosched_learning_rate") == 2.5e-4
    assert value(families, "geosched_skipped_steps", "geosched_skipped_steps_total") == 0


def test_the_metrics_urls_an_elastic_launch_prints_are_its_current_ranks_only() -> None:
    """After a re-plan from 4 ranks to 3, the printed list (and report.json's) still named the dead rank 3."""
    from types import SimpleNamespace

    from agents.layout import metrics_name
    from agents.rehearsal.hooks import with_metrics_urls

    async def then(statuses: dict[int, Any]) -> dict[str, str]:
        return {}

    urls = {"coordinator": "https://127.0.0.1:1/metrics"}
    hook = with_metrics_urls(then, urls, None)
    for ranks, port in ((4, 100), (3, 200)):
        statuses = {r: SimpleNamespace(extra={"endpoints": {metrics_name(r): f"u{port + r}"}}) for r in range(ranks)}
        asyncio.run(hook(statuses))
    assert urls == {"coordinator": "https://127.0.0.1:1/metrics", "r0": "u200", "r1": "u201", "r2": "u202"}


def test_clients_gone_mid_answer_print_nothing_and_what_the_server_says_hides_its_python(capfd, tmp_path: Path):
    """Clients that reset their TLS connection right after asking (a stranger, from any address) made wsgiref's
    handler print a traceback to the console each time (an attacker's 1,500 tries: 223 tracebacks, 300 KB
    in 10 s); now they go to the debug log. The standard library's own refusals name no Python version, and
    a method other than GET is not echoed back."""
    import struct

    from agents.tls.context import server_context
    from agents.tls.selfsigned import write_rehearsal_tls

    TLS_FILES[:] = [files := write_rehearsal_tls(tmp_path)]
    metrics = AgentMetrics(3, "reset")
    context = server_context(files.cert, files.key, "--metrics-tls-cert")
    client = _context("https://")
    with MetricsServer("127.0.0.1", 0, metrics.registry, lambda: metrics.health(True), tls=context) as server:
        for _ in range(30):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
                tls = client.wrap_socket(raw, server_hostname="127.0.0.1")
                tls.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                tls.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
                tls.close()
            time.sleep(0.06)  # within the per-address rate
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
            tls = client.wrap_socket(raw, server_hostname="127.0.0.1")
            tls.sendall(b"GET /" + b"a" * 70000 + b" HTTP/1.0\r\n\r\n")  # past the request line's bound
            answer = tls.recv(4096).decode(errors="replace")
        assert answer.startswith("HTTP/1.0 414") and "Server: geosched\r\n" in answer and "Python" not in answer
        connection = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=10, context=client)
        connection.request("DELETE", "/metrics")
        response = connection.getresponse()
        assert (response.status, response.read()) == (405, b"method not allowed: use GET\n")
        assert response.getheader("Allow") == "GET, HEAD"
        for path, status, kind in (("/metrics", 200, "text/plain"), ("/health", 200, "application/json")):
            connection.request("HEAD", path)  # what a health checker may send: the GET's headers, no body
            response = connection.getresponse()
            assert (response.status, response.read()) == (status, b""), path
            assert response.getheader("Content-Type").startswith(kind), response.getheaders()
        connection.close()
        assert value(scrape(server.url()), "geosched_agent_info", rank="3") == 1  # still serving

    class Gone:  # what wsgiref meets when a client is gone mid-answer, every time (the resets above: some)
        def collect(self) -> Any:
            raise ssl.SSLEOFError("EOF occurred in violation of protocol")

    broken = CollectorRegistry()
    broken.register(Gone())  # type: ignore[arg-type]
    with MetricsServer("127.0.0.1", 0, broken, lambda: metrics.health(True), tls=context) as server:
        with pytest.raises(urllib.error.HTTPError, match="500"):
            urllib.request.urlopen(server.url(), timeout=10, context=client)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "SSLEOFError" not in err, err[-2000:]


@pytest.mark.parametrize("spelling", ["0.0.0.0", "0", "::", "::0"])
def test_an_any_address_bind_is_named_by_its_advertised_host_in_log_and_url(spelling: str, caplog) -> None:
    """Bound to the any-address however written, the server names the host it is advertised at (the agent's
    --bind-host) in its warning and its URL alike; it logged 127.0.0.1 while the status published the other."""
    metrics = AgentMetrics(6, "any")
    advertised = "::1" if ":" in spelling else "127.0.0.2"  # an address the bind serves that is not 127.0.0.1
    with caplog.at_level(logging.WARNING, logger="agents.metrics.server"):
        with MetricsServer(spelling, 0, metrics.registry, lambda: metrics.health(True), advertise_host=advertised) as s:
            url = s.url()
            assert url == "http://{}:{}/metrics".format(f"[{advertised}]" if ":" in advertised else advertised, s.port)
            assert health(url)[0] == 200
    assert url in caplog.text
    with MetricsServer("0.0.0.0", 0, metrics.registry, lambda: metrics.health(True)) as server:
        assert server.url() == f"http://127.0.0.1:{server.port}/metrics"  # nothing advertised: loopback
