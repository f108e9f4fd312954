"""A missing or dead replica fails the others within the timeout, naming it; never a hang."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from agents.dp.group import DataParallelGroup, join_group
from agents.dp.health import HeartbeatMonitor
from agents.dp.local_group import run_local_group
from agents.dp.spec import GroupSpec
from geosched.errors import CollectiveError

TIMEOUT_S = 10.0
KILL_AFTER_S = 0.3


def _die_during_allreduce(group: DataParallelGroup, victim: int, scheme: str, how: str) -> dict[str, object]:
    """Every rank all-reduces 16 MiB in a loop; ``victim`` dies mid-way (os._exit or SIGKILL)."""
    x = torch.ones(4 * 2**20)
    group.barrier()
    if group.rank == victim:

        def die() -> None:
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)

        threading.Timer(KILL_AFTER_S, die).start()
    start, rounds = time.monotonic(), 0
    try:
        while time.monotonic() - start < 3 * TIMEOUT_S:
            if scheme == "ring":
                group.ring_allreduce(x, "avg")
            else:
                group.allreduce(x, "avg")
            rounds += 1
    except CollectiveError as exc:
        return {"error": str(exc), "after_kill_s": time.monotonic() - start - KILL_AFTER_S, "rounds": rounds}
    return {"error": None, "rounds": rounds}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("size", "victim", "scheme", "how", "host_store"),
    [
        (3, 1, "ring", "exit", False),
        (2, 0, "native", "sigkill", True),  # the victim also hosts the store
    ],
)
def test_killed_rank_is_named_by_survivors(size: int, victim: int, scheme: str, how: str, host_store: bool) -> None:
    results = run_local_group(
        _die_during_allreduce, size, victim, scheme, how, timeout_s=TIMEOUT_S, host_store=host_store, deadline_s=120
    )
    assert results[victim].value is None
    assert results[victim].exitcode == (-signal.SIGKILL if how == "sigkill" else 3)
    for res in results:
        if res.rank == victim:
            continue
        assert res.exitcode == 0 and res.error is None, res
        report = res.value
        assert report["error"] is not None, f"rank {res.rank} never noticed rank {victim} died"
        assert f"missing rank(s) [{victim}]" in report["error"], report["error"]
        assert report["after_kill_s"] < TIMEOUT_S + 5, (
            report
        )  # bounded by the timeout, not a hang (slack for a loaded CI)


def test_rendezvous_names_the_rank_that_never_came() -> None:
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    spec = GroupSpec("eu/stage1", 1, 2, "127.0.0.1", store.port, timeout_s=1.0, host_store=False)
    start = time.monotonic()
    with pytest.raises(CollectiveError, match=r"rank\(s\) \[0\] did not join within 1 s"):
        join_group(spec)
    assert time.monotonic() - start < 1.0 + 2.0
    assert not dist.is_initialized()


def test_rendezvous_host_waits_then_names_missing_rank() -> None:
    spec = GroupSpec("eu/stage1", 0, 3, "127.0.0.1", 0, timeout_s=1.0)  # replica 0 hosts on a free port
    with pytest.raises(CollectiveError, match=r"rank\(s\) \[1, 2\] did not join"):
        join_group(spec)
    assert not dist.is_initialized()


def test_missing_store_host_is_named() -> None:
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    port = store.port
    del store  # nothing listens there any more
    spec = GroupSpec("eu/stage1", 1, 2, "127.0.0.1", port, timeout_s=1.0)
    with pytest.raises(CollectiveError, match=r"rank 0 \(the store host\) is missing"):
        join_group(spec)


def test_the_rank_that_went_quiet_first_is_named_not_the_ones_stuck_behind_it() -> None:
    """Heartbeats as recorded: rank 1 stopped first, rank 3 a few beats later (blocked on it), rank 2 beats on."""
    monitor = HeartbeatMonitor(GroupSpec("eu/stage0", 0, 4, "127.0.0.1", 1, timeout_s=6.0, host_store=False))
    now, beat = time.monotonic(), monitor.interval_s
    monitor._last_change = [now, now - 12 * beat, now, now - 7 * beat]  # what the beating thread records
    missing, why = monitor.missing_ranks()
    assert missing == [1]
    assert "rank(s) [1] stopped responding" in why and "rank(s) [3] went quiet after them" in why
    monitor._last_change = [now, now - 12 * beat, now, now - 11 * beat]  # two deaths at about the same time
    assert monitor.missing_ranks()[0] == [1, 3]


def _meet_or_die(group: DataParallelGroup, barrier: object, victim: int) -> str:
    """Every rank waits at a barrier of the caller's (up to a minute); ``victim`` is killed before it gets there."""
    if group.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    barrier.wait(60.0)  # type: ignore[attr-defined]
    return "met"


def test_a_rank_killed_before_a_shared_barrier_releases_the_others_at_once() -> None:
    """A calibration process killed by SIGKILL left the other ranks at the calibration's barrier until its
    timeout (2 minutes) and the error read 'BrokenBarrierError: '; ``on_death`` aborts the barrier at once."""
    ctx = torch.multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    began = time.monotonic()
    results = run_local_group(_meet_or_die, 2, barrier, 1, timeout_s=TIMEOUT_S, deadline_s=120, on_death=barrier.abort)
    assert time.monotonic() - began < 40  # not the barrier's minute
    assert results[1].exitcode == -signal.SIGKILL and results[1].value is None
    assert results[0].error == "BrokenBarrierError", results[0]


def _wait_long(group: DataParallelGroup, started: object) -> str:
    started.set()  # type: ignore[attr-defined]
    time.sleep(120)
    return "done"


def test_a_stopped_local_group_starts_no_more_processes_and_kills_the_running_ones() -> None:
    """A launch interrupted while it calibrated waited for its co-located ranks (forking new ones after the
    signal): about 12 s on a loaded 2-core host before it ended. ``stop`` ends a group's processes at once."""
    stop = threading.Event()
    stop.set()
    never = run_local_group(_wait_long, 2, None, deadline_s=120, stop=stop)
    assert [(r.value, r.exitcode) for r in never] == [(None, None), (None, None)]  # none started
    ctx = torch.multiprocessing.get_context("spawn")
    started, stop = ctx.Event(), threading.Event()
    threading.Thread(target=lambda: started.wait(60) and stop.set(), daemon=True).start()
    killed = run_local_group(_wait_long, 2, started, deadline_s=120, stop=stop)
    assert started.is_set() and all(r.value is None and r.exitcode in (-signal.SIGKILL, None) for r in killed), killed
    assert killed[0].exitcode == -signal.SIGKILL or killed[1].exitcode == -signal.SIGKILL, killed  # the one waiting
