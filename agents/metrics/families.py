"""Every metric geosched exports to Prometheus (names ``geosched_*``), and the ``/health`` verdicts.

Each process has its own :class:`~prometheus_client.CollectorRegistry` (never
the global one): :class:`AgentMetrics` in ``geosched agent``,
:class:`JobMetrics` in the coordinator. Values are taken from where they
already live rather than counted twice:

- pushed once per event: a step's record (:meth:`AgentMetrics.step`, the
  histogram of step times and the latest record), a prefill time to first
  token (:meth:`AgentMetrics.observe_ttft`), a step of the job
  (:meth:`JobMetrics.step_done`);
- pulled at scrape time from snapshot callables (:attr:`AgentMetrics.sources`):
  the WAN links' counters (``WanLink.metrics()``), the control plane's
  ``ControlStats``, the prefill service's ``metrics()``, the agents' statuses;
  so an idle agent shows its prefill queue and counts too.

docs/metrics.md lists every name; docs/grafana-dashboard.json plots them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)
"""Seconds, for training step times (a CPU rehearsal's tens of ms to a large model's minutes)."""
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Seconds, for prefill time to first token."""
PREFILL_STATUSES = ("ok", "rejected", "expired", "error", "cancelled")
"""Outcomes of ``PrefillService.metrics()`` exported as ``geosched_prefill_requests_total{status}`` (they add up
to the requests finished: answered, or ``cancelled`` unanswered when the HTTP client hung up); ``bad_requests`` and
``unauthenticated``, both among ``error``, are
``geosched_prefill_refused_total{reason}``."""
LOOP_PROBE_S = 1.0
"""An agent whose event loop does not run a callback within this long is unhealthy."""

Snapshot = Callable[[], Any]


def loop_answers(loop: Any, timeout_s: float = LOOP_PROBE_S) -> bool:
    """True if the asyncio ``loop`` (None: not started) runs a callback within ``timeout_s``; any thread."""
    done = threading.Event()
    try:
        loop.call_soon_threadsafe(done.set)
    except (AttributeError, RuntimeError):  # no loop yet, or closed
        return False
    return done.wait(timeout_s)


def _family(kind: str, name: str, doc: str, labels: Iterable[str] = ()) -> CounterMetricFamily | GaugeMetricFamily:
    """An empty counter (``kind`` "counter") or gauge family; samples are added with ``add_metric``."""
    if kind == "counter":
        return CounterMetricFamily(name, doc, labels=list(labels))
    return GaugeMetricFamily(name, doc, labels=list(labels))


def control_families(stats: Mapping[str, int]) -> Iterator[Metric]:
    """``ControlStats`` (as a dict) of a control-plane client: refusals and drops by reason, receipts, connects."""
    refused = _family(
        "counter", "geosched_control_refused", "Control messages refused (failed verification)", ["reason"]
    )
    dropped = _family("counter", "geosched_control_dropped", "Control messages dropped, by reason", ["reason"])
    for key, value in sorted(stats.items()):
        if key.startswith("refused_"):
            refused.add_metric([key.removeprefix("refused_")], value)
        elif key.startswith("dropped_"):
            dropped.add_metric([key.removeprefix("dropped_")], value)
    yield refused
    yield dropped
    for key, doc in (("received", "Control messages received"), ("connects", "Connections to the MQTT broker")):
        if key in stats:
            family = _family("counter", f"geosched_control_{key}", doc)
            family.add_metric([], stats[key])
            yield family


def link_families(links: Iterable[Mapping[str, Any]]) -> Iterator[Metric]:
    """``WanLink.metrics()`` snapshots (plus ``peer_stage``, ``peer_dc``): per-stream bytes, rates, resends,
    disconnects, state; per-link dropped frames by reason."""
    labels = ["link", "peer_stage", "peer_dc", "stream"]
    per_stream = {
        "bytes_sent": _family("counter", "geosched_wan_sent_bytes", "Payload bytes sent (resends too)", labels),
        "bytes_received": _family("counter", "geosched_wan_received_bytes", "Payload bytes received", labels),
        "resends": _family("counter", "geosched_wan_resends", "Chunks sent again after a stream broke", labels),
        "disconnects": _family("counter", "geosched_wan_disconnects", "Stream connections lost", labels),
        "up": _family("gauge", "geosched_wan_stream_up", "1 while the stream's TCP connection is up", labels),
    }
    rate = _family(
        "gauge", "geosched_wan_throughput_bytes_per_second", "Bytes/s over the last second", [*labels, "direction"]
    )
    drops = _family(
        "counter",
        "geosched_wan_dropped_frames",
        "Frames refused and dropped, by reason",
        ["link", "peer_stage", "reason"],
    )
    for link in links:
        key = [str(link.get("link_id")), str(link.get("peer_stage")), str(link.get("peer_dc") or "")]
        for stream in link.get("streams", []):
            at = [*key, str(stream["index"])]
            for field, family in per_stream.items():
                family.add_metric(at, float(stream[field]))
            rate.add_metric([*at, "send"], stream["send_bytes_per_s"])
            rate.add_metric([*at, "recv"], stream["recv_bytes_per_s"])
        for reason, count in sorted(link.get("drops", {}).items()):
            drops.add_metric([key[0], key[1], reason], count)
    yield from (*per_stream.values(), rate, drops)


HTTP_REFUSALS = (
    ("connection_limit", "refused_connections"),
    ("inflight_limit", "refused_requests"),
    ("slow_client", "timed_out"),
    ("send_timeout", "send_timeouts"),
)
"""``geosched_prefill_http_refused_total`` reasons and the HTTP front end's counts behind them."""


def prefill_families(snapshot: Mapping[str, Any]) -> Iterator[Metric]:
    """``PrefillService.metrics()``: requests by status, queue length, KV bytes reserved, tokens, compute."""
    requests = _family("counter", "geosched_prefill_requests", "Prefill requests finished, by status", ["status"])
    for status in PREFILL_STATUSES:
        requests.add_metric([status], snapshot.get(status, 0))
    yield requests
    refused = _family("counter", "geosched_prefill_refused", "Prefill requests refused (among error)", ["reason"])
    for reason, key in (("bad_request", "bad_requests"), ("unauthenticated", "unauthenticated")):
        refused.add_metric([reason], snapshot.get(key, 0))
    yield refused
    for name, kind, key, doc in (
        ("geosched_prefill_received", "counter", "received", "Prefill requests received"),
        ("geosched_prefill_dropped_frames", "counter", "dropped_frames", "Malformed prefill messages dropped"),
        ("geosched_prefill_queue_length", "gauge", "queue_len", "Prefill requests queued or running"),
        (
            "geosched_prefill_kv_reserved_bytes",
            "gauge",
            "kv_reserved_bytes",
            "KV-cache bytes reserved by admitted work",
        ),
        ("geosched_prefill_tokens", "counter", "prefill_tokens", "Prompt tokens prefilled"),
    ):
        family = _family(kind, name, doc)
        family.add_metric([], snapshot.get(key) or 0)
        yield family
    compute = _family("counter", "geosched_prefill_compute_seconds", "Prefill compute seconds", ["where"])
    bubbles = float(snapshot.get("prefill_in_bubbles_s") or 0.0)
    compute.add_metric(["bubble"], bubbles)
    compute.add_metric(["outside"], max(0.0, float(snapshot.get("prefill_compute_s") or 0.0) - bubbles))
    yield compute
    http = snapshot.get("http")
    if http:  # the HTTP front end (agents.prefill.connections): its connections and what it refused or cut off
        for name, key, doc in (
            ("geosched_prefill_http_connections", "open", "Open connections of the prefill HTTP front end"),
            ("geosched_prefill_http_inflight", "inflight", "Requests the prefill HTTP front end is handling"),
        ):
            gauge = _family("gauge", name, doc)
            gauge.add_metric([], http.get(key, 0))
            yield gauge
        cut = _family(
            "counter", "geosched_prefill_http_refused", "HTTP connections or requests refused or cut off", ["reason"]
        )
        for reason, key in HTTP_REFUSALS:
            cut.add_metric([reason], http.get(key, 0))
        yield cut


class _Pulled:
    """A custom collector: ``collect`` turns the owner's latest values and snapshots into families."""

    def __init__(self, collect: Callable[[], Iterator[Metric]]) -> None:
        self.collect = collect

    def describe(self) -> list[Metric]:
        return []  # pulled families vary (links, reasons); no duplicate-name check against them


class AgentMetrics:
    """The metrics of one agent (see the module docstring), its registry and its ``/health`` verdict.

    ``stale_s``: while training, longer than this without a step is unhealthy (the daemon passes its receive
    timeout); ``grace_s`` is added before the first step of a run (peers connect then).
    """

    def __init__(self, rank: int, job: str, *, stale_s: float = 120.0, grace_s: float = 300.0) -> None:
        self.rank, self.job = rank, job
        self.stale_s, self.grace_s = stale_s, grace_s
        self.registry = CollectorRegistry(support_collectors_without_names=True)  # ?name[]= filters them too
        self.step_seconds = Histogram(
            "geosched_step_seconds", "Training step (iteration) time", buckets=STEP_BUCKETS, registry=self.registry
        )
        self.ttft_seconds = Histogram(
            "geosched_prefill_ttft_seconds", "Prefill time to first token", buckets=TTFT_BUCKETS, registry=self.registry
        )
        self.skipped_steps = Counter(
            "geosched_skipped_steps", "fp16 steps skipped: a gradient overflowed the loss scale", registry=self.registry
        )
        self.sources: dict[str, Snapshot] = {}  # "control", "links", "prefill": snapshot callables
        self._status: dict[str, Any] = {}
        self._state_since = time.time()
        self._last: dict[str, Any] | None = None  # the newest step record
        self._last_at: float | None = None
        self.registry.register(_Pulled(self._collect))

    def status(self, status: Mapping[str, Any]) -> None:
        """The agent's status changed (``state``, ``dc``, ``stage``, ``replica``, ``plan_id``...)."""
        if status.get("state") != self._status.get("state"):
            self._state_since = time.time()
        self._status = dict(status)

    def step(self, record: Mapping[str, Any]) -> None:
        """One step's metrics record (``iteration_s``, ``loss``, ``bubble_fraction``, ``busy_s``, ``prefill``)."""
        self.step_seconds.observe(float(record.get("iteration_s", 0.0)))
        if record.get("skipped") is True:
            self.skipped_steps.inc()
        self._last, self._last_at = dict(record), time.time()

    def observe_ttft(self, seconds: float) -> None:
        """A prefill request's time to first token (the service calls this as it answers)."""
        self.ttft_seconds.observe(seconds)

    def _collect(self) -> Iterator[Metric]:
        status = self._status
        info = _family("gauge", "geosched_agent_info", "The agent's place in the plan", ["job", "rank", "dc", "stage"])
        info.add_metric([self.job, str(self.rank), str(status.get("dc", "")), str(status.get("stage", ""))], 1)
        state = _family("gauge", "geosched_agent_state", "1 for the agent's current state", ["state"])
        state.add_metric([str(status.get("state", "starting"))], 1)
        yield from (info, state)
        yield from self._step_families()
        for name, to_families in (("control", control_families), ("links", link_families)):
            source = self.sources.get(name)
            if source is not None:
                yield from to_families(source())
        prefill = self.sources.get("prefill")
        snapshot = prefill() if prefill is not None else None
        if snapshot is not None:
            yield from prefill_families(snapshot)

    def _step_families(self) -> Iterator[Metric]:
        record = self._last
        if record is None:
            return
        iteration = float(record.get("iteration_s", 0.0))
        busy = (record.get("prefill") or {}).get("busy_fraction")
        if busy is None:  # no prefill: the step's training compute share
            busy = float(record.get("busy_s", 0.0)) / iteration if iteration > 0 else 0.0
        values = [
            ("geosched_last_step", "Index of the newest training step", record.get("step")),
            ("geosched_last_step_timestamp_seconds", "Unix time the newest step ended", self._last_at),
            ("geosched_loss", "Training loss of the newest step (last stage only)", record.get("loss")),
            (
                "geosched_bubble_fraction",
                "Share of the newest step the stage computed nothing",
                record.get("bubble_fraction"),
            ),
            ("geosched_busy_fraction", "Share of training time spent computing (training + prefill in bubbles)", busy),
            ("geosched_step_wan_bytes", "Bytes sent across the WAN in the newest step", record.get("wan_bytes")),
            ("geosched_loss_scale", "fp16: the loss scale of the newest step", record.get("loss_scale")),
            ("geosched_learning_rate", "The learning rate of the newest step's optimizer step", record.get("lr")),
            ("geosched_grad_norm", "The gradients' global norm before clipping, newest step", record.get("grad_norm")),
        ]
        for name, doc, value in values:
            if value is not None:
                family = _family("gauge", name, doc)
                family.add_metric([], float(value))
                yield family

    def health(self, loop_ok: bool, now: float | None = None) -> tuple[bool, dict[str, Any]]:
        """(healthy, JSON body): the event loop answers, the state is not ``error``/``stopped``, and while
        training a step ended recently (within ``stale_s``, plus ``grace_s`` before a run's first)."""
        now = time.time() if now is None else now
        state = str(self._status.get("state", "starting"))
        body: dict[str, Any] = {"rank": self.rank, "state": state, "last_step": None, "last_step_age_s": None}
        if self._last is not None and self._last_at is not None:
            body.update(last_step=self._last.get("step"), last_step_age_s=round(now - self._last_at, 3))
        reason = None
        if not loop_ok:
            reason = f"the agent's event loop did not answer within {LOOP_PROBE_S:g} s"
        elif state in ("error", "stopped", "offline"):
            reason = f"state {state}" + (f": {self._status['message']}" if self._status.get("message") else "")
        elif state == "training":
            stepped = self._last_at is not None and self._last_at >= self._state_since
            since = self._last_at if stepped and self._last_at is not None else self._state_since
            limit = self.stale_s + (0.0 if stepped else self.grace_s)
            if now - since > limit:
                reason = f"training but no step ended for {now - since:.0f} s (limit {limit:g} s)"
        body["status"] = "ok" if reason is None else "unhealthy"
        if reason is not None:
            body["reason"] = reason
        return reason is None, body


class JobMetrics:
    """The coordinator's metrics: ranks by state, steps, the newest step, lost metrics messages."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.registry = CollectorRegistry(support_collectors_without_names=True)  # ?name[]= filters them too
        self.steps = Counter("geosched_job_steps", "Job steps summarized over every rank", registry=self.registry)
        self.step_seconds = Histogram(
            "geosched_job_step_seconds", "Job step time (slowest rank)", buckets=STEP_BUCKETS, registry=self.registry
        )
        self.lost = Counter(
            "geosched_job_lost_metrics",
            "Per-step metrics messages of a rank that never arrived",
            registry=self.registry,
        )
        self.wan_bytes = Counter(
            "geosched_job_wan_bytes", "Bytes every rank sent across the WAN", registry=self.registry
        )
        self.sources: dict[str, Snapshot] = {}  # "statuses": rank -> status, "control": ControlStats as a dict
        self._ranks: list[int] = []
        self._states: tuple[str, ...] = ()
        self._last: Any = None
        self._step: int | None = None
        self._last_at: float | None = None
        self.registry.register(_Pulled(self._collect))

    def watch(self, ranks: Iterable[int], states: Iterable[str], statuses: Snapshot, control: Snapshot) -> None:
        """The job's ranks and every state they can be in; snapshot callables of their statuses (rank -> an
        object with ``state``) and of the coordinator's control-plane counters."""
        self._ranks, self._states = sorted(ranks), tuple(states)
        self.sources.update(statuses=statuses, control=control)

    def step_done(self, step: int, summary: Any, lost_ranks: Iterable[int]) -> None:
        """Step ``step`` was summarized: ``summary`` (``iteration_s``, ``loss``, ``bubble_fraction``,
        ``wan_bytes``; None when no rank's metrics arrived) and the ranks whose metrics were lost."""
        self.steps.inc()
        self.lost.inc(len(list(lost_ranks)))
        if summary is not None:
            self.step_seconds.observe(summary.iteration_s)
            self.wan_bytes.inc(summary.wan_bytes)
            self._last = summary
        self._last_at = time.time()
        self._step = step

    def _rank_states(self) -> dict[str, int]:
        source = self.sources.get("statuses")
        statuses = source() if source is not None else {}
        counts = dict.fromkeys((*self._states, "unknown"), 0)
        for rank in self._ranks:
            status = statuses.get(rank)
            state = str(status.state) if status is not None else "unknown"
            counts[state] = counts.get(state, 0) + 1
        return counts

    def _collect(self) -> Iterator[Metric]:
        ranks = _family("gauge", "geosched_job_ranks", "The job's ranks by their latest state", ["state"])
        for state, count in self._rank_states().items():
            ranks.add_metric([state], count)
        yield ranks
        last = self._last
        values = [
            ("geosched_job_last_step", "Index of the newest summarized step", self._step),
            ("geosched_job_last_step_timestamp_seconds", "Unix time the newest step was summarized", self._last_at),
            (
                "geosched_job_last_step_seconds",
                "Time of the newest step (slowest rank)",
                getattr(last, "iteration_s", None),
            ),
            ("geosched_job_loss", "Loss of the newest step (mean over replicas)", getattr(last, "loss", None)),
            (
                "geosched_job_bubble_fraction",
                "Bubble fraction of the newest step (mean over ranks)",
                getattr(last, "bubble_fraction", None),
            ),
        ]
        for name, doc, value in values:
            if value is not None:
                family = _family("gauge", name, doc)
                family.add_metric([], float(value))
                yield family
        control = self.sources.get("control")
        if control is not None:
            yield from control_families(control())

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, JSON body): unhealthy while a rank of the job is ``offline``, ``error`` or ``stopped``."""
        counts = self._rank_states()
        bad = {state: n for state, n in counts.items() if state in ("offline", "error", "stopped") and n}
        body: dict[str, Any] = {"job": self.job, "status": "unhealthy" if bad else "ok", "ranks": counts}
        if bad:
            body["reason"] = "ranks " + ", ".join(f"{n} {state}" for state, n in sorted(bad.items()))
        return not bad, body
