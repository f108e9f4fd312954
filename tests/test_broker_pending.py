"""The embedded broker's connections that have not sent their CONNECT yet (agents.control.broker_policy)."""

from __future__ import annotations

from agents.control.broker_policy import BrokerLimits


def test_a_storm_of_pending_connections_from_many_addresses_pushes_out_its_own_not_a_genuine_one() -> None:
    """Beyond the total bound the oldest pending connection of all was closed: six stranger addresses within
    their own bound pushed out a genuine client's connection whose CONNECT was on its way (and the log line named
    the stranger's address, not the one closed)."""
    from agents.control.broker_policy import PendingConnections

    pending: PendingConnections[str] = PendingConnections(BrokerLimits(pending_per_address=4, pending_connections=10))
    assert pending.add("genuine", "10.0.0.1") == []
    closed: list[tuple[str, str]] = []
    for i in range(40):
        closed += pending.add(f"s{i}", f"192.0.2.{i % 6}")
    assert "genuine" not in [key for key, _ in closed]
    assert all(address.startswith("192.0.2.") for _, address in closed)  # each named by its own address
    (late_closed,) = pending.add("late", "10.0.0.2")  # another genuine one: a stranger's goes, not either of them
    assert late_closed[0] not in ("genuine", "late") and late_closed[1].startswith("192.0.2.")
