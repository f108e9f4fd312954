"""Planning steps for several variants at once: in forked processes where the planner may fork, else threads.

Variants are independent (each its own problem and evaluator), so their searches can run side by side. Threads
overlap little: CP-SAT releases the GIL, but the proposals, bounds and simulations (most of a screening search)
do not; on 2 cores, four threads screened a 175B job's variants 1.1x faster than one, where two processes
run 1.9x. So :func:`in_parallel` forks a child per item but the last, which it runs itself (at most
:data:`WORKERS` children at once), when asked to and when it is safe: a POSIX system, two CPUs or more and a
process with one thread (a fork copies only the calling thread, so a lock another thread held would stay
locked in the child). ``geosched plan`` run as a command asks; library callers (the launcher, the tests) keep
threads unless they ask too.

A child sends its result back as JSON through a pipe (the caller's ``codec``; the house rule: nothing unpickles)
and leaves with ``os._exit``, which runs no exit handlers and flushes none of the parent's buffers. A child that
fails or dies leaves its item to the parent, which runs it in-process: the results never depend on forking,
only the time does. This module is hand-written because ``multiprocessing`` pickles every result.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
S = TypeVar("S")

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
"""The CPUs this process may use: with one, nothing runs side by side."""
THREADS = min(4, CPUS)
"""Items run at once on threads; no result depends on it."""
WORKERS = 4
"""Forked children running at once: a screening batch whole (``planner.variants.SCREEN_BATCH``). On 2 cores
four children share them, which evens out a batch's searches of unequal length (a 175B fuzz cluster: 10.5 s
with two at a time, 10.1 s with four); no result depends on it."""
READ_BYTES = 1 << 20


@dataclass(frozen=True)
class Codec(Generic[R]):
    """How a result crosses from a forked child to its parent: ``encode`` to JSON values, ``decode`` back."""

    encode: Callable[[R], Any]
    decode: Callable[[Any], R]


def optional(codec: Codec[R]) -> Codec[R | None]:
    """``codec`` for a result that may be None."""
    return Codec(
        lambda r: None if r is None else codec.encode(r),
        lambda data: None if data is None else codec.decode(data),
    )


def pair(first: Codec[R], second: Codec[S]) -> Codec[tuple[R, S]]:
    """A codec for a result made of two parts, each with its own codec."""
    return Codec(
        lambda r: [first.encode(r[0]), second.encode(r[1])],
        lambda data: (first.decode(data[0]), second.decode(data[1])),
    )


def can_fork() -> bool:
    """True when this process may fork its work: a POSIX system and one thread alive."""
    return hasattr(os, "fork") and threading.active_count() == 1


def in_parallel(
    work: Callable[[T], R], items: Sequence[T], codec: Codec[R] | None = None, fork: bool = False
) -> list[R]:
    """``[work(item) for item in items]``, side by side. Each item must own its state, so the results are the
    same as in order. With ``fork`` and a ``codec``, in forked children where :func:`can_fork`; else on up to
    :data:`THREADS` threads."""
    if len(items) < 2:
        return [work(item) for item in items]
    if fork and codec is not None and CPUS >= 2 and can_fork():
        return _forked(work, items, codec)
    if THREADS < 2:
        return [work(item) for item in items]
    with ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="planner") as pool:
        return list(pool.map(work, items))


def _forked(work: Callable[[T], R], items: Sequence[T], codec: Codec[R]) -> list[R]:
    """:func:`in_parallel` in forked children, at most :data:`WORKERS` at once; the last item in this process,
    which would otherwise only wait (its caches warm, its result needs no decoding)."""
    results: dict[int, R] = {}
    failed: list[int] = []
    own: int | None = len(items) - 1
    waiting = list(range(len(items) - 1))
    running: dict[int, tuple[int, bytearray]] = {}  # pipe's read end -> (item, bytes so far)
    children: dict[int, int] = {}  # item -> pid
    selector = selectors.DefaultSelector()
    try:
        while waiting or running or own is not None:
            while waiting and len(running) < WORKERS:
                k = waiting.pop(0)
                fd, children[k] = _spawn(work, items[k], codec)
                running[fd] = (k, bytearray())
                selector.register(fd, selectors.EVENT_READ)
            if own is not None:
                results[own], own = work(items[own]), None
                continue
            for key, _ in selector.select():
                fd = int(key.fd)
                k, data = running[fd]
                chunk = os.read(fd, READ_BYTES)
                if chunk:
                    data += chunk
                    continue
                selector.unregister(fd)
                os.close(fd)
                del running[fd]
                _, status = os.waitpid(children.pop(k), 0)
                if status != 0 or not data:
                    failed.append(k)
                    continue
                results[k] = codec.decode(json.loads(data))
    finally:
        for fd in running:
            selector.unregister(fd)
            os.close(fd)
        for pid in children.values():  # only after an error in the parent: stop what it no longer waits for
            _stop(pid)
        selector.close()
    for k in failed:  # the same result, in-process
        log.debug("forked planner child for item %d failed; running it in-process", k)
        results[k] = work(items[k])
    return [results[k] for k in range(len(items))]


def _spawn(work: Callable[[T], R], item: T, codec: Codec[R]) -> tuple[int, int]:
    """Fork a child that runs ``work(item)`` and writes its encoded result to a pipe: (read end, pid)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        return read, pid
    code = 1  # the child: never returns
    try:
        os.close(read)
        data = json.dumps(codec.encode(work(item)), separators=(",", ":")).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(write, view) :]
        code = 0
    finally:
        os._exit(code)


def _stop(pid: int) -> None:
    try:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
