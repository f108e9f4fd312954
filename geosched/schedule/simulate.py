"""Event simulator: run a schedule against a cost model and return a :class:`Timeline`.

Semantics: each stage executes its actions strictly in order. F, B, I, W, STEP
and ALL_REDUCE occupy the stage for ``costs.compute_s(action)``. A SEND enqueues
its message on a link, a FIFO per (link key, direction) where it waits until
the link is free, occupies it ``occupancy_s`` and arrives ``latency_s`` later.
A RECV blocks the stage until its message has arrived. SEND and RECV take no
stage time unless the cost model sets ``charges_messages`` (then each takes
``compute_s(action)``: the time a rank spends handling the message).
Unlowered schedules (no SEND/RECV) get the same behaviour implicitly: F of
stage s+1 waits for F of s, B (or I) of s for B (or I) of s+1; W waits for nothing.

The run is event driven (a heap of stage wake-ups), O(actions log stages),
with no per-time-step loop, so planners may call it thousands of times.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from geosched.errors import ScheduleError
from geosched.schedule.actions import (
    COMM_KINDS,
    KIND_TAG,
    Action,
    ActionKind,
    Message,
    Schedule,
    message_edges,
    receive_for,
)
from geosched.schedule.timeline import Event, IdleGap, LinkUse, Timeline, summarize
from geosched.schedule.validate import describe_deadlock, validate

K = ActionKind


class Transfer(NamedTuple):
    """How one message uses the network between two stages."""

    link: Hashable | None  # transfers sharing a link key (per direction) are serialized on it
    occupancy_s: float  # time the message occupies the link (bytes / effective bandwidth)
    latency_s: float  # propagation delay added after occupancy (e.g. RTT/2)


class CostProvider(Protocol):
    """What the simulator asks of a cost model."""

    def compute_s(self, action: Action) -> float:
        """Duration of an F, B, I, W, STEP or ALL_REDUCE action on its stage (and of a SEND or RECV, see above)."""
        ...

    def transfer(self, src_stage: int, dst_stage: int, kind: str, microbatch: int) -> Transfer:
        """Network use of one activation (``kind="F"``) or gradient (``kind="B"``) message."""
        ...


_UNIFORM_FIELDS = (
    "forward_s",
    "backward_s",
    "transfer_s",
    "allreduce_s",
    "step_s",
    "backward_input_s",
    "backward_weight_s",
)


@dataclass(frozen=True)
class UniformCosts:
    """Synthetic costs: the same durations on every stage; one link per stage boundary.

    A split backward costs ``backward_input_s`` (I) and ``backward_weight_s``
    (W), each ``backward_s / 2`` unless given.
    """

    forward_s: float = 1.0
    backward_s: float = 2.0
    transfer_s: float = 0.0
    allreduce_s: float = 0.0
    step_s: float = 0.0
    backward_input_s: float | None = None
    backward_weight_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("backward_input_s", "backward_weight_s"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.backward_s / 2)  # frozen: set the default once
        for name in _UNIFORM_FIELDS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ScheduleError(f"UniformCosts.{name} must be a finite number >= 0 (got {value!r})")

    def compute_s(self, action: Action) -> float:
        """Forward, backward (whole, input or weight part), all-reduce or step duration by kind."""
        kind = action.kind
        if kind is K.FORWARD:
            return self.forward_s
        if kind is K.BACKWARD:
            return self.backward_s
        if kind is K.BACKWARD_INPUT:
            return float(self.backward_input_s)  # type: ignore[arg-type]  # __post_init__ set it
        if kind is K.BACKWARD_WEIGHT:
            return float(self.backward_weight_s)  # type: ignore[arg-type]  # __post_init__ set it
        if kind is K.ALL_REDUCE:
            return self.allreduce_s
        return self.step_s if kind is K.STEP else 0.0

    def transfer(self, src_stage: int, dst_stage: int, kind: str, microbatch: int) -> Transfer:
        """Every message takes ``transfer_s`` on the link of its stage boundary."""
        return Transfer((min(src_stage, dst_stage), max(src_stage, dst_stage)), self.transfer_s, 0.0)


class _Step(NamedTuple):
    """An action with everything the hot loop needs precomputed."""

    action: Action
    text: str
    tag: str  # ActionKind value
    needs: Message | None
    produces: Message | None
    is_comm: bool  # SEND/RECV: no stage time unless the costs charge messages
    category: str


@functools.lru_cache(maxsize=8)
def _compile(actions: tuple[tuple[Action, ...], ...], lowered: bool) -> tuple[tuple[_Step, ...], ...]:
    """Precompute the hot loop's view of a schedule, memoized on its exact actions.

    Planners simulate one schedule against many cost models; hashing the
    actions costs about 1% of compiling them, so a reused schedule skips this.
    """
    p = len(actions)
    steps = []
    for row in actions:
        compiled = []
        for a in row:
            is_comm = a.kind in COMM_KINDS
            category = "comm" if is_comm or a.kind is K.ALL_REDUCE else "compute"
            compiled.append(_Step(a, str(a), KIND_TAG[a.kind], *message_edges(a, p, lowered), is_comm, category))
        steps.append(tuple(compiled))
    return tuple(steps)


def simulate(schedule: Schedule, costs: CostProvider, *, check: bool = True) -> Timeline:
    """Simulate one iteration of ``schedule``; ``check=False`` skips :func:`validate` (hot loops)."""
    if check:
        validate(schedule)
    run = _Run(schedule, costs)
    run.execute()
    return run.timeline()


class _Run:
    """The mutable state of one simulation (kept out of the public Timeline)."""

    def __init__(self, schedule: Schedule, costs: CostProvider) -> None:
        self.schedule, self.costs = schedule, costs
        self.p, self.lowered = schedule.num_stages, schedule.has_communication
        self.charges_messages = getattr(costs, "charges_messages", False)
        self.steps = _compile(tuple(tuple(schedule.actions[s]) for s in range(self.p)), self.lowered)
        self.position = [0] * self.p
        self.free_at = [0.0] * self.p  # when each stage finished its last action
        self.outbox: list[Message | None] = [None] * self.p  # produced at the end of a running compute
        self.arrival: dict[Message, float] = {}
        self.waiting: dict[Message, int] = {}
        self.link_free: dict[tuple[Hashable, bool], float] = {}
        self.heap: list[tuple[float, int, int]] = []
        self.seq = 0
        self.events: list[Event] = []
        self.gaps: list[IdleGap] = []
        self.links: list[LinkUse] = []

    def wake(self, stage: int, at: float) -> None:
        """Schedule ``stage`` to resume at time ``at`` (ties resume in FIFO order)."""
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, stage))

    def execute(self) -> None:
        """Pop stage wake-ups in time order until every stage is done or blocked for good."""
        for s in range(self.p):
            self.wake(s, 0.0)
        while self.heap:
            now, _, s = heapq.heappop(self.heap)
            message = self.outbox[s]
            if message is not None:
                self.post(message, now)
                self.outbox[s] = None
            self.advance(s, now)
        stuck = {s: self.steps[s][i].action for s, i in enumerate(self.position) if i < len(self.steps[s])}
        if stuck:
            raise ScheduleError(describe_deadlock(stuck))

    def post(self, msg: Message, now: float) -> None:
        """Put ``msg`` on its link at ``now``; wake its receiver when it arrives."""
        tr = self.costs.transfer(msg.src, msg.dst, msg.kind, msg.microbatch)
        begin = now
        if tr.link is not None:
            key = (tr.link, msg.dst > msg.src)
            begin = max(now, self.link_free.get(key, 0.0))
            self.link_free[key] = begin + tr.occupancy_s
        arrive = begin + tr.occupancy_s + tr.latency_s
        self.arrival[msg] = arrive
        use = LinkUse(tr.link, msg.src, msg.dst, msg.kind, msg.microbatch, now, begin, begin + tr.occupancy_s, arrive)
        self.links.append(use)
        receiver = self.waiting.pop(msg, None)
        if receiver is not None:
            self.wake(receiver, arrive)

    def advance(self, s: int, now: float) -> None:
        """Run stage ``s`` from ``now`` until it blocks or starts something that takes time."""
        steps, events, position = self.steps[s], self.events, self.position
        while position[s] < len(steps):
            step = steps[position[s]]
            start = waited_from = self.free_at[s]
            if step.needs is not None:
                arrive = self.arrival.get(step.needs)
                if arrive is None:
                    self.waiting[step.needs] = s
                    return
                if arrive > now:
                    self.wake(s, arrive)
                    return
                if arrive > start:
                    if not (self.lowered and step.is_comm):
                        self._record_wait(s, step, start, arrive)
                    start = arrive
            if step.is_comm:  # a receive that waited is idle, its handling included (as the runtime measures it)
                end = start + self.costs.compute_s(step.action) if self.charges_messages else start
                category = "idle" if start > waited_from else "comm"
                if category == "idle":
                    self.gaps.append(IdleGap(s, waited_from, end, step.text))
                events.append(Event(s, step.text, waited_from, end, category, step.tag))
            else:
                end = start + self.costs.compute_s(step.action)
                events.append(Event(s, step.text, start, end, step.category, step.tag))
            position[s] += 1
            self.free_at[s] = end
            if end > now:
                self.outbox[s] = step.produces
                self.wake(s, end)
                return
            if step.produces is not None:
                self.post(step.produces, now)

    def _record_wait(self, s: int, step: _Step, start: float, arrive: float) -> None:
        """Note an idle gap before a compute step; unlowered schedules also get an event for their implicit receive."""
        assert step.needs is not None
        if self.lowered:
            self.gaps.append(IdleGap(s, start, arrive, step.text))
            return
        recv = receive_for(step.needs)
        self.gaps.append(IdleGap(s, start, arrive, str(recv)))
        self.events.append(Event(s, str(recv), start, arrive, "idle", KIND_TAG[recv.kind]))

    def timeline(self) -> Timeline:
        return summarize(self.schedule, self.events, self.gaps, self.links)
