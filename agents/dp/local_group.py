"""Run a function in G fresh processes forming one gloo (or NCCL) group on 127.0.0.1.

For tests, benchmarks and rehearsals on one machine: the processes are
spawned, join a :class:`~agents.dp.group.DataParallelGroup`, run the
function and hand back its result, error or exit code.
"""

from __future__ import annotations

import dataclasses
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from agents.dp.group import join_group
from agents.dp.health import store_timeout
from agents.dp.spec import GroupSpec
from agents.dp.store import listening_store


@dataclass
class LocalRankResult:
    """What one process of :func:`run_local_group` returned, raised, or how it died."""

    rank: int
    value: object = None
    error: str | None = None
    exitcode: int | None = None


def _local_worker(
    rank: int, spec: GroupSpec, fn: Callable[..., object], args: tuple[object, ...], threads: int, results: Any
) -> None:
    torch.set_num_threads(threads)
    try:
        local_rank = rank if spec.backend == "nccl" else 0  # one GPU per process
        with join_group(dataclasses.replace(spec, rank=rank, local_rank=local_rank)) as group:
            results.put((rank, fn(group, *args), None))
    except Exception as exc:  # noqa: BLE001 - handed back to the parent
        results.put((rank, None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__))


def run_local_group(
    fn: Callable[..., object],
    size: int,
    *args: object,
    timeout_s: float = 30.0,
    deadline_s: float = 300.0,
    name: str = "local",
    host_store: bool = False,
    threads: int = 1,
    backend: str = "gloo",
    start_method: str = "spawn",
    on_death: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
) -> list[LocalRankResult]:
    """Run ``fn(group, *args)`` in ``size`` fresh processes forming one gloo group on 127.0.0.1.

    For tests, benchmarks and rehearsals on one machine. The caller hosts the
    store on a port the OS picks unless ``host_store`` (then replica 0 hosts
    it on a free port). ``fn`` must be importable (module level) and return
    something picklable; ``timeout_s`` is the group's collective timeout,
    ``deadline_s`` bounds the whole run, after which stragglers are killed.
    ``backend="nccl"``: rank r on GPU r of this host. ``start_method="forkserver"`` forks the
    processes from a server that imported its preload modules once (no torch import per process).
    ``on_death`` is called once when a process dies without a result (e.g. to abort a barrier the others wait at).
    ``stop`` set (the caller was interrupted): no more processes start, and those running are killed at once.
    """
    ctx: Any = torch.multiprocessing.get_context(start_method)  # spawn or forkserver: both make Processes
    results = ctx.Queue()
    store = None
    if host_store:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    else:
        store = listening_store("127.0.0.1", 0, None, store_timeout(timeout_s))
        port = store.port
    spec = GroupSpec(name, 0, size, "127.0.0.1", port, backend=backend, timeout_s=timeout_s, host_store=host_store)
    procs = [
        ctx.Process(target=_local_worker, args=(r, spec, fn, args, threads, results), daemon=True) for r in range(size)
    ]
    out = [LocalRankResult(r) for r in range(size)]
    deadline, pending = time.monotonic() + deadline_s, set(range(size))
    try:
        for p in procs:
            if stop is not None and stop.is_set():
                break
            p.start()
        while pending and time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            try:
                rank, value, error = results.get(timeout=0.2)
            except queue.Empty:  # a dead process has flushed whatever it sent
                dead = {r for r in pending if not procs[r].is_alive()}
                if dead and on_death is not None:
                    on_death()
                    on_death = None
                pending -= dead
                continue
            out[rank].value, out[rank].error = value, error
            pending.discard(rank)
    finally:
        for p in procs:
            if p.pid is not None:
                stopped = stop is not None and stop.is_set()
                p.join(timeout=0.0 if stopped else max(0.0, min(10.0, deadline - time.monotonic())))
                if p.is_alive():
                    p.kill()
                    p.join()
        results.close()
        del store
    for r, p in enumerate(procs):
        out[r].exitcode = p.exitcode
    return out
