"""Who is lost: the coordinator's judgement of its agents from what it hears (policy only, no I/O).

An agent is heard through its statuses, step metrics and heartbeats (every
:data:`~agents.control.messages.HEARTBEAT_S` seconds, carrying the step in
progress and the schedule actions its stage has completed). The judge counts
only time during which the coordinator itself was connected to the broker, so
a broker outage never reads as lost agents. Two rules, each with a bound:

* **A last will** (``offline``, published by the broker when an agent's
  connection drops, and for *every* agent when a broker shuts down) is only a
  suspicion: it is believed after :data:`WILL_GRACE_S` connected seconds with
  no sign of life from that rank, once the job has stalled (no step progress
  for :data:`STALLED_S`: a pipeline cannot move without all of its ranks, so
  progress proves them alive).
* **A silent rank** (no message for :data:`SILENT_S` connected seconds) is
  lost when the broker evidently delivers (another rank was heard in the last
  :data:`SILENT_S` / 2 seconds) and the job has stalled: a
  frozen process (SIGSTOP), a hung loop or an agent cut off from the control
  plane while the job stalls. A rank not heard since the coordinator's own
  latest (re)connect gets :data:`WILL_GRACE_S` instead, the time an agent in
  its reconnect back-off (capped at 5 s) needs to come back.

So a frozen agent is named within about ``SILENT_S`` + one heartbeat (7 s),
a killed one as soon (its will and its silence), or within ``WILL_GRACE_S``
(8 s) of its will when nobody else is heard either, and a coordinator
that stalls itself never blames an agent (every rank falls silent together,
so no other rank was heard recently).
"""

from __future__ import annotations

from collections.abc import Iterable

WILL_GRACE_S = 8.0
"""Connected seconds an ``offline`` will (or a rank silent since the coordinator reconnected) waits for a
sign of life before it is believed (agents reconnect within their 5 s back-off cap after a broker restart)."""
SILENT_S = 6.0
"""Connected seconds of silence (no heartbeat, status or metrics) after which a rank is lost while others
are heard and nothing progresses (six heartbeats missed)."""
STALLED_S = SILENT_S / 2
"""Connected seconds without step progress after which the job counts as stalled: every rank of a job is
coupled by its pipelines and gradient sync, so a lost rank stalls the rest within one iteration."""


class Liveness:
    """The judge: feed it what is heard and the passing time; :meth:`lost` names the lost ranks."""

    def __init__(self, ranks: Iterable[int], now: float, connects: int = 0) -> None:
        self._ranks = sorted(set(ranks))
        self._last_tick, self._connects = now, connects
        self._silent = dict.fromkeys(self._ranks, 0.0)  # connected seconds since the rank was last heard
        self._heard_since_connect = set(self._ranks)
        self._suspects: dict[int, float] = {}  # rank -> connected seconds since its will arrived
        self._quiet = 0.0  # connected seconds since any step progress
        self._progress: dict[int, tuple[int, int]] = {}  # rank -> (step, actions) of its latest heartbeat

    def tick(self, now: float, connected: bool, connects: int) -> None:
        """Advance the clock to ``now``; ``connects`` counts the coordinator's connections so far."""
        elapsed, self._last_tick = max(0.0, now - self._last_tick), now
        if connects != self._connects:  # reconnected: silence counts afresh, and whoever has not been heard
            self._connects, self._heard_since_connect = connects, set()  # since may still be in its back-off
            self._silent = dict.fromkeys(self._ranks, 0.0)
            return
        if not connected:
            return
        self._quiet += elapsed
        for rank in self._silent:
            self._silent[rank] += elapsed
        for rank in self._suspects:
            self._suspects[rank] += elapsed

    def heard(self, rank: int, step: int | None = None, actions: int | None = None) -> None:
        """A sign of life from ``rank``; ``step``/``actions`` from a heartbeat (progress when they moved)."""
        if rank not in self._silent:
            return
        self._silent[rank] = 0.0
        self._heard_since_connect.add(rank)
        self._suspects.pop(rank, None)
        if step is not None and actions is not None:
            if self._progress.get(rank, (step, actions)) != (step, actions):
                self._quiet = 0.0
            self._progress[rank] = (step, actions)

    def stepped(self) -> None:
        """A step's metrics arrived: the job progresses."""
        self._quiet = 0.0

    def offline(self, rank: int) -> None:
        """``rank``'s last will arrived (a second one does not restart its clock)."""
        if rank in self._silent:
            self._suspects.setdefault(rank, 0.0)

    def lost(self) -> list[tuple[int, str]]:
        """The ranks judged lost now, each with the reason in words."""
        out: list[tuple[int, str]] = []
        if self._quiet < STALLED_S:
            return out  # the job moves: every rank is alive
        for rank in self._ranks:
            silent, suspect = self._silent[rank], self._suspects.get(rank)
            silent_too_long = self._others_heard(rank) and silent >= self._silence_bound(rank)
            if suspect is not None and (suspect >= WILL_GRACE_S or silent_too_long):
                out.append((rank, f"went offline (its last will) and was silent for {silent:.0f} s"))
            elif silent_too_long:
                out.append((rank, f"silent for {silent:.0f} s while the other agents were heard: frozen or cut off"))
        return out

    def next_s(self) -> float:
        """Connected seconds until the next judgement could change (for the caller's wait)."""
        waits = [STALLED_S - self._quiet] + [WILL_GRACE_S - s for s in self._suspects.values()]
        waits += [self._silence_bound(rank) - s for rank, s in self._silent.items()]
        return max(0.05, min([w for w in waits if w > 0], default=1.0))

    def _silence_bound(self, rank: int) -> float:
        return SILENT_S if rank in self._heard_since_connect else WILL_GRACE_S

    def _others_heard(self, rank: int) -> bool:
        return any(s < SILENT_S / 2 for other, s in self._silent.items() if other != rank)


class BrokerAway:
    """When to tell the operator that the broker is gone and when it is back (policy only): the agents train on
    without it, so the coordinator's step lines pause; one line after ``after_s`` away, one when it returns."""

    def __init__(self, after_s: float = 10.0) -> None:
        self.after_s = after_s
        self._since: float | None = None
        self._said = False

    def note(self, connected: bool, now: float, step: int | None) -> str | None:
        """The line to print now, if any."""
        since = self._since
        if connected:
            line = f"control plane: the broker is back after {now - since:.0f} s" if since and self._said else None
            self._since, self._said = None, False
            return line
        if self._since is None:
            self._since = now
        if not self._said and now - self._since >= self.after_s:
            self._said = True
            return (
                f"control plane: the broker is unreachable (for {now - self._since:.0f} s, at step {step}); the agents "
                "train on without it and the step lines resume when it is back"
            )
        return None
