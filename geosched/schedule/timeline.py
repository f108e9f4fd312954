"""The result of a simulation (or, later, of a measured run): events, idle gaps, per-stage stats.

Categories are data, not code: ``"compute"`` (F, B, STEP), ``"comm"``
(ALL_REDUCE, SEND/RECV that did not wait), ``"idle"`` (a receive waiting for
its message); the runtime and the prefill service may add others (``"prefill"``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from geosched.schedule.actions import ActionKind, Schedule


class Event(NamedTuple):
    """One action (or wait) on one stage, in seconds from the start of the iteration."""

    stage: int
    action: str  # action string, e.g. "1B3"; waits carry the receive they wait in, e.g. "1RECV_F3"
    start: float
    end: float
    category: str  # "compute" | "comm" | "idle" | later "prefill"
    kind: str  # ActionKind value ("F", "B", "RECV_F", ...) or a later kind ("PREFILL")


class IdleGap(NamedTuple):
    """A span in which a stage had nothing to run: a bubble the prefill service may fill."""

    stage: int
    start: float
    end: float
    waiting_for: str | None  # the receive the stage was blocked in; None: done for this iteration

    @property
    def length(self) -> float:
        """Duration of the gap in seconds."""
        return self.end - self.start


class LinkUse(NamedTuple):
    """One message on the network, with the times it went through."""

    link: Hashable | None
    src: int
    dst: int
    kind: str  # "F" activation, "B" gradient
    microbatch: int
    sent: float  # the sender enqueued it
    start: float  # it got the link (after queueing behind earlier messages)
    end: float  # it left the link (start + occupancy)
    arrive: float  # it reached the receiver (end + latency)


def link_label(use: LinkUse) -> str:
    """How pictures and traces name the link a message used: ``"us -> eu"`` for a DC pair (the cost
    model's link keys, one per direction), else the message's own direction, ``"stage 0 -> stage 1"``."""
    link = use.link
    if isinstance(link, tuple) and len(link) == 2 and all(isinstance(end, str) for end in link):
        return f"{link[0]} -> {link[1]}"
    return f"stage {use.src} -> stage {use.dst}"


@dataclass
class StageStats:
    """Where one stage's iteration time went."""

    stage: int
    busy_s: float  # compute: F, B, STEP
    comm_s: float  # ALL_REDUCE and other stage-blocking communication
    idle_s: float  # everything else: waits and the tail after the stage is done
    bubble_fraction: float  # 1 - busy_s / iteration_s
    peak_inflight: int  # most microbatches with F done and B (or W) not yet (activations held)


@dataclass
class Timeline:
    """A simulated or measured iteration of a pipeline schedule."""

    schedule_name: str
    num_stages: int
    num_microbatches: int
    iteration_s: float
    events: list[Event]
    idle_gaps: list[IdleGap]
    stages: list[StageStats]
    links: list[LinkUse] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """Mean over stages of each stage's bubble fraction."""
        return sum(st.bubble_fraction for st in self.stages) / len(self.stages)

    def events_of(self, stage: int) -> list[Event]:
        """Events of one stage in time order."""
        return sorted((e for e in self.events if e.stage == stage), key=lambda e: (e.start, e.end))

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (link keys become strings)."""
        return {
            "schedule": self.schedule_name,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "iteration_s": self.iteration_s,
            "bubble_fraction": self.bubble_fraction,
            "stages": [asdict(st) for st in self.stages],
            "events": [e._asdict() for e in self.events],
            "idle_gaps": [{**g._asdict(), "length": g.length} for g in self.idle_gaps],
            "links": [{**u._asdict(), "link": None if u.link is None else str(u.link)} for u in self.links],
        }


def peak_inflight(schedule: Schedule, stage: int) -> int:
    """Most activations ``stage`` holds at once when running its actions in order.

    A split backward holds its microbatch's graph until W (the weight gradient needs it).
    """
    held = peak = 0
    for a in schedule.actions[stage]:
        if a.kind is ActionKind.FORWARD:
            held += 1
            peak = max(peak, held)
        elif a.kind is ActionKind.BACKWARD or a.kind is ActionKind.BACKWARD_WEIGHT:
            held -= 1
    return peak


def summarize(
    schedule: Schedule, events: Iterable[Event], gaps: Iterable[IdleGap], links: Iterable[LinkUse] = ()
) -> Timeline:
    """Build a :class:`Timeline` from raw events: iteration time, tail gaps, per-stage stats."""
    events, gaps = list(events), list(gaps)
    p = schedule.num_stages
    iteration = max((e.end for e in events), default=0.0)
    busy, comm, last_end = [0.0] * p, [0.0] * p, [0.0] * p
    for e in events:
        if e.category == "compute":
            busy[e.stage] += e.end - e.start
        elif e.category == "comm":
            comm[e.stage] += e.end - e.start
        last_end[e.stage] = max(last_end[e.stage], e.end)
    gaps += [IdleGap(s, last_end[s], iteration, None) for s in range(p) if last_end[s] < iteration]
    stats = stage_stats(iteration, busy, comm, [peak_inflight(schedule, s) for s in range(p)])
    return Timeline(schedule.name, p, schedule.num_microbatches, iteration, events, gaps, stats, list(links))


def stage_stats(iteration: float, busy: list[float], comm: list[float], peaks: list[int]) -> list[StageStats]:
    """Per-stage stats from each stage's compute and communication seconds in an iteration."""
    return [
        StageStats(
            stage=s,
            busy_s=busy[s],
            comm_s=comm[s],
            idle_s=max(0.0, iteration - busy[s] - comm[s]),
            bubble_fraction=1.0 - busy[s] / iteration if iteration > 0 else 0.0,
            peak_inflight=peaks[s],
        )
        for s in range(len(busy))
    ]
