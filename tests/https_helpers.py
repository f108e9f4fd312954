"""What the HTTPS endpoint tests share: a prefill front end and a metrics endpoint serving TLS with a rehearsal's
certificate on 127.0.0.1, each with a client context trusting it and a genuine client's request."""

from __future__ import annotations

import json
import ssl
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from prefill_helpers import idle_worker

from agents.metrics.families import AgentMetrics
from agents.metrics.server import MetricsServer
from agents.prefill.connections import HttpLimits
from agents.prefill.http import PrefillHttpServer
from agents.prefill.service import PrefillService
from agents.tls.context import client_context, server_context
from agents.tls.selfsigned import write_rehearsal_tls
from geosched.model import ModelShape, build_model

SHAPE = ModelShape(layers=1, hidden=16, heads=2, seq_len=32)
TOKEN = "h" * 24


@contextmanager
def https_prefill(
    tmp_path: Path, limits: HttpLimits | None = None, *, serving: bool = True
) -> Iterator[tuple[PrefillService, PrefillHttpServer, Callable[[], int]]]:
    """A service (computing on an idle worker when ``serving``) and its HTTPS front end; a function making one
    genuine completion request (with :data:`TOKEN`) and returning its status."""
    files = write_rehearsal_tls(tmp_path)
    tls = server_context(files.cert, files.key, "--prefill-http-tls-cert")
    with PrefillService(build_model(SHAPE, seed=2).eval(), auth_token=TOKEN) as service:
        with PrefillHttpServer(service, "127.0.0.1", 0, tls=tls, limits=limits) as server:
            context = client_context(files.ca)

            def ask() -> int:
                body = json.dumps({"prompt": "hi"}).encode()
                headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
                request = urllib.request.Request(f"{server.url}/v1/completions", body, headers)
                with urllib.request.urlopen(request, timeout=30, context=context) as response:
                    return int(response.status)

            if not serving:
                yield service, server, ask
                return
            with idle_worker(service):
                yield service, server, ask


@contextmanager
def https_metrics(tmp_path: Path) -> Iterator[tuple[MetricsServer, Callable[[], int]]]:
    """An agent's metrics endpoint over HTTPS; a function scraping ``/metrics`` and returning its status."""
    files = write_rehearsal_tls(tmp_path)
    metrics = AgentMetrics(0, "us")
    context = server_context(files.cert, files.key, "--metrics-tls-cert")
    with MetricsServer("127.0.0.1", 0, metrics.registry, lambda: metrics.health(True), tls=context) as server:
        trusted: ssl.SSLContext = client_context(files.ca)

        def scrape() -> int:
            with urllib.request.urlopen(server.url(), timeout=10, context=trusted) as response:
                assert b"geosched_agent_info" in response.read()
                return int(response.status)

        yield server, scrape
