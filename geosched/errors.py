"""The one exception hierarchy of geosched.

Errors caused by what a user gave us (a config, a plan, a request, a frame)
derive from :class:`InputError` and map to exit code 2; failures while
running map to exit code 1. The CLI translates them at the boundary into a
single line on stderr, never a traceback.
"""


class GeoschedError(Exception):
    """Base of every error geosched raises on purpose."""

    exit_code = 1
    label = "error"
    """What the CLI's line calls it (``geosched VERB: error: ...``); empty for what is no failure."""


class InputError(GeoschedError):
    """Something the user supplied is wrong; the message says what and how to fix it."""

    exit_code = 2


class ConfigError(InputError):
    """A cluster/job config is malformed; the message names the dotted field path."""


class PlanInfeasible(InputError):
    """No plan satisfies the constraints; the message names the tightest one with numbers."""


class PlanError(InputError):
    """A plan file is malformed or does not match the cluster or the agents."""


class ScheduleError(InputError):
    """A pipeline schedule is invalid (deadlock, B before F, unmatched send); names the action."""


class ProtocolError(InputError):
    """A network frame or request is malformed, oversized or unauthenticated."""


class LinkError(GeoschedError):
    """A WAN link failed at run time (peer unreachable, timed out)."""


class LinkTimeout(LinkError):
    """Nothing arrived from a WAN peer within the receive timeout: the peer stopped sending, or the link to it."""


class CollectiveError(GeoschedError):
    """An intra-DC collective failed or timed out (names the missing rank)."""


class CheckpointError(InputError):
    """A checkpoint is missing, incomplete or corrupt."""


class StageError(GeoschedError):
    """A pipeline stage failed while running an action; the message shows the schedule grid with it marked."""


class TrainingDiverged(StageError):
    """The loss is not finite (NaN or inf): training diverged, and the step's update would spread it."""
