"""The prefill load of ``geosched launch --prefill-rate R``: a Poisson prompt stream over the agents' endpoints.

:class:`PrefillLoad` runs one thread in the launcher: it sends short random
byte prompts at ``rate`` requests per second (exponential gaps), each to a
randomly chosen agent's prefill endpoint, and collects every response.
:meth:`PrefillLoad.stop` stops sending and waits for the outstanding answers
(every request is answered ``ok``, ``rejected``, ``expired`` or ``error``;
one that is not within the drain time counts as ``lost``).
:func:`prefill_section` is the run report's ``prefill`` section: the client's
counts, tokens/s and TTFT percentiles, plus each agent's time split from the
``prefill-rank<R>.json`` files its worker writes. With the job's ``keys``
(a secure launch) every request carries the prefill token and goes over
CURVE to the agent's public key. Example::

    load = PrefillLoad(rate=20.0).start({0: "tcp://127.0.0.1:5555"})
    ...  # training runs
    load.stop()
    report["prefill"] = prefill_section(load, run_dir)
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agents.prefill.metrics import percentile
from geosched.errors import GeoschedError

if TYPE_CHECKING:
    from agents.keys import JobKeys

log = logging.getLogger(__name__)

STATUSES = ("ok", "rejected", "expired", "error")


class PrefillLoad:
    """A Poisson stream of random byte prompts to several prefill endpoints, on its own thread."""

    def __init__(
        self,
        rate: float,
        *,
        deadline_s: float = 5.0,
        prompt_tokens: tuple[int, int] = (8, 48),
        seed: int = 0,
        keys: JobKeys | None = None,
    ) -> None:
        self.rate, self.deadline_s, self.prompt_tokens = rate, deadline_s, prompt_tokens
        self.keys = keys
        self._rng = random.Random(seed)
        self._stop_sending = threading.Event()
        self._done = threading.Event()
        self._sent: dict[str, tuple[int, float]] = {}  # id -> (rank, send time)
        self.counts = {"sent": 0, **{s: 0 for s in STATUSES}}
        self.ok_tokens = 0
        self.ttft_s: list[float] = []
        self.per_rank_sent: dict[int, int] = {}
        self.started = self.stopped = 0.0
        self.active_s = 0.0  # seconds sending, over every start
        self.abandoned = 0  # requests to the agents of an earlier start (an elastic attempt's, gone): never answered
        self._since = 0.0  # when the current start began
        self._drain_s = deadline_s + 2.0
        self._thread: threading.Thread | None = None

    def start(self, endpoints: Mapping[int, str]) -> PrefillLoad:
        """Begin sending to ``endpoints`` (rank -> tcp://host:port); a second start (an elastic recovery's new
        agents) first ends the sending to the earlier ones, whose unanswered requests count as abandoned (one
        thread and its sockets were left behind per recovery, sending to agents that were gone)."""
        if not endpoints:
            raise GeoschedError("prefill load: no agent published a prefill endpoint")
        if self._thread is not None and self._thread.is_alive():
            self._halt(0.0)
            self.abandoned += len(self._sent)
            self._sent.clear()
        self._stop_sending.clear()
        self._thread = threading.Thread(target=self._run, args=(dict(endpoints),), name="prefill-load", daemon=True)
        self._since = time.monotonic()
        self.started = self.started or self._since
        self._thread.start()
        return self

    def stop(self, drain_s: float | None = None) -> None:
        """Stop sending; wait up to ``drain_s`` (default deadline + 2 s) for the outstanding responses."""
        if self._stop_sending.is_set():
            return  # already stopped
        self._halt(self.deadline_s + 2.0 if drain_s is None else drain_s)

    def _halt(self, drain_s: float) -> None:
        self.stopped = time.monotonic()
        self.active_s += self.stopped - self._since
        self._drain_s = drain_s
        self._stop_sending.set()
        if self._thread is not None:
            self._thread.join(drain_s + 5.0)

    @property
    def sending_s(self) -> float:
        """Seconds spent sending so far, over every start."""
        running = self._thread is not None and not self._stop_sending.is_set()
        return self.active_s + (time.monotonic() - self._since if running else 0.0)

    @property
    def outstanding(self) -> int:
        """Requests sent and not (yet) answered."""
        return len(self._sent)

    def _run(self, endpoints: dict[int, str]) -> None:
        from agents.prefill.client import PrefillClient
        from geosched.errors import LinkError

        clients = {rank: PrefillClient(ep, **self._security(rank)) for rank, ep in endpoints.items()}
        ranks = sorted(clients)
        try:
            next_send = time.monotonic()
            drain_until: float | None = None
            while True:
                now = time.monotonic()
                if self._stop_sending.is_set():
                    drain_until = drain_until or now + self._drain_s
                    if not self._sent or now > drain_until:
                        break
                elif now >= next_send:
                    self._send(clients, ranks)
                    next_send += self._rng.expovariate(self.rate)
                got = 0
                for client in clients.values():
                    while True:
                        try:
                            response = client.receive(0.0)
                        except LinkError:
                            break
                        got += 1
                        self._answered(response)
                if not got:
                    time.sleep(0.002)
        except Exception:  # noqa: BLE001 - the load must not take the launcher down; counted as lost
            log.exception("prefill load failed")
        finally:
            for client in clients.values():
                client.close()
            self._done.set()

    def _security(self, rank: int) -> dict[str, Any]:
        """The token and CURVE client settings for ``rank``'s endpoint (the token's client keypair; none insecure)."""
        if self.keys is None:
            return {}
        from agents.sockets import CurveClient, token_keypair

        token = self.keys.prefill_token()  # its CURVE key too: the agents admit only that client key
        return {"token": token, "curve_client": CurveClient(*token_keypair(token), self.keys.curve_public(rank))}

    def _send(self, clients: dict[int, Any], ranks: list[int]) -> None:
        rank = self._rng.choice(ranks)
        length = self._rng.randint(*self.prompt_tokens)
        prompt = bytes(self._rng.randrange(256) for _ in range(length))
        rid = clients[rank].submit(prompt, deadline_s=self.deadline_s, return_kv=False, top_k=1)
        self._sent[rid] = (rank, time.monotonic())
        self.counts["sent"] += 1
        self.per_rank_sent[rank] = self.per_rank_sent.get(rank, 0) + 1

    def _answered(self, response: Any) -> None:
        entry = self._sent.pop(response.id, None)
        if entry is None:
            return  # not ours (cannot happen with one client per endpoint)
        status = response.status if response.status in STATUSES else "error"
        self.counts[status] += 1
        if status == "ok":
            self.ok_tokens += response.prompt_tokens
            self.ttft_s.append(time.monotonic() - entry[1])


AGENT_FIELDS = (
    "training_compute_s",
    "prefill_compute_s",
    "idle_s",
    "training_wall_s",
    "busy_fraction",
    "prefill_tokens",
    "prefill_chunks",
    "received",
    "ok",
    "rejected",
    "expired",
    "error",
    "cancelled",
    "bad_requests",
    "unauthenticated",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "served",  # the weights it computed with at the end (a checkpoint when following)
)
"""What the report keeps of each agent's ``prefill-rank<R>.json`` (the service's metrics after its last step)."""


def prefill_agents(run_dir: str | Path, sent: Mapping[int, int] | None = None) -> dict[str, Any]:
    """Each serving agent's entry of the report's ``prefill`` section (rank -> :data:`AGENT_FIELDS`, and the
    ``requests_sent`` to it by the launch's own load, when there was one)."""
    agents: dict[str, Any] = {}
    for path in sorted(Path(run_dir).glob("prefill-rank*.json")):
        rank = path.stem.removeprefix("prefill-rank")
        m = json.loads(path.read_text())
        agents[rank] = {name: m.get(name) for name in AGENT_FIELDS}
        if sent is not None:
            agents[rank]["requests_sent"] = sent.get(int(rank), 0)
    return agents


def prefill_section(load: PrefillLoad, run_dir: str | Path) -> dict[str, Any]:
    """The report's ``prefill`` section: client counts, tokens/s, TTFT p50/p99, per-agent time split."""
    duration = max(1e-9, load.sending_s)
    p50, p99 = percentile(load.ttft_s, 50), percentile(load.ttft_s, 99)
    agents = prefill_agents(run_dir, load.per_rank_sent)
    return {
        "rate_per_s": load.rate,
        "deadline_s": load.deadline_s,
        "requests_sent": load.counts["sent"],
        "ok": load.counts["ok"],
        "rejected": load.counts["rejected"],
        "expired": load.counts["expired"],
        "error": load.counts["error"],
        "lost": load.outstanding + load.abandoned,
        "prefill_tokens": load.ok_tokens,
        "tokens_per_s": load.ok_tokens / duration,
        "load_s": duration,
        "ttft_p50_ms": None if p50 is None else p50 * 1e3,
        "ttft_p99_ms": None if p99 is None else p99 * 1e3,
        "agents": agents,
    }


def prefill_text(section: Mapping[str, Any]) -> str:
    """One line for the launch summary."""

    def ms(v: Any) -> str:
        return "n/a" if v is None else f"{v:.1f} ms"

    return (
        f"prefill: {section['requests_sent']} sent at {section['rate_per_s']:g}/s -> {section['ok']} ok, "
        f"{section['rejected']} rejected, {section['expired']} expired, {section['error']} error, "
        f"{section['lost']} lost | {section['tokens_per_s']:.0f} tokens/s | TTFT p50 "
        f"{ms(section['ttft_p50_ms'])} p99 {ms(section['ttft_p99_ms'])}"
    )
