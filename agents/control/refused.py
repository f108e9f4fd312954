"""Statuses a client received and could not believe: which ranks, and why, for the commands to say so.

A rank's status that fails verification (:mod:`agents.control.auth`), or that is signed while this client has
no keys to check it, is never parsed. What :class:`RefusedStatuses` keeps of it is only what the client knows
for itself: the rank its *topic* names and the reason it was refused; nothing of the payload (its header names
an identity anyone could write). A trial's ``job status`` without ``--keys`` printed ``no agents of job`` while
four signed agents were live, and ``job start`` with one agent's key from another key folder said ``ranks 3
(no status)``: the reason was only in rate-limited warnings. The commands now say it by rank.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from agents.control.auth import MAGIC
from agents.control.messages import StatusMessage, classify_topic
from geosched.errors import InputError, ProtocolError

__all__ = ["SIGNED", "RefusedStatuses", "rank_list", "refused_row", "summary", "why"]

SIGNED = "signed"
"""The reason for a signed status received by a client without keys: it cannot check it, so it reads nothing."""
MAX_RANKS = 8192
"""Ranks remembered (a plan's most, ``planner.plan.MAX_RANKS``); refusals on more status topics are not kept."""
_WHY = {
    SIGNED: "signed status, not checked: pass --keys DIR, the job's key folder",
    "signature": "status refused, bad signature: its signing key is not the one in this key folder",
    "unsigned": "status refused, unsigned: its agent runs without --keys?",
    "identity": "status refused, identity: this key folder does not let its signer publish it",
    "binding": "status refused, binding: signed for another job, topic or kind",
    "replay": "status refused, replay: a replayed or stale status",
    "conflict": "status refused, conflict: two processes sign as this rank, so its key is in another process's hands",
}


def why(reason: str) -> str:
    """The words for a rank whose status was refused for ``reason``."""
    return _WHY.get(reason, f"status refused, {reason}")


class RefusedStatuses:
    """Per rank, the reason its latest unbelieved status was refused (policy only: the plane feeds it)."""

    def __init__(self, job: str, ranks: Collection[int] | None = None) -> None:
        self.job = job
        self._ranks = ranks  # with keys: the ranks of the key folder; a status of another rank is no rank's
        self._reasons: dict[int, str] = {}

    def note(self, topic: str, reason: str) -> bool:
        """A payload on ``topic`` was refused for ``reason``: kept (True) when the topic is a rank's status."""
        try:
            kind, rank = classify_topic(self.job, topic)
        except ProtocolError:
            return False
        if kind != "status" or rank is None or (rank not in self._reasons and len(self._reasons) >= MAX_RANKS):
            return False
        if self._ranks is not None and rank not in self._ranks:  # a stranger's forgery for a rank the job lacks
            return False
        self._reasons[rank] = reason
        return True

    def signed_unchecked(self, topic: str, payload: bytes) -> bool:
        """For a client without keys: True when ``payload`` is a signed envelope, which it cannot check (dropped
        quietly: a heartbeat's was a 'payload is not JSON' warning above ``job status``'s line); a status's is noted.
        A signed plan goes on: an agent without keys names it (restart with ``--keys``)."""
        try:
            if not payload.startswith(MAGIC) or classify_topic(self.job, topic)[0] == "plan":
                return False
        except ProtocolError:
            return False
        self.note(topic, SIGNED)
        return True

    def of(self, readable: Collection[int]) -> dict[int, str]:
        """Rank -> the words for its refusal (:func:`why`), for the ranks with no ``readable`` status."""
        return {r: why(reason) for r, reason in sorted(self._reasons.items()) if r not in readable}

    def rows(self, readable: Mapping[int, StatusMessage]) -> dict[int, StatusMessage]:
        """``readable`` and a :func:`refused_row` for each rank whose status was refused, in rank order: what
        ``job status`` and its ``--watch`` show."""
        refused = {r: refused_row(r, words) for r, words in self.of(readable).items()}
        return dict(sorted({**readable, **refused}.items()))

    def check_readable(self, statuses: Mapping[int, StatusMessage]) -> None:
        """InputError (exit 2, one line) when some statuses are signed and this client has no keys (what it reads
        is then only what anyone may publish unsigned: a trial's forged rank was shown ``ready`` beside the job's
        unchecked ones), or when none of ``statuses`` (the readable ones) is there but some were refused: a command
        would otherwise say the job has no agents, or none is ready."""
        if SIGNED in self._reasons.values():
            raise InputError(
                f"the statuses of job {self.job!r} on this broker are signed: pass --keys DIR (the job's key folder)"
            )
        if statuses or not self._reasons:
            return
        raise InputError(
            f"job {self.job!r}: no status on this broker could be believed: {summary(self.of(()))}; "
            "is --keys DIR the job's key folder?"
        )


def summary(refused: Mapping[int, str], most: int = 8) -> str:
    """``ranks 3, 4: status refused, bad signature: ...; rank 7: ...``: the ranks of each reason, at most ``most``
    of them named (a job of thousands of ranks, all refused, is still one line)."""
    by_words: dict[str, list[int]] = {}
    for rank, words in sorted(refused.items()):
        by_words.setdefault(words, []).append(rank)
    return "; ".join(f"{rank_list(ranks, most)}: {words}" for words, ranks in by_words.items())


def rank_list(ranks: Sequence[int], most: int = 8) -> str:
    """``rank 3``, ``ranks 3, 4`` or ``ranks 0, 1, ..., 7 and 992 more``."""
    named = ", ".join(map(str, ranks[:most])) + (f" and {len(ranks) - most} more" if len(ranks) > most else "")
    return f"rank{'s' * (len(ranks) != 1)} {named}"


def refused_row(rank: int, words: str) -> StatusMessage:
    """The row of ``geosched job status`` for a rank whose status was refused: state ``refused``, the reason as its
    message; made here from the topic's rank, nothing of the refused payload."""
    return StatusMessage(rank, "refused", extra={"message": words})
