"""The ``before_start`` hooks of a rehearsal (``geosched launch``): what runs between every agent being ready and
``start``, given the agents' published endpoints: the prefill load started on them, each prefill HTTP URL
checked (a ``GET /v1/models`` over TLS with the run's CA and token) and printed, the Prometheus URLs noted and
printed; each hook then runs the next (the relays last, :class:`agents.rehearsal.processes.RelayRoutes`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from agents.rehearsal.processes import RelayRoutes
from agents.tls.context import client_context
from geosched.errors import GeoschedError

if TYPE_CHECKING:
    from agents.keys import JobKeys
    from agents.tls.selfsigned import TlsFiles


def with_load(relays: RelayRoutes, load: Any) -> Any:
    """A ``before_start`` hook: start the prefill load on the agents' published endpoints, then the relays."""
    from agents.layout import prefill_name

    async def hook(statuses: dict[int, Any]) -> dict[str, str]:
        endpoints = {rank: st.extra.get("endpoints", {}).get(prefill_name(rank)) for rank, st in statuses.items()}
        missing = sorted(rank for rank, ep in endpoints.items() if not ep)
        if missing:
            raise GeoschedError(f"ranks {missing} are ready but did not publish a prefill endpoint")
        load.start(endpoints)
        return await relays(statuses)

    return hook


def with_http_urls(
    then: Any, urls: dict[int, str], keys: JobKeys | None, tls: TlsFiles | None, out: TextIO | None
) -> Any:
    """A ``before_start`` hook: note (in ``urls``), check (one ``GET /v1/models`` each, over TLS with the run's CA
    and token) and print every rank's prefill HTTP URL, then run ``then``."""
    from agents.keys import PREFILL_TOKEN
    from agents.layout import prefill_http_name

    async def hook(statuses: dict[int, Any]) -> dict[str, str]:
        urls.clear()  # this attempt's ranks only: an elastic re-plan's agents are new processes
        for rank, status in sorted(statuses.items()):
            url = status.extra.get("endpoints", {}).get(prefill_http_name(rank))
            if url:
                urls[rank] = str(url)
        token = None if keys is None else keys.prefill_token()
        for rank, url in urls.items():
            await asyncio.to_thread(check_http, rank, url, token, None if tls is None else tls.ca)
        if urls and out is not None:
            secured = "no token" if keys is None else f"token in {keys.directory / PREFILL_TOKEN}"
            secured += "" if tls is None else f", CA {tls.ca}"
            listed = ", ".join(f"r{rank} {url}" for rank, url in urls.items())
            print(f"launch: prefill over HTTP ({secured}): {listed}", file=out, flush=True)
        result: dict[str, str] = await then(statuses)
        return result

    return hook


def check_http(rank: int, url: str, token: str | None, ca: Path | None) -> None:
    """GeoschedError unless ``GET url/v1/models`` answers 200 (over TLS trusting ``ca`` for an https URL)."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 0
    if parts.scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, timeout=10, context=client_context(ca)
        )
    else:
        conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", "/v1/models", headers={} if token is None else {"Authorization": f"Bearer {token}"})
        status = conn.getresponse().status
    except (OSError, http.client.HTTPException) as exc:
        raise GeoschedError(f"rank {rank}'s prefill front end at {url} does not answer: {exc}") from None
    finally:
        conn.close()
    if status != 200:
        raise GeoschedError(f"rank {rank}'s prefill front end at {url} answers GET /v1/models with {status}")


def with_metrics_urls(then: Any, urls: dict[str, str], out: TextIO | None) -> Any:
    """A ``before_start`` hook: note (in ``urls``, as ``r<rank>``) and print the Prometheus URLs, then ``then``."""
    from agents.layout import metrics_name

    async def hook(statuses: dict[int, Any]) -> dict[str, str]:
        for gone in [who for who in urls if who.startswith("r")]:  # a re-plan's ranks are new processes
            del urls[gone]
        for rank, status in sorted(statuses.items()):
            url = status.extra.get("endpoints", {}).get(metrics_name(rank))
            if url:
                urls[f"r{rank}"] = str(url)
        if urls and out is not None:
            listed = ", ".join(f"{who} {url}" for who, url in urls.items())
            print(f"launch: Prometheus metrics (and /health): {listed}", file=out, flush=True)
        result: dict[str, str] = await then(statuses)
        return result

    return hook
