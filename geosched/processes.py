"""Child processes of this checkout: the environment they start with and the CPUs they run on.

Rehearsals, calibration and benchmarks start ``python -m ...`` children that
must import this checkout's packages whether or not it is installed, and pin
them one per core so that co-located ranks do not share one.
Pinning is a no-op where the platform has no CPU affinity (macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import signal
import sys
from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parents[1])
"""The checkout holding geosched/, planner/ and agents/."""


def exit_words(code: int) -> str:
    """How a child process ended, from its exit code (negative: the signal that killed it), in words."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH, plus ``extra`` variables."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": REPO_ROOT if not path else REPO_ROOT + os.pathsep + path, **extra}


PARENT_ENV = "GEOSCHED_DIE_WITH_PARENT"
"""Set (to the parent's pid) in a child that must not outlive the process that started it."""


def die_with_parent_env() -> dict[str, str]:
    """The variable that makes a child call :func:`die_with_parent` about this process (merge it into its env)."""
    return {PARENT_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """In a child started with :func:`die_with_parent_env`: be sent SIGTERM when its parent dies, even by SIGKILL
    (Linux ``PR_SET_PDEATHSIG``), so a killed ``geosched launch`` leaves no agents holding ports; a no-op
    elsewhere. The signal comes when the parent's *thread* that started the child ends: start such children
    from a thread that lives as long as they should."""
    parent = os.environ.pop(PARENT_ENV, None)  # not inherited by this child's own children
    if parent is None or not parent.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # no prctl: the parent's own cleanup must do
        return
    if os.getppid() != int(parent):  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


PR_SET_PDEATHSIG = 1


def raise_open_files_limit(most: int = 65536) -> int:
    """Raise this process's soft limit on open descriptors to its hard limit (at most ``most``), as servers
    do: every peer connection holds one, and a shell's default of 1,024 runs out first. The new soft limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = most if hard == resource.RLIM_INFINITY else min(hard, most)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            return wanted
        except (ValueError, OSError):
            pass
    return soft


def release_freed_memory() -> None:
    """Collect unreachable cycles, then hand what the C allocator holds free back to the system (glibc's
    ``malloc_trim``; elsewhere only the collection). After a flood of a stranger's connections an agent kept
    +250 MB (asyncio's 256 KiB TLS buffer of each, freed inside glibc's heap); this gave it back. A full
    collection holds the GIL for a while (80-90 ms in an agent with a small model): call it rarely."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None or not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return
    trim(0)


def available_memory_bytes() -> int | None:
    """This host's memory available to new processes (Linux's MemAvailable); None where it is not known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, in order; empty where the platform cannot say."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def pin_to_cpu(cpu: int | None) -> None:
    """Run this process on ``cpu`` only; None leaves it where it is."""
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def unpin() -> None:
    """Let this process run on every CPU of the machine, whatever its parent was pinned to."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
