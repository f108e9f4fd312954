"""Pipeline actions and schedules as plain data.

An :class:`Action` is ``(stage, kind, microbatch)`` with a compact string form
that parses back, following ``torch.distributed.pipelining``'s naming:
``"2F0"`` (stage 2, forward of microbatch 0), ``"1B3"``, ``"1I3"`` (backward for
the input gradient only), ``"1W3"`` (backward for the weight gradient), ``"0SEND_F3"``,
``"1RECV_F3"``, ``"1SEND_B3"``, ``"0RECV_B3"``, ``"0ALL_REDUCE"``, ``"0STEP"``.

A :class:`Schedule` maps each stage to its ordered list of actions. The
dependency rules between stages live here too (:func:`message_edges`), so the
validator's dry run and the simulator read the same ones.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

from geosched.errors import ScheduleError


class ActionKind(str, Enum):
    """What an action does; the value is its tag in the string form."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"  # zero bubble: the input gradient only (what stage s-1 waits for)
    BACKWARD_WEIGHT = "W"  # zero bubble: the weight gradient, after I of the same microbatch
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ALL_REDUCE = "ALL_REDUCE"
    STEP = "STEP"


COMPUTE_KINDS = frozenset(
    {ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT, ActionKind.STEP}
)
# Kinds that need the output gradient from stage s+1 and produce the input gradient for s-1.
GRADIENT_KINDS = frozenset({ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT})
COMM_KINDS = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})
# Kinds that name no microbatch: they act on the whole stage once per iteration.
STAGE_WIDE_KINDS = frozenset({ActionKind.ALL_REDUCE, ActionKind.STEP})

KIND_TAG: dict[ActionKind, str] = {k: k.value for k in ActionKind}  # faster than .value in hot loops
_KIND_PATTERN = "|".join(sorted((k.value for k in ActionKind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"(\d+)({_KIND_PATTERN})(\d*)")


class Action(NamedTuple):
    """One step of one pipeline stage: ``Action(1, ActionKind.BACKWARD, 3)`` is ``"1B3"``."""

    stage: int
    kind: ActionKind
    microbatch: int | None = None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{KIND_TAG[self.kind]}{mb}"

    def __repr__(self) -> str:
        return f"Action({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``"2F0"``-style text; raise :class:`ScheduleError` naming it when malformed."""
        match = _ACTION_RE.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(
                f"bad action {text!r}: expected <stage><kind><microbatch> such as '2F0', "
                f"'1SEND_B3' or '0STEP' (kinds: {', '.join(k.value for k in ActionKind)})"
            )
        stage, kind, mb = int(match[1]), ActionKind(match[2]), match[3]
        if kind in STAGE_WIDE_KINDS and mb:
            raise ScheduleError(f"bad action {text!r}: {kind.value} takes no microbatch (write '{stage}{kind.value}')")
        if kind not in STAGE_WIDE_KINDS and not mb:
            raise ScheduleError(f"bad action {text!r}: {kind.value} needs a microbatch (e.g. '{stage}{kind.value}0')")
        return cls(stage, kind, int(mb) if mb else None)


@dataclass
class Schedule:
    """Ordered actions per stage, plus the shape they were built for."""

    actions: dict[int, list[Action]]
    num_stages: int
    num_microbatches: int
    name: str = "custom"

    @property
    def has_communication(self) -> bool:
        """True once explicit SEND/RECV actions are present (see ``lower.add_communication``)."""
        return any(a.kind in COMM_KINDS for acts in self.actions.values() for a in acts)

    def num_actions(self) -> int:
        """Total number of actions over all stages."""
        return sum(len(acts) for acts in self.actions.values())

    def to_dict(self) -> dict[str, object]:
        """JSON/YAML-ready form: action strings per stage."""
        return {
            "name": self.name,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "actions": {str(s): [str(a) for a in acts] for s, acts in sorted(self.actions.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        """Inverse of :meth:`to_dict`; malformed input raises :class:`ScheduleError`."""
        try:
            raw = data["actions"]
            actions = {int(s): [Action.parse(t) for t in texts] for s, texts in raw.items()}
            return cls(actions, int(data["num_stages"]), int(data["num_microbatches"]), str(data.get("name", "custom")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ScheduleError(
                f"bad schedule data ({exc!r}): expected keys name, num_stages, num_microbatches, "
                "actions {stage: [action strings]}"
            ) from None


class Message(NamedTuple):
    """A tensor crossing a stage boundary: activation ("F") or gradient ("B") of one microbatch."""

    kind: str
    src: int
    dst: int
    microbatch: int


def message_edges(action: Action, num_stages: int, lowered: bool) -> tuple[Message | None, Message | None]:
    """Return ``(needs, produces)``: the message ``action`` waits for and the one it emits.

    In a lowered schedule only RECV waits and only SEND emits. In an unlowered
    one the dependencies are implicit: F on stage s needs F of s-1 and feeds
    s+1; B on stage s needs B of s+1 and feeds s-1.
    """
    return _edges(action, action.stage >= num_stages - 1, lowered)


def row_edges(actions: Sequence[Action], num_stages: int, lowered: bool) -> list[tuple[Message | None, Message | None]]:
    """:func:`message_edges` of each of ``actions``, in one call (the simulator compiles thousands)."""
    last = num_stages - 1
    return [_edges(a, a.stage >= last, lowered) for a in actions]


@functools.lru_cache(maxsize=1 << 16)
def _edges(action: Action, last: bool, lowered: bool) -> tuple[Message | None, Message | None]:
    """:func:`message_edges`, memoised on what the answer depends on (``last``: no stage after this one), so
    pipelines of any depth share it: the planner compiles the same actions in many shapes and orders."""
    s, kind = action.stage, action.kind
    if kind in STAGE_WIDE_KINDS:
        return None, None
    mb = int(action.microbatch)  # type: ignore[arg-type]  # every other kind names a microbatch
    if lowered:
        if kind is ActionKind.RECV_F:
            return Message("F", s - 1, s, mb), None
        if kind is ActionKind.RECV_B:
            return Message("B", s + 1, s, mb), None
        if kind is ActionKind.SEND_F:
            return None, Message("F", s, s + 1, mb)
        if kind is ActionKind.SEND_B:
            return None, Message("B", s, s - 1, mb)
        return None, None
    if kind is ActionKind.FORWARD:
        needs = Message("F", s - 1, s, mb) if s > 0 else None
        return needs, (Message("F", s, s + 1, mb) if not last else None)
    if kind in GRADIENT_KINDS:
        needs = Message("B", s + 1, s, mb) if not last else None
        return needs, (Message("B", s, s - 1, mb) if s > 0 else None)
    return None, None


def receive_for(message: Message) -> Action:
    """The RECV action (explicit or implicit) that consumes ``message`` on its destination stage."""
    kind = ActionKind.RECV_F if message.kind == "F" else ActionKind.RECV_B
    return Action(message.dst, kind, message.microbatch)
