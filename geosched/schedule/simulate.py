"""Event simulator: run a schedule against a cost model and return a :class:`Timeline`.

Semantics: each stage executes its actions strictly in order. F, B, I, W, STEP
and ALL_REDUCE occupy the stage for ``costs.compute_s(action)``. A SEND enqueues
its message on a link, a FIFO per (link key, direction) where it waits until
the link is free, occupies it ``occupancy_s`` and arrives ``latency_s`` later.
A RECV blocks the stage until its message has arrived. SEND and RECV take no
stage time unless the cost model sets ``charges_messages`` (then each takes
``compute_s(action)``: the time a rank spends handling the message). A cost
model that sets ``durations_by_kind`` promises that durations depend only on
the stage and the action's kind, and transfers only on (source, destination,
kind), not on the microbatch: the simulator then asks once per distinct key.
Unlowered schedules (no SEND/RECV) get the same behaviour implicitly: F of
stage s+1 waits for F of s, B (or I) of s for B (or I) of s+1; W waits for nothing.

The run is event driven (a heap of stage wake-ups), O(actions log stages),
with no per-time-step loop, so planners may call it thousands of times
(with ``record=False``, which skips building the events).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol

from geosched.errors import ScheduleError
from geosched.schedule.actions import (
    COMM_KINDS,
    KIND_TAG,
    Action,
    ActionKind,
    Message,
    Schedule,
    receive_for,
    row_edges,
)
from geosched.schedule.timeline import Event, IdleGap, LinkUse, Timeline, peak_inflight, stage_stats, summarize
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

    durations_by_kind: ClassVar[bool] = True

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


COMPUTE, COLLECTIVE, MESSAGE = 0, 1, 2
"""A step's role in the event loop: stage time counted as busy, stage time counted as communication (ALL_REDUCE),
a SEND or RECV."""
_KIND_INFO = {
    kind: (
        KIND_TAG[kind],
        "comm" if kind in COMM_KINDS or kind is K.ALL_REDUCE else "compute",
        MESSAGE if kind in COMM_KINDS else COLLECTIVE if kind is K.ALL_REDUCE else COMPUTE,
    )
    for kind in K
}
"""Per kind: its tag, its timeline category, its role."""
_ROLE = {kind: info[2] for kind, info in _KIND_INFO.items()}


class CompiledSchedule(NamedTuple):
    """A schedule in the simulator's terms (steps per stage, messages by index, activations held):
    compile once with :func:`compile_schedule`, simulate against many cost models. The per-stage columns
    (``needs``, ``produces``, ``roles``) are what the event loop reads of the steps, as plain ints."""

    schedule: Schedule
    lowered: bool
    steps: tuple[tuple[Action, ...], ...]  # per stage, its actions
    messages: tuple[Message, ...]
    peaks: tuple[int, ...]
    firsts: tuple[dict[str, int], ...]  # per stage, each kind's (tag's) first step: costs by kind are asked once
    tags: tuple[tuple[str, ...], ...]  # per stage, its steps' tags
    needs: tuple[tuple[int, ...], ...]  # per stage, each step's message waited for (index), or -1
    produces: tuple[tuple[int, ...], ...]  # per stage, each step's message emitted (index), or -1
    roles: tuple[tuple[int, ...], ...]  # per stage, each step's COMPUTE, COLLECTIVE or MESSAGE
    routes: tuple[int, ...]  # the first message of each distinct (src, dst, kind), in order
    route_of: tuple[int, ...]  # per message, the index of its (src, dst, kind) in routes


def compile_schedule(schedule: Schedule) -> CompiledSchedule:
    """A snapshot of ``schedule`` ready to simulate (later edits to ``schedule`` do not reach it)."""
    return _compile(
        tuple(tuple(schedule.actions[s]) for s in range(schedule.num_stages)), schedule.name, schedule.num_microbatches
    )


@functools.lru_cache(maxsize=8)
def _compile(actions: tuple[tuple[Action, ...], ...], name: str, microbatches: int) -> CompiledSchedule:
    """:func:`compile_schedule`, memoized on the exact actions (for callers that pass a plain Schedule)."""
    p = len(actions)
    index: dict[Message, int] = {}
    snapshot = Schedule({s: list(row) for s, row in enumerate(actions)}, p, microbatches, name)
    lowered = snapshot.has_communication

    waits, emits, roles = [], [], []
    number, role_of = index.setdefault, _ROLE  # messages numbered as met
    for row in actions:
        wait_row: list[int] = []
        emit_row: list[int] = []
        for needs, produces in row_edges(row, p, lowered):
            wait_row.append(-1 if needs is None else number(needs, len(index)))
            emit_row.append(-1 if produces is None else number(produces, len(index)))
        waits.append(tuple(wait_row))
        emits.append(tuple(emit_row))
        roles.append(tuple([role_of[a.kind] for a in row]))
    peaks = tuple(peak_inflight(snapshot, s) for s in range(p))
    tags = tuple(tuple([KIND_TAG[a.kind] for a in row]) for row in actions)
    firsts = tuple({tag: row.index(tag) for tag in dict.fromkeys(row)} for row in tags)
    messages = tuple(index)
    routes, route_of = _routes(messages)
    columns = tuple(waits), tuple(emits), tuple(roles)
    return CompiledSchedule(snapshot, lowered, actions, messages, peaks, firsts, tags, *columns, routes, route_of)


def _routes(messages: tuple[Message, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The first message of each distinct (source, destination, kind), in order, and each message's route:
    a cost model with ``durations_by_kind`` is asked once per route."""
    number: dict[tuple[int, int, str], int] = {}
    firsts: list[int] = []
    route_of: list[int] = []
    for k, m in enumerate(messages):
        key = (m.src, m.dst, m.kind)
        if key not in number:
            number[key] = len(firsts)
            firsts.append(k)
        route_of.append(number[key])
    return tuple(firsts), tuple(route_of)


def simulate(
    schedule: Schedule | CompiledSchedule, costs: CostProvider, *, check: bool = True, record: bool = True
) -> Timeline:
    """Simulate one iteration of ``schedule``; ``check=False`` skips :func:`validate` (hot loops).

    ``record=False`` keeps only what a planner reads (the iteration time and
    per-stage stats): the timeline has no events, gaps or link uses, and the
    run is several times faster.
    """
    if check:
        validate(schedule.schedule if isinstance(schedule, CompiledSchedule) else schedule)
    code = schedule if isinstance(schedule, CompiledSchedule) else compile_schedule(schedule)
    return _Run(code, costs, record).execute()


class _Run:
    """One simulation: durations and transfers looked up once, then an event loop over plain lists."""

    def __init__(self, code: CompiledSchedule, costs: CostProvider, record: bool) -> None:
        self.code, self.costs, self.record = code, costs, record
        self.schedule, self.p, self.lowered = code.schedule, code.schedule.num_stages, code.lowered
        charges = getattr(costs, "charges_messages", False)
        by_kind = getattr(costs, "durations_by_kind", False)

        def duration(action: Action) -> float:
            return 0.0 if action.kind in COMM_KINDS and not charges else costs.compute_s(action)

        if by_kind:  # each stage's kinds costed once, then looked up per step
            self.durations = []
            for row, firsts, tags in zip(code.steps, code.firsts, code.tags, strict=True):
                of_kind = {tag: duration(row[i]) for tag, i in firsts.items()}
                self.durations.append([of_kind[tag] for tag in tags])
        else:
            self.durations = [[duration(action) for action in row] for row in code.steps]
        link_ids: dict[tuple[Hashable, bool], int] = {}

        def route(src: int, dst: int, tr: Transfer) -> tuple[int, float, float]:
            link = -1 if tr.link is None else link_ids.setdefault((tr.link, dst > src), len(link_ids))
            return link, tr.occupancy_s, tr.latency_s

        # per message: (link id or -1, occupancy, latency); links numbered in order of first use either way
        self.transfer: list[tuple[int, float, float]]
        if by_kind:  # one question per (source, destination, kind), in order of first use
            heads = [code.messages[k] for k in code.routes]
            routes = [route(m.src, m.dst, costs.transfer(m.src, m.dst, m.kind, m.microbatch)) for m in heads]
            self.transfer = [routes[k] for k in code.route_of]
        else:
            self.transfer = [
                route(m.src, m.dst, costs.transfer(m.src, m.dst, m.kind, m.microbatch)) for m in code.messages
            ]
        self.link_keys = list(link_ids)
        self.events: list[Event] = []
        self.gaps: list[IdleGap] = []
        self.links: list[LinkUse] = []

    def execute(self) -> Timeline:
        """Pop stage wake-ups in time order until every stage is done or blocked for good.

        Each stage runs its actions in order from its wake-up until it blocks on
        a message that has not arrived or starts something that takes time; a
        message is posted on its link when the action producing it ends.
        """
        p, steps, durations, transfer, record = self.p, self.code.steps, self.durations, self.transfer, self.record
        needs, produces, roles = self.code.needs, self.code.produces, self.code.roles
        position, free_at = [0] * p, [0.0] * p
        busy, comm = [0.0] * p, [0.0] * p
        outbox = [-1] * p  # message produced at the end of a running action
        arrival: list[float | None] = [None] * len(self.code.messages)
        waiting: dict[int, int] = {}  # message -> the stage blocked on it
        link_free = [0.0] * len(self.link_keys)
        heap = [(0.0, s + 1, s) for s in range(p)]
        seq = p
        push, pop = heapq.heappush, heapq.heappop

        def post(msg: int, now: float) -> None:
            nonlocal seq
            link, occupancy, latency = transfer[msg]
            begin = now
            if link >= 0:
                begin = max(now, link_free[link])
                link_free[link] = begin + occupancy
            arrive = arrival[msg] = begin + occupancy + latency
            if record:
                self._record_link(msg, now, begin, occupancy, arrive)
            receiver = waiting.pop(msg, -1)
            if receiver >= 0:
                seq += 1
                push(heap, (arrive, seq, receiver))

        while heap:
            now, _, s = pop(heap)
            if outbox[s] >= 0:
                post(outbox[s], now)
                outbox[s] = -1
            times, wants, makes, role_of, i = durations[s], needs[s], produces[s], roles[s], position[s]
            last = len(times)
            while i < last:
                start = waited_from = free_at[s]
                need = wants[i]
                if need >= 0:
                    arrive = arrival[need]
                    if arrive is None:
                        waiting[need] = s
                        break
                    if arrive > now:
                        seq += 1
                        push(heap, (arrive, seq, s))
                        break
                    if arrive > start:
                        if record and not (self.lowered and role_of[i] == MESSAGE):
                            self._record_wait(s, steps[s][i], need, start, arrive)
                        start = arrive
                end = start + times[i]
                role = role_of[i]
                if role == COMPUTE:
                    busy[s] += end - start
                    if record:
                        self._record_event(s, steps[s][i], start, end)
                elif role == COLLECTIVE:
                    comm[s] += end - start
                    if record:
                        self._record_event(s, steps[s][i], start, end)
                elif start > waited_from:  # a receive that waited: idle, its handling included (as measured)
                    if record:
                        action = steps[s][i]
                        self.gaps.append(IdleGap(s, waited_from, end, str(action)))
                        self.events.append(Event(s, str(action), waited_from, end, "idle", KIND_TAG[action.kind]))
                else:
                    comm[s] += end - start
                    if record:
                        action = steps[s][i]
                        self.events.append(Event(s, str(action), waited_from, end, "comm", KIND_TAG[action.kind]))
                i += 1
                free_at[s] = end
                if end > now:
                    outbox[s] = makes[i - 1]
                    seq += 1
                    push(heap, (end, seq, s))
                    break
                if makes[i - 1] >= 0:
                    post(makes[i - 1], now)
            position[s] = i
        stuck = {s: steps[s][i] for s, i in enumerate(position) if i < len(steps[s])}
        if stuck:
            raise ScheduleError(describe_deadlock(stuck))
        if record:
            return summarize(self.schedule, self.events, self.gaps, self.links)
        return self._summary(free_at, busy, comm)

    def _summary(self, free_at: list[float], busy: list[float], comm: list[float]) -> Timeline:
        """The timeline of an unrecorded run: iteration time and per-stage stats only."""
        ran = [free_at[s] for s in range(self.p) if self.code.steps[s]]
        iteration = max(ran, default=0.0)
        stats = stage_stats(iteration, busy, comm, list(self.code.peaks))
        s = self.schedule
        return Timeline(s.name, s.num_stages, s.num_microbatches, iteration, [], [], stats)

    def _record_link(self, msg: int, now: float, begin: float, occupancy: float, arrive: float) -> None:
        """Note one message's trip over the network."""
        m = self.code.messages[msg]
        link = self.transfer[msg][0]
        key = None if link < 0 else self.link_keys[link][0]
        self.links.append(LinkUse(key, m.src, m.dst, m.kind, m.microbatch, now, begin, begin + occupancy, arrive))

    def _record_event(self, s: int, action: Action, start: float, end: float) -> None:
        """Note a compute or collective step's run."""
        tag, category, _ = _KIND_INFO[action.kind]
        self.events.append(Event(s, str(action), start, end, category, tag))

    def _record_wait(self, s: int, action: Action, need: int, start: float, arrive: float) -> None:
        """Note an idle gap before a compute step; unlowered schedules also get an event for their implicit receive."""
        if self.lowered:
            self.gaps.append(IdleGap(s, start, arrive, str(action)))
            return
        recv = receive_for(self.code.messages[need])
        self.gaps.append(IdleGap(s, start, arrive, str(recv)))
        self.events.append(Event(s, str(recv), start, arrive, "idle", KIND_TAG[recv.kind]))
