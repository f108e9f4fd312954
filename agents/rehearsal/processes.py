"""The rehearsal's local fleet: one ``geosched agent`` process per rank, and the WAN emulator's relays.

:class:`AgentProcesses` starts every rank's agent in its own process group
(one torch thread) and, whatever happens, stops them: SIGTERM to the group,
SIGKILL after a grace period, and waits. :class:`RelayRoutes` is the
coordinator's ``before_start`` hook that starts one WAN emulator relay per
link that crosses DCs (pipeline links, and the gradient links of data parallelism across DCs) once the
agents are ready (bandwidths scaled by
``wan_scale``, delays kept; ``reset_every_s``: every connection reset that
often, a fault the links must survive) and routes the ranks through them.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geosched.errors import GeoschedError
from geosched.processes import REPO_ROOT, child_env, die_with_parent_env

if TYPE_CHECKING:
    from agents.layout import JobLayout


AGENT_PROCESS_BYTES = 300 * 2**20
"""What one agent process holds besides its stage (Python, torch, its links' buffers): the demo's agents hold
230-390 MiB each (RSS; about 305 MiB of it their own, PSS)."""
HOST_SHARE = 0.8
"""Of the host's available memory, what the agents may take: the rest is the launcher's, the broker's, the relays'
and the system's."""


def fleet_memory_refusal(layout: JobLayout, device: str, available: int | None) -> str | None:
    """Why this host cannot hold every rank of ``layout`` as a process, as launch runs them (and its calibration
    before them): their stages' memory as the planner predicts it (on this host's memory when ``device`` is the
    CPU) and :data:`AGENT_PROCESS_BYTES` each, against ``available`` bytes; None when it fits or is unknown."""
    if available is None:
        return None
    from agents.stage.schedule import predicted_stage_bytes

    stages = 0
    if device == "cpu":
        groups: dict[tuple[int, str], list[Any]] = {}
        for role in layout.roles:
            groups.setdefault((role.stage, role.dc), []).append(role)
        stages = sum(predicted_stage_bytes(layout, roles[0]) * len(roles) for roles in groups.values())
    ranks = len(layout.roles)
    need = stages + ranks * AGENT_PROCESS_BYTES
    if need <= HOST_SHARE * available:
        return None
    what = "their stages' weights, optimizer state and activations, and " if stages else ""
    return (
        f"launch runs each of its {ranks} ranks as a process on this host: about {need / 2**30:,.1f} GiB ({what}"
        f"{AGENT_PROCESS_BYTES >> 20} MiB a process), more than {HOST_SHARE:.0%} of the {available / 2**30:,.1f} GiB "
        "this host has available; "
        "rehearse a smaller config (e.g. configs/demo-3dc.yaml), or run the plan's agents on its hosts "
        "(docs/multi-host.md)"
    )


class AgentProcesses:
    """One ``geosched agent`` subprocess per rank, each in its own process group; a context manager."""

    def __init__(self, layout: JobLayout, url: str, job: str, run_dir: Path, extra_args: list[str] | None = None):
        self.layout, self.url, self.job, self.run_dir = layout, url, job, run_dir
        self.extra_args = list(extra_args or [])
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self) -> AgentProcesses:
        """Spawn every rank's agent; logs go to ``agent<R>.log`` in the run folder, each start (an elastic
        recovery's agents append to the same file) opened by a line naming the plan, DC and time."""
        from agents.layout import plan_id

        plan = plan_id(self.layout.text)
        env = child_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **die_with_parent_env())
        for role in self.layout.roles:
            cmd = [
                sys.executable,
                "-m",
                "geosched.cli",
                "agent",
                "--mqtt",
                self.url,
                "--job",
                self.job,
                "--rank",
                str(role.rank),
                f"--dc={role.dc}",  # one argument: a DC named "-us" is not a flag
                "--threads",
                "1",
                "--run-dir",
                str(self.run_dir.resolve()),  # the agents run in the repository root
                *self.extra_args,
            ]
            with open(self.run_dir / f"agent{role.rank}.log", "ab") as logfile:
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
                logfile.write(f"--- {started}: agent rank {role.rank} (dc {role.dc}) of plan {plan} ---\n".encode())
                logfile.flush()
                self.procs[role.rank] = subprocess.Popen(
                    cmd, stdout=logfile, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=REPO_ROOT
                )
        return self

    def wait(self, timeout_s: float) -> dict[int, int | None]:
        """Wait up to ``timeout_s`` for every agent to exit; rank -> exit code (None: still running)."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return {rank: proc.poll() for rank, proc in self.procs.items()}

    def exited(self) -> dict[int, int]:
        """The agents that have exited, rank -> exit code (negative: killed by that signal); a child that exited
        is a fact the coordinator acts on whatever the broker delivered (``start_job(exits=...)``)."""
        codes = {rank: proc.poll() for rank, proc in self.procs.items()}
        return {rank: code for rank, code in codes.items() if code is not None}

    def stop(self, grace_s: float = 10.0) -> dict[int, int | None]:
        """SIGTERM every process group, SIGKILL what is left after ``grace_s``, and reap them all; the exit codes
        before that SIGKILL (None: still running then), so a -SIGKILL among them was someone else's."""
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
            if _frozen(proc.pid):  # stopped (SIGSTOP, a debugger): it would not see SIGTERM until the grace ends
                _signal_group(proc, signal.SIGKILL)
        codes = self.wait(grace_s)
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGKILL)  # also reaps grandchildren left in the group
            proc.wait()
        return codes

    def __enter__(self) -> AgentProcesses:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _frozen(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T or t in /proc; False where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


class RelayRoutes:
    """Starts the WAN emulator once the agents are ready: one relay per link that crosses DCs (the relays of
    one DC pair share its capacity)."""

    def __init__(self, layout: JobLayout, wan_scale: float, reset_every_s: float | None = None) -> None:
        self.layout, self.wan_scale, self.reset_every_s = layout, wan_scale, reset_every_s
        self.emulator: Any = None
        self.route_links: dict[str, tuple[str, str]] = {}

    async def __call__(self, statuses: dict[int, Any]) -> dict[str, str]:
        """The ``before_start`` hook of the coordinator: relays to the listeners' bound endpoints."""
        from agents.layout import wan_listeners
        from agents.wanem.emulator import WanEmulator, shape_for_link
        from geosched.endpoint import tcp_address, tcp_endpoint

        routes, ends = {}, {}
        for rank, name, client_dc, dc in wan_listeners(self.layout):  # pipeline and cross-DC gradient links
            bound = statuses[rank].extra.get("endpoints", {}).get(name)
            if not bound:
                raise GeoschedError(f"rank {rank} is ready but did not publish its endpoint {name!r}")
            link = self.layout.config.cluster.link(client_dc, dc)
            routes[name] = (tcp_address(bound), shape_for_link(link, self.wan_scale))
            ends[name] = (client_dc, dc)
        self.route_links = ends
        # a relay's target down is an agent lost: the launch says so itself, its relays at INFO only
        self.emulator = WanEmulator(
            routes, link_ends=ends, reset_every_s=self.reset_every_s, outage_level=logging.INFO
        ).start()
        return {name: tcp_endpoint(*self.emulator.address(name)) for name in routes}

    def wan_bytes(self) -> dict[str, int]:
        """Bytes the relays carried per link direction, e.g. ``{"us->eu": n, "eu->us": m}``."""
        if self.emulator is None:
            return {}
        out: dict[str, int] = {}
        for name, stats in self.emulator.stats().items():
            a, b = self.route_links[name]
            out[f"{a}->{b}"] = out.get(f"{a}->{b}", 0) + int(stats["bytes_to_target"])
            out[f"{b}->{a}"] = out.get(f"{b}->{a}", 0) + int(stats["bytes_to_client"])
        return out

    def adopt(self, layout: JobLayout) -> None:
        """Route a new plan's links (elastic recovery): the relays of the old one close."""
        self.close()
        self.layout, self.emulator, self.route_links = layout, None, {}

    def close(self) -> None:
        """Close every relay."""
        if self.emulator is not None:
            self.emulator.close()
