"""``geosched launch``: rehearse a whole job on one machine with real processes, broker and WAN emulation.

Steps: plan the config (or take ``--plan``), start the embedded MQTT broker
(unless ``--mqtt``), spawn one ``geosched agent`` process per rank (each in
its own process group, one torch thread), run the coordinator; when every
agent is ready, start a WAN emulator relay for every pipeline link that
crosses datacenters (bandwidths scaled by ``wan_scale``, delays kept; the
pipelines of one link share its capacity) and tell the ranks to connect
through them (``routes`` in the ``start`` command); train; stop the agents;
write the run folder (:mod:`agents.rehearsal.report`).

Secure by default: a fresh key folder (:mod:`agents.keys`) goes into
``RUN_DIR/secrets/`` (prefill token in ``RUN_DIR/secrets/prefill.token``);
the embedded broker requires a login per identity (``agent-<r>``,
``coordinator``), the agents run with ``--keys`` (signed control messages,
CURVE on every pipeline link and prefill endpoint, prefill token), the
coordinator signs as ``coordinator`` and the prefill load sends the token
over CURVE. ``insecure=True`` turns all of it off.

Whatever happens (Ctrl-C, a failed agent, an exception), every child is
stopped: SIGTERM to its process group, then SIGKILL after a grace period,
and waited for; the relays and the broker are closed.

Example::

    report = launch("configs/demo-3dc.yaml", steps=3, run_dir="runs/demo")
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from geosched.errors import GeoschedError, PlanError
from geosched.processes import REPO_ROOT, child_env

if TYPE_CHECKING:
    from agents.keys import JobKeys
    from agents.layout import JobLayout
    from geosched.config import Config

log = logging.getLogger(__name__)

DEFAULT_WAN_SCALE = 0.05
"""Multiplies WAN bandwidths: the demo's 0.2 Gb/s links become 10 Mb/s relays (delays are kept).
"""


def rehearsal_cluster(config: Config, wan_scale: float, cpu_tflops: float | None = None) -> Config:
    """The cluster as rehearsed here: WAN bandwidths x ``wan_scale`` (what the relays emulate) and,
    when ``cpu_tflops`` is given, every DC's GPU replaced by this machine's measured core."""
    links = tuple(
        dataclasses.replace(
            lk, bandwidth_gbps=lk.bandwidth_gbps * wan_scale, per_connection_gbps=lk.per_connection_gbps * wan_scale
        )
        for lk in config.cluster.links
    )
    dcs = config.cluster.datacenters
    if cpu_tflops is not None:
        dcs = tuple(dataclasses.replace(dc, gpu=dataclasses.replace(dc.gpu, tflops=cpu_tflops)) for dc in dcs)
    return dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, links=links, datacenters=dcs))


def calibrate(layout: JobLayout, wan_scale: float = 1.0) -> Any:
    """A quick calibration of the plan on one thread, as its agents run it together on this host.

    The plan's stages whole, its WAN streams and the emulator's share
    (:func:`agents.rehearsal.calibrate.plan_options`).
    """
    import torch

    from agents.rehearsal.calibrate import calibrate as measure
    from agents.rehearsal.calibrate import plan_options
    from geosched.costmodel import Calibration

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every agent runs
    try:
        copies = max(1, min(len(layout.roles), os.cpu_count() or 1))
        data = measure(layout.job, repeats=3, warmup=1, co_located=copies, **plan_options(layout, wan_scale))
    finally:
        torch.set_num_threads(threads)
    return Calibration.from_dict(data)


def predict(layout: JobLayout, wan_scale: float = 1.0, calibration: Any = None) -> Any:
    """The simulator's Timeline for ``layout`` as rehearsed: WAN scaled, compute from ``calibration`` if given."""
    from agents.stage.session import job_schedule
    from geosched.costmodel import PipelineCosts
    from geosched.schedule import simulate

    config = rehearsal_cluster(layout.config, wan_scale, calibration.tflops if calibration is not None else None)
    across: dict[str, Any] = {}
    if layout.extra_pipelines:  # pipelines in several DCs share links and sync gradients across DCs
        from planner.replicas import cost_options
        from planner.space import Candidate, Problem

        m = layout.job.global_batch // (layout.replicas * layout.job.batch)
        cand = Candidate(layout.dp, m, layout.stage_dcs, layout.stage_layers, layout.extra_pipelines)
        across = cost_options(Problem(dataclasses.replace(config, job=layout.job)), cand)
    costs = PipelineCosts(
        config.cluster,
        layout.job,
        layout.stage_dcs,
        layout.stage_layers,
        layout.dp,
        layout.streams,
        calibration=calibration,
        **across,
    )
    return simulate(job_schedule(layout.job, layout.num_stages, layout.replicas), costs)


def striped_chunk_bytes(layout: JobLayout, floor: int = 4096) -> int:
    """WAN chunk size that stripes one activation over all of its link's streams.

    WanLink's own choice (>= 64 KiB) sends a small activation as one chunk on one
    TCP stream, which a long link's per-connection window then throttles.
    """
    from geosched.costmodel import boundary_bytes

    sizes = [
        boundary_bytes(layout.job, layout.stage_layers[s - 1][1])
        // max(1, layout.streams.get((min(a, b), max(a, b)), 1))  # keyed by the sorted DC pair
        for s, a, b in layout.wan_boundaries()
    ]
    return max(floor, min(sizes)) if sizes else 0


class AgentProcesses:
    """One ``geosched agent`` subprocess per rank, each in its own process group; a context manager."""

    def __init__(self, layout: JobLayout, url: str, job: str, run_dir: Path, extra_args: list[str] | None = None):
        self.layout, self.url, self.job, self.run_dir = layout, url, job, run_dir
        self.extra_args = list(extra_args or [])
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self) -> AgentProcesses:
        """Spawn every rank's agent; logs go to ``agent<R>.log`` in the run folder."""
        env = child_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
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
                "--dc",
                role.dc,
                "--threads",
                "1",
                "--run-dir",
                str(self.run_dir),
                *self.extra_args,
            ]
            with open(self.run_dir / f"agent{role.rank}.log", "ab") as logfile:
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

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process group, SIGKILL what is left after ``grace_s``, and reap them all."""
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
        self.wait(grace_s)
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGKILL)  # also reaps grandchildren left in the group
            proc.wait()

    def __enter__(self) -> AgentProcesses:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


class RelayRoutes:
    """Starts the WAN emulator once the agents are ready: one relay per cross-DC pipeline link."""

    def __init__(self, layout: JobLayout, wan_scale: float) -> None:
        self.layout, self.wan_scale = layout, wan_scale
        self.emulator: Any = None
        self.route_links: dict[str, tuple[str, str]] = {}

    async def __call__(self, statuses: dict[int, Any]) -> dict[str, str]:
        """The ``before_start`` hook of the coordinator: relays to the listeners' bound endpoints."""
        from agents.layout import pipe_name
        from agents.wanem.emulator import WanEmulator, shape_for_link

        routes, ends = {}, {}
        for role in self.layout.roles:
            if role.prev_dc is None or role.prev_dc == role.dc:  # the first stage, or a link inside a DC
                continue
            name = pipe_name(role.stage, role.replica, role.tp_rank)
            bound = statuses[role.rank].extra.get("endpoints", {}).get(name)
            if not bound:
                raise GeoschedError(f"rank {role.rank} is ready but did not publish its endpoint {name!r}")
            host, port = bound.removeprefix("tcp://").rsplit(":", 1)
            link = self.layout.config.cluster.link(role.prev_dc, role.dc)
            routes[name] = ((host, int(port)), shape_for_link(link, self.wan_scale))
            ends[name] = (role.prev_dc, role.dc)
        self.route_links = ends
        self.emulator = WanEmulator(routes, link_ends=ends).start()
        return {name: "tcp://{}:{}".format(*self.emulator.address(name)) for name in routes}

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

    def close(self) -> None:
        """Close every relay."""
        if self.emulator is not None:
            self.emulator.close()


def launch(
    config_path: str,
    *,
    plan_path: str | None = None,
    steps: int | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    mqtt: str | None = None,
    job: str = "launch",
    wan_scale: float = DEFAULT_WAN_SCALE,
    ready_timeout_s: float = 120.0,
    out: TextIO | None = sys.stdout,
    agent_args: list[str] | None = None,
    calibration: Any = "measure",
    prefill_rate: float = 0.0,
    insecure: bool = False,
) -> dict[str, Any]:
    """Run the rehearsal; return the report (also written to ``run_dir/report.json``).

    ``prefill_rate`` > 0: every agent serves prefill (``--prefill-bind``) and a
    Poisson stream of that many requests per second runs while training
    (:mod:`agents.rehearsal.prompt_load`); the report gets a ``prefill`` section.

    ``calibration``: a :class:`~geosched.costmodel.Calibration` for the
    prediction, ``"measure"`` (profile the model here first) or None (the
    config's GPU FLOP rates).

    ``insecure``: no key folder, no broker logins, unsigned commands, plain
    TCP links and an open prefill endpoint (one warning line on ``out``).
    """
    from agents.control.broker import EmbeddedBroker
    from agents.control.commands import stop_job
    from agents.control.coordinator import start_job
    from agents.layout import load_plan_file, parse_layout, plan_for_config, runtime_refusal
    from agents.rehearsal.report import build_report, load_rank_reports, report_text, write_run_folder
    from geosched.config import load_config

    config = load_config(config_path)
    text = load_plan_file(plan_path) if plan_path else plan_for_config(config)
    layout = parse_layout(text, plan_path or "plan")
    refusal = runtime_refusal(layout)
    if refusal is not None:
        raise PlanError(f"{plan_path or 'plan'}: {refusal}")
    steps = steps or layout.job.steps
    run = Path(run_dir or Path("runs") / time.strftime("launch-%Y%m%d-%H%M%S"))
    run.mkdir(parents=True, exist_ok=True)
    for old in [*run.glob("rank*.jsonl"), *run.glob("prefill-rank*.json")]:
        old.unlink()
    (run / "plan.yaml").write_text(text)
    if calibration == "measure":
        calibration = calibrate(layout, wan_scale)
    predicted = predict(layout, wan_scale, calibration)
    relays = RelayRoutes(layout, wan_scale)
    keys = None if insecure else job_keys(run / "secrets", len(layout.roles))
    if insecure and out is not None:
        print(INSECURE_WARNING, file=out, flush=True)
    broker = None
    with ExitStack() as stack:
        stack.callback(relays.close)
        if mqtt is None:
            broker = EmbeddedBroker(**broker_security(keys, job))
            broker.start()
            stack.callback(broker.stop)
            mqtt = broker.url
        chunk_args = ["--wan-chunk-bytes", str(striped_chunk_bytes(layout))]
        if keys is not None:
            chunk_args += ["--keys", str(keys.directory.resolve())]  # the agents run in the repository root
        load = None
        if prefill_rate > 0:
            from agents.rehearsal.prompt_load import PrefillLoad

            chunk_args += ["--prefill-bind", "tcp://127.0.0.1:0"]
            load = PrefillLoad(prefill_rate, seed=layout.job.seed, keys=keys)
            stack.callback(load.stop, 0.0)  # on errors: stop at once (a no-op once stopped)
        agents = stack.enter_context(AgentProcesses(layout, mqtt, job, run, chunk_args + list(agent_args or [])))
        if out is not None:
            secured = "insecure" if keys is None else f"secure, keys in {keys.directory}"
            print(
                f"launch: {len(layout.roles)} agents, {layout.num_stages} stages over "
                f"{' -> '.join(layout.stage_dcs)}, dp {layout.dp}"
                + "".join(f" + {' -> '.join(dict.fromkeys(path))}" for path in layout.extra_pipelines)
                + f", broker {mqtt}, run folder {run} ({secured})",
                file=out,
                flush=True,
            )
        coordinator_url, control = coordinator_login(mqtt, keys)
        started = time.monotonic()
        asyncio.run(
            start_job(
                coordinator_url,
                job,
                text,
                steps=steps,
                ready_timeout_s=ready_timeout_s,
                before_start=relays if load is None else _with_load(relays, load),
                out=out,
                **control,
            )
        )
        wall_s = time.monotonic() - started
        if load is not None:
            load.stop()  # every outstanding request is answered (or expires) before the agents stop
        asyncio.run(stop_job(coordinator_url, job, **control))
        codes = agents.wait(20.0)
        refusals = dict(broker.refusals) if broker is not None else None
        wan = relays.wan_bytes()
    reports = load_rank_reports(run)
    report = build_report(
        layout,
        reports,
        predicted_iteration_s=predicted.iteration_s,
        predicted_bubble_fraction=predicted.bubble_fraction,
        wan_bytes=wan,
        extra={
            "wan_scale": wan_scale,
            "wall_s": wall_s,
            "agent_exit_codes": codes,
            "calibrated": calibration is not None,
            "predicted_unscaled_iteration_s": layout.predicted_iteration_s,
            "secure": keys is not None,
            "broker_refusals": refusals,  # the embedded broker's refusals by kind (None: an outside broker)
        },
    )
    if load is not None:
        from agents.rehearsal.prompt_load import prefill_section

        report["prefill"] = prefill_section(load, run)
    write_run_folder(run, layout, reports, report, predicted_timeline=predicted)
    if out is not None:
        print(report_text(report), file=out)
        if load is not None:
            from agents.rehearsal.prompt_load import prefill_text

            print(prefill_text(report["prefill"]), file=out)
        print(f"run folder: {run}", file=out, flush=True)
    return report


INSECURE_WARNING = (
    "launch: WARNING --insecure: no broker logins, unsigned commands, plain-TCP WAN links and an open "
    "prefill endpoint; anyone who can reach these ports can read or steer the job"
)


def job_keys(folder: Path, ranks: int) -> JobKeys:
    """A fresh key folder for ``ranks`` agents (replacing any earlier one), loaded."""
    from agents.keys import load_job_keys, write_job_keys

    write_job_keys(folder, ranks, force=True)
    return load_job_keys(folder)


def broker_security(keys: JobKeys | None, job: str) -> dict[str, Any]:
    """The embedded broker's logins (one per identity) and ACLs, as keyword arguments; none when insecure."""
    if keys is None:
        return {"allow_anonymous": True}  # the embedded broker runs open only when told so
    from agents.control.broker_policy import JobAcl

    return {"users": keys.mqtt_users(), "acl": JobAcl(job)}


def coordinator_login(url: str, keys: JobKeys | None) -> tuple[str, dict[str, Any]]:
    """The broker URL with the coordinator's login, and the signing arguments of the coordinator's calls."""
    if keys is None:
        return url, {}
    from urllib.parse import quote

    scheme, rest = url.split("://", 1)
    if "@" not in rest:
        url = f"{scheme}://coordinator:{quote(keys.mqtt_password('coordinator'), safe='')}@{rest}"
    from agents.control.auth import ControlKeys

    return url, {"keys": ControlKeys(*keys.control_fields("coordinator"))}


def _with_load(relays: RelayRoutes, load: Any) -> Any:
    """A ``before_start`` hook: start the prefill load on the agents' published endpoints, then the relays."""
    from agents.layout import prefill_name

    async def hook(statuses: dict[int, Any]) -> dict[str, str]:
        endpoints = {rank: st.extra.get("endpoints", {}).get(prefill_name(rank)) for rank, st in statuses.items()}
        missing = sorted(rank for rank, ep in endpoints.items() if not ep)
        if missing:
            raise GeoschedError(f"ranks {missing} are ready but did not publish a prefill endpoint")
        load.start(endpoints)
        return await relays(statuses)

    return hook
