"""What a stage reports per training step, and the measured timeline built from those reports.

:class:`StepReport` is one rank's step: loss (last stage), iteration time,
busy/comm/idle seconds, the gradient sync's seconds (``sync_s``, the ALL_REDUCE action) and the bytes it
sent across DCs (``sync_bytes``), bytes sent per peer stage and the timed events. It
is plain data (``to_dict``/``from_dict``) so it can cross process
boundaries and MQTT as JSON.

:func:`measured_timeline` merges the reports of one pipeline (one replica of
every stage) for one step into a :class:`~geosched.schedule.Timeline`: the
same object the simulator returns, so ``render_grid``,
``write_timeline_png`` and ``write_chrome_trace`` draw it and its
``iteration_s`` and bubbles compare directly with the prediction. Stages are
aligned on the wall clock (``started_at``), exact on one machine. Given the
stages' DCs, every message that crossed datacenters becomes a
:class:`~geosched.schedule.LinkUse` keyed ``(from DC, to DC)`` like the cost
model's, spanning from its send to the moment its receiver had it (queueing,
transfer and latency together; an upper bound when the receiver was busy).

:func:`global_loss` is the loss of the whole step: the mean over replicas of
each replica's last-stage loss (all replicas see equally many samples).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from geosched.errors import StageError
from geosched.schedule import Action, Event, IdleGap, LinkUse, Message, Schedule, Timeline, message_edges
from geosched.schedule.timeline import summarize
from geosched.yamlload import short


@dataclass
class StepReport:
    """One rank's training step."""

    step: int
    stage: int
    replica: int
    loss: float | None  # last stage: mean loss over its microbatches; None elsewhere
    iteration_s: float  # from the first action's start to the last action's end
    busy_s: float  # compute: F, B, STEP
    comm_s: float  # sends, receives that did not wait, all-reduce
    idle_s: float  # receives that waited: the bubbles
    started_at: float  # wall clock (time.time()) at the start of the step
    bytes_sent: dict[int, int] = field(default_factory=dict)  # peer stage -> bytes this step
    events: list[Event] = field(default_factory=list)
    idle_gaps: list[IdleGap] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)  # agents.stage.memory.MemoryMeter.report()
    sync_s: float = 0.0  # the gradient sync: seconds of the ALL_REDUCE action
    sync_bytes: dict[str, int] = field(default_factory=dict)  # peer DC -> bytes sent on gradient links (agents.crossdc)
    loss_scale: float | None = None  # fp16: the loss scale this step's gradients carried; None: not scaled
    skipped: bool = False  # fp16: some stage's gradients were not finite, so no stage stepped
    lr: float | None = None  # the learning rate of this step's optimizer step (geosched.lr_schedule)
    grad_norm: float | None = None  # the model's gradients' global norm before clipping (None: not agreed, skipped)

    @classmethod
    def from_events(
        cls,
        *,
        step: int,
        stage: int,
        replica: int,
        loss: float | None,
        iteration_s: float,
        started_at: float,
        events: list[Event],
        idle_gaps: list[IdleGap],
        bytes_sent: dict[int, int],
        memory: dict[str, int] | None = None,
    ) -> StepReport:
        """Sum the event durations into busy/comm/idle seconds."""
        spent = {"compute": 0.0, "comm": 0.0, "idle": 0.0}
        for e in events:
            spent[e.category] = spent.get(e.category, 0.0) + (e.end - e.start)
        sync_s = sum(e.end - e.start for e in events if e.kind == "ALL_REDUCE")
        return cls(
            step,
            stage,
            replica,
            loss,
            iteration_s,
            spent["compute"],
            spent["comm"],
            spent["idle"],
            started_at,
            dict(bytes_sent),
            list(events),
            list(idle_gaps),
            dict(memory or {}),
            sync_s,
        )

    @property
    def bubble_fraction(self) -> float:
        """1 - busy / iteration, as the simulator defines it."""
        return 1.0 - self.busy_s / self.iteration_s if self.iteration_s > 0 else 0.0

    def wan_bytes(self, role: Any) -> int:
        """Bytes this step sent over the WAN: to neighbouring stages in other DCs (``role``, a
        :class:`~agents.layout.RankRole`, knows which) and on the cross-DC gradient links."""
        pipeline = sum(n for peer, n in self.bytes_sent.items() if role.wan_peer_dc(peer) is not None)
        return pipeline + sum(self.sync_bytes.values())

    def to_dict(self, *, with_events: bool = True) -> dict[str, Any]:
        """JSON-ready form (peer keys become strings)."""
        data = asdict(self)
        data["bytes_sent"] = {str(k): v for k, v in self.bytes_sent.items()}
        data["bubble_fraction"] = self.bubble_fraction
        if with_events:
            data["events"] = [e._asdict() for e in self.events]
            data["idle_gaps"] = [g._asdict() for g in self.idle_gaps]
        else:
            data.pop("events")
            data.pop("idle_gaps")
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepReport:
        """Inverse of :meth:`to_dict`, strict: what another process sent (a rank's metrics, signed but not
        trusted to be well formed) is checked as it is read, so a malformed report fails here (KeyError,
        TypeError, ValueError) and not in the run folder's pictures. A diverged loss may be NaN."""
        stage = _whole(data["stage"])
        events = [_event(e, stage) for e in data.get("events", [])]
        gaps = [_gap(g, stage) for g in data.get("idle_gaps", [])]
        return cls(
            step=_whole(data["step"]),
            stage=stage,
            replica=_whole(data["replica"]),
            loss=None if data["loss"] is None else float(data["loss"]),
            iteration_s=_seconds(data["iteration_s"]),
            busy_s=_seconds(data["busy_s"]),
            comm_s=_seconds(data["comm_s"]),
            idle_s=_seconds(data["idle_s"]),
            started_at=_seconds(data["started_at"]),
            bytes_sent={_whole(k): _whole(v) for k, v in data.get("bytes_sent", {}).items()},
            events=events,
            idle_gaps=gaps,
            memory={str(k): _whole(v) for k, v in data.get("memory", {}).items()},
            sync_s=_seconds(data.get("sync_s", 0.0)),
            sync_bytes={str(k): _whole(v) for k, v in data.get("sync_bytes", {}).items()},
            loss_scale=None if data.get("loss_scale") is None else _seconds(data["loss_scale"]),
            skipped=data.get("skipped", False) is True,
            lr=None if data.get("lr") is None else _seconds(data["lr"]),
            grad_norm=None if data.get("grad_norm") is None else _seconds(data["grad_norm"]),
        )


def _whole(value: object) -> int:
    """A count, stage or step of a report: an integer >= 0 (or its decimal string, as JSON keys are)."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 18:
        value = int(value)
    if type(value) is not int or value < 0:
        raise ValueError(f"expected an integer >= 0, got {short(value)}")
    return value


def _seconds(value: object) -> float:
    """A time or scale of a report: a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {short(value)}")
    return float(value)


def _label(value: object) -> str:
    if not isinstance(value, str) or len(value) > 64:
        raise ValueError(f"expected a name of at most 64 characters, got {short(value)}")
    return value


def _event(data: Mapping[str, Any], stage: int) -> Event:
    event = Event(
        _whole(data["stage"]),
        _label(data["action"]),
        _seconds(data["start"]),
        _seconds(data["end"]),
        _label(data["category"]),
        _label(data["kind"]),
    )
    if event.stage != stage:
        raise ValueError(f"an event of stage {event.stage} in a report of stage {stage}")
    return event


def _gap(data: Mapping[str, Any], stage: int) -> IdleGap:
    waiting = data["waiting_for"]
    label = None if waiting is None else _label(waiting)
    gap = IdleGap(_whole(data["stage"]), _seconds(data["start"]), _seconds(data["end"]), label)
    if gap.stage != stage:
        raise ValueError(f"an idle gap of stage {gap.stage} in a report of stage {stage}")
    return gap


def measured_timeline(
    schedule: Schedule, reports: Iterable[StepReport], stage_dcs: Sequence[str] | None = None
) -> Timeline:
    """The Timeline of one step of one pipeline: one report per stage, same step and replica; with
    ``stage_dcs`` (each stage's DC), the messages that crossed datacenters as its ``links``."""
    by_stage = {r.stage: r for r in reports}
    missing = [s for s in range(schedule.num_stages) if s not in by_stage]
    if missing:
        raise StageError(f"measured timeline needs a report from every stage; missing stages {missing}")
    steps = {(r.step, r.replica) for r in by_stage.values()}
    if len(steps) != 1:
        raise StageError(
            f"measured timeline mixes (step, replica) pairs {sorted(steps)}; pass one step of one pipeline"
        )
    events, gaps = aligned(by_stage.values())
    events.sort(key=lambda e: (e.stage, e.start))
    links = [] if stage_dcs is None else wan_messages(events, schedule.num_stages, stage_dcs)
    return summarize(schedule, events, gaps, links)


def aligned(reports: Iterable[StepReport]) -> tuple[list[Event], list[IdleGap]]:
    """The reports' events and idle gaps on one clock, from the earliest ``started_at`` (each report's own are
    relative to its start)."""
    reports = list(reports)
    origin = min(r.started_at for r in reports)
    events: list[Event] = []
    gaps: list[IdleGap] = []
    for r in reports:
        shift = r.started_at - origin
        events += [e._replace(start=e.start + shift, end=e.end + shift) for e in r.events]
        gaps += [g._replace(start=g.start + shift, end=g.end + shift) for g in r.idle_gaps]
    return events, gaps


_COMM_TAGS = frozenset({"SEND_F", "SEND_B", "RECV_F", "RECV_B"})


def wan_messages(events: Iterable[Event], num_stages: int, stage_dcs: Sequence[str]) -> list[LinkUse]:
    """Each message between stages of different DCs, from its SEND's start to its RECV's end (aligned events)."""
    sent: dict[Message, float] = {}
    received: dict[Message, float] = {}
    for e in events:
        if e.kind not in _COMM_TAGS:
            continue
        needs, produces = message_edges(Action.parse(e.action), num_stages, lowered=True)
        if produces is not None:
            sent[produces] = e.start
        elif needs is not None:
            received[needs] = e.end
    out = []
    for msg, start in sent.items():
        src, dst = stage_dcs[msg.src], stage_dcs[msg.dst]
        if src != dst and msg in received:
            end = max(start, received[msg])  # hosts' clocks may disagree a little
            out.append(LinkUse((src, dst), msg.src, msg.dst, msg.kind, msg.microbatch, start, start, end, end))
    return sorted(out, key=lambda u: u.start)


def global_loss(reports: Iterable[StepReport]) -> float:
    """Loss of one step over the whole job: mean over replicas of the last stages' losses."""
    losses = [r.loss for r in reports if r.loss is not None]
    if not losses:
        raise StageError("no last-stage report carries a loss; pass the reports of the last stage's replicas")
    return sum(losses) / len(losses)
