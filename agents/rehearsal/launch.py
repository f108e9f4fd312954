"""``geosched launch``: rehearse a whole job on one machine with real processes, broker and WAN emulation.

Steps: plan the config (or take ``--plan``), start the embedded MQTT broker
(unless ``--mqtt``), spawn one ``geosched agent`` process per rank (each in
its own process group, one torch thread), run the coordinator; when every
agent is ready, start a WAN emulator relay for every pipeline link that
crosses datacenters (bandwidths scaled by ``wan_scale``, delays kept; the
pipelines of one link share its capacity) and tell the ranks to connect
through them (``routes`` in the ``start`` command); train; stop the agents;
write the run folder (:mod:`agents.runfolder`): ``endpoints.json`` as soon as
every agent is ready, the report and the pictures at the end. With
``checkpoint_dir`` every agent checkpoints there (``--checkpoint-dir``,
``--checkpoint-every``); with ``resume`` too, the agents first load its newest
complete checkpoint, resharded into this plan's layout whatever layout wrote
it, and the job trains from that step to ``steps``.

Secure by default: a fresh key folder (:mod:`agents.keys`) goes into
``RUN_DIR/secrets/`` (prefill token in ``RUN_DIR/secrets/prefill.token``);
the embedded broker requires a login per identity (``agent-<r>``,
``coordinator``), the agents run with ``--keys`` (signed control messages,
CURVE on every pipeline link and prefill endpoint, prefill token), the
coordinator signs as ``coordinator`` and the prefill load sends the token
over CURVE; the HTTP endpoints (``prefill_http``, ``metrics``) speak TLS with
a certificate made for the run (:mod:`agents.tls.selfsigned`:
``RUN_DIR/secrets/tls.crt``, clients trust ``RUN_DIR/secrets/tls-ca.crt``),
each prefill URL checked over TLS before training starts. ``insecure=True``
turns all of it off.

Whatever happens (Ctrl-C, a failed agent, an exception), every child is
stopped: SIGTERM to its process group, then SIGKILL after a grace period,
and waited for; the relays and the broker are closed.

Example::

    report = launch("configs/demo-3dc.yaml", steps=3, run_dir="runs/demo")
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from agents.rehearsal.elastic import describe
from agents.rehearsal.hooks import with_http_urls, with_load, with_metrics_urls
from agents.rehearsal.processes import AgentProcesses, RelayRoutes, fleet_memory_refusal
from agents.runfolder.claim import clear_previous_run, new_run_dir
from agents.runfolder.predict import predict, replay, sync_seconds, with_stages_timed_in_place
from agents.tls.context import server_context
from agents.tls.selfsigned import TlsFiles, write_rehearsal_tls
from geosched.errors import InputError, PlanError
from geosched.lr_schedule import decay_mismatch
from geosched.processes import available_memory_bytes

ELASTIC_KEEP = 3
"""Complete checkpoints an elastic launch keeps in its run folder (it writes one every step: 2.4 GB in 600 demo
steps when none was deleted)."""

if TYPE_CHECKING:
    from agents.keys import JobKeys
    from agents.layout import JobLayout

log = logging.getLogger(__name__)

STOPPED_LINGER_S = 1.0
"""After a 'job stop' ended the run and its agents exited, the broker stays up this long, so the stop's own client
(another shell's) gets their last statuses, its acknowledgements (it was cut off first in a trial: 'unconfirmed')."""
DEFAULT_WAN_SCALE = 0.05
"""Multiplies WAN bandwidths: the demo's 0.2 Gb/s links become 10 Mb/s relays (delays are kept)."""


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
    calibration_file: str | None = None,
    prefill_rate: float = 0.0,
    insecure: bool = False,
    prefill_http: bool = False,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 0,
    checkpoint_keep: int | None = None,
    metrics: bool = False,
    elastic: bool = False,
    wan_reset_every_s: float | None = None,
    prefill_follow_checkpoints: bool = False,
    elastic_return_after_s: float | None = None,
    device: str = "cpu",
    resume: bool = False,
) -> dict[str, Any]:
    """Run the rehearsal; return the report (also written to ``run_dir/report.json``; a run that does not finish
    writes what it did, with its ``outcome``: :func:`agents.runfolder.report.write_unfinished_report`).

    ``prefill_rate`` > 0: every agent serves prefill (``--prefill-bind``) and a
    Poisson stream of that many requests per second runs while training
    (:mod:`agents.rehearsal.prompt_load`); the report gets a ``prefill`` section.

    ``calibration``: a :class:`~geosched.costmodel.Calibration` for the
    prediction, ``"measure"`` (profile the model here first) or None (the
    config's GPU FLOP rates). ``calibration_file``: the file a given calibration was read from, copied into the
    run folder as ``calibration.json`` (which may be that file: a reused folder's, read before it is cleared).

    ``insecure``: no key folder, broker logins, signatures, encryption or prefill token (one warning line).

    ``prefill_http``: every agent serves prefill (as with ``prefill_rate``) and also answers OpenAI-style HTTP
    (:mod:`agents.prefill.http`); the URLs are printed and recorded as the report's ``prefill_http``.

    ``checkpoint_dir``: every agent writes its checkpoints there (every
    ``checkpoint_every`` steps if > 0, on ``geosched job checkpoint``, and the final state once the steps are
    done: a rehearsal has nobody to ask for it). ``resume``: the job starts
    from the newest complete checkpoint there (any layout of the same model, resharded) and trains to step
    ``steps``; InputError when there is none, it holds another model, or it already covers ``steps``.

    ``metrics``: every agent (``--metrics-bind 127.0.0.1:0``) and the coordinator serve Prometheus ``/metrics``
    and ``/health`` (:mod:`agents.metrics`); the URLs are printed and recorded as the report's ``metrics``.

    ``elastic``: survive lost agents or a lost DC (:mod:`agents.rehearsal.elastic`): re-plan on the GPUs
    left, resume from the newest complete checkpoint (``RUN_DIR/checkpoints`` every step unless
    ``checkpoint_dir`` is given), finish the steps; the report lists ``recoveries``. The rank files of a
    failed attempt move to ``RUN_DIR/attempt-<n>/``. ``elastic_return_after_s``: the lost GPUs return that long
    after each recovery and the job moves back to the original plan at the next checkpoint (one more entry
    of ``recoveries``, with no lost ranks).

    ``wan_reset_every_s``: fault injection; every WAN relay resets all of its connections that often.

    ``prefill_follow_checkpoints``: every agent serves prefill and swaps in each newer checkpoint of the
    checkpoint folder as it completes (``--prefill-follow-checkpoints``); needs ``checkpoint_dir`` or ``elastic``.

    ``device``: what the agents train on (``--device``: ``cpu``, ``cuda`` for GPU rank % GPUs, ``cuda:N``),
    and what the calibration measures on; a plan whose groups would put two ranks on one GPU is refused
    (:func:`agents.stage.device.host_refusal`).
    """
    from agents.checkpoint.export import resume_step
    from agents.control.broker import EmbeddedBroker
    from agents.control.commands import checkpoint_job, stop_job
    from agents.control.coordinator import start_job
    from agents.control.losses import JobStopped
    from agents.layout import load_plan_file, parse_layout
    from agents.rehearsal.elastic import MAX_RECOVERIES, ElasticJob, set_aside
    from agents.runfolder.record import endpoints_hook
    from agents.runfolder.report import (
        build_report,
        load_rank_reports,
        report_text,
        write_run_folder,
        write_unfinished_report,
    )
    from agents.runnable import check_plan_config, plan_for_config, runtime_refusal
    from geosched.config import load_config

    if prefill_follow_checkpoints and checkpoint_dir is None and not elastic:
        raise InputError("--prefill-follow-checkpoints needs --checkpoint-dir DIR (or --elastic): the folder to follow")
    if resume and checkpoint_dir is None:
        raise InputError("--resume needs --checkpoint-dir DIR: the checkpoints to resume from")
    config = load_config(config_path)
    text = load_plan_file(plan_path) if plan_path else plan_for_config(config)
    layout = parse_layout(text, plan_path or "plan")
    if plan_path:
        check_plan_config(layout.config, config, plan_path, config_path)
    refusal = runtime_refusal(layout)
    if refusal is None and device != "cpu":
        from agents.stage.device import host_refusal

        refusal = host_refusal(layout, device)
    if refusal is None:
        refusal = fleet_memory_refusal(layout, device, available_memory_bytes())
    if refusal is not None:
        raise PlanError(f"{plan_path or 'plan'}: {refusal}")
    steps = steps or config.job.steps  # a plan's steps are those of the config it was made from
    if (decay := decay_mismatch(layout.job, steps)) is not None and out is not None:
        print(f"launch: {decay}", file=out)
    first = resume_step(checkpoint_dir, layout.job, steps) if resume and checkpoint_dir is not None else 0
    if resume and out is not None:
        print(f"launch: resuming from checkpoint step {first} in {checkpoint_dir}, to step {steps}", file=out)
    run = Path(run_dir) if run_dir else new_run_dir()
    try:
        run.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file there, a path under a file, a read-only or virtual file system
        raise InputError(f"--run-dir {run}: cannot make a folder there ({exc.strerror or exc})") from None
    given = Path(calibration_file).read_bytes() if calibration_file is not None else None  # checked: bounded
    reused = clear_previous_run(run)
    if reused is not None and out is not None:
        print(f"launch: run folder {run}: {reused}", file=out)
    if given is not None:  # the folder holds the calibration its prediction used, measured here or given
        (run / "calibration.json").write_bytes(given)
    (run / "plan.yaml").write_text(text)
    with ExitStack() as stack:
        stack.enter_context(_reported_if_unfinished(run))  # from here on a run stopped early leaves report.json
        calibration_s = None
        if calibration == "measure":
            if out is not None:
                print(
                    f"launch: calibrating {describe(layout)} on this host first (--calibration FILE or "
                    "--no-calibrate skip it)",
                    file=out,
                    flush=True,
                )
            from agents.rehearsal.calibrate import calibrate_plan  # torch: not for `geosched plan`'s flags

            began = time.monotonic()
            calibration = calibrate_plan(
                layout, wan_scale, run / "calibration.json", out, device=device, encrypted_links=not insecure
            )
            calibration_s = time.monotonic() - began
            if out is not None:
                print(f"launch: calibrated in {calibration_s:.1f} s: {run / 'calibration.json'}", file=out, flush=True)
        load_calibrated = _load_average() if calibration_s is not None else None  # as calibrated (its ranks too)
        relays = RelayRoutes(layout, wan_scale, wan_reset_every_s)
        stack.callback(relays.close)
        if elastic and checkpoint_dir is None:  # recovery resumes from checkpoints: the run folder's, every step
            checkpoint_dir, checkpoint_every = run / "checkpoints", checkpoint_every or 1
            checkpoint_keep = ELASTIC_KEEP if checkpoint_keep is None else checkpoint_keep  # its own: not every step
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
        most_ranks = max(len(layout.roles), sum(dc.gpus for dc in config.cluster.datacenters) if elastic else 0)
        keys = None if insecure else job_keys(run / "secrets", most_ranks)  # a new plan may use other GPUs
        tls = None if keys is None or not (prefill_http or metrics) else write_rehearsal_tls(keys.directory)
        if insecure and out is not None:
            print(INSECURE_WARNING, file=out, flush=True)
        broker = None
        if mqtt is None:
            broker = EmbeddedBroker(**broker_security(keys, job))
            broker.start()
            stack.callback(broker.stop)
            mqtt = broker.url
        chunk_args: list[str] = [] if calibration is None else ["--time-stage"]  # stage compute as the agents run
        chunk_args += ["--device", device]
        if keys is not None:
            chunk_args += ["--keys", str(keys.directory.resolve())]  # the agents run in the repository root
        if checkpoint_dir is not None:
            chunk_args += ["--checkpoint-dir", str(Path(checkpoint_dir).resolve())]
            chunk_args += ["--checkpoint-every", str(checkpoint_every), "--checkpoint-keep", str(checkpoint_keep or 0)]
        load = None
        if prefill_rate > 0 or prefill_http or prefill_follow_checkpoints:
            chunk_args += ["--prefill-bind", "tcp://127.0.0.1:0"]
        if prefill_follow_checkpoints:  # each agent serves the newest complete checkpoint of --checkpoint-dir
            chunk_args += ["--prefill-follow-checkpoints"]
        if prefill_rate > 0:
            from agents.rehearsal.prompt_load import PrefillLoad

            load = PrefillLoad(prefill_rate, seed=layout.job.seed, keys=keys)
            stack.callback(load.stop, 0.0)  # on errors: stop at once (a no-op once stopped)
        http_urls: dict[int, str] = {}
        if prefill_http:  # every agent also answers OpenAI-style HTTP (agents.prefill.http) on a free port
            chunk_args += ["--prefill-http", "127.0.0.1:0", *tls_args("prefill-http", tls)]
        metrics_urls: dict[str, str] = {}
        job_metrics = None
        if metrics:  # every agent and the coordinator serve Prometheus metrics on a free port
            from agents.metrics.families import JobMetrics
            from agents.metrics.server import MetricsServer

            chunk_args += ["--metrics-bind", "127.0.0.1:0", *tls_args("metrics", tls)]
            job_metrics = JobMetrics(job)
            context = None if tls is None else server_context(tls.cert, tls.key, "launch's certificate")
            server = MetricsServer("127.0.0.1", 0, job_metrics.registry, job_metrics.health, tls=context)
            stack.enter_context(server)
            metrics_urls["coordinator"] = server.url()
        coordinator_url, control = coordinator_login(mqtt, keys)
        routes = relays if load is None else with_load(relays, load)
        hook = with_http_urls(routes, http_urls, keys, tls, out)
        coordinator_endpoints = {"metrics": metrics_urls["coordinator"]} if metrics else {}
        hook = with_metrics_urls(endpoints_hook(run, hook, coordinator_endpoints), metrics_urls, out)

        attempt: list[AgentProcesses] = []  # every attempt's agents, the running ones last

        def start_agents(plan: JobLayout, recovery: bool) -> AgentProcesses:
            if recovery:  # a recovery: the failed attempt's rank files go aside, the new plan's links get relays
                set_aside(run)
                relays.adopt(plan)
                (run / "plan.yaml").write_text(plan.text)
            args = [*chunk_args, *(agent_args or [])]
            if resume or (recovery and recovering.resumed_from() > 0):  # the newest complete checkpoint, if any
                args += ["--resume"]
            if recovery:  # the broker still retains the old plan: the new agents must not adopt it first
                args += ["--plan", str((run / "plan.yaml").resolve())]
            procs = stack.enter_context(AgentProcesses(plan, mqtt, job, run, args))
            attempt.append(procs)
            if out is not None:
                secured = "insecure" if keys is None else f"secure, keys in {keys.directory}"
                print(f"launch: {describe(plan)}, broker {mqtt}, run folder {run} ({secured})", file=out, flush=True)
            return procs

        def run_job(plan_text: str, count: int, stop_when: Any = None) -> None:
            procs = attempt[-1]  # the agents of this attempt: their exits are losses (broker or not)
            asyncio.run(
                start_job(
                    coordinator_url,
                    job,
                    plan_text,
                    steps=count,
                    ready_timeout_s=ready_timeout_s,
                    before_start=hook,
                    out=out,
                    metrics=job_metrics,
                    exits=procs.exited,
                    stop_when=stop_when,
                    broker_wait_s=ready_timeout_s if len(attempt) > 1 else None,  # a recovery: its broker may restart
                    **control,
                )
            )

        def stop_attempt(procs: AgentProcesses) -> list[int]:
            # SIGTERM is an agent's stop (it owns them: no waiting on the broker for the dead ones' statuses).
            # Lost: killed by a signal, not our SIGTERM (also one whose SIGKILL landed late, e.g. in a disk
            # write); not the agents that failed because a peer died (they exit with an error code)
            codes = procs.stop()
            return [rank for rank, code in codes.items() if code is not None and code < 0 and code != -signal.SIGTERM]

        started = time.monotonic()
        recovering = ElasticJob(
            config,
            run,
            Path(checkpoint_dir or run),
            start_agents,
            run_job,
            stop_attempt,
            out,
            MAX_RECOVERIES if elastic else 0,
            return_after_s=elastic_return_after_s,
        )
        try:
            text, agents = recovering.train(text, steps, first)
        except BaseException as exc:  # stopped, interrupted, failed: its agents stopped, then what they did reported
            codes = {}
            for procs in attempt[-1:]:
                codes = procs.stop()  # a step they complete after the signal is in their rank files, so in the report
            if isinstance(exc, JobStopped):
                time.sleep(STOPPED_LINGER_S)  # the broker carries the agents' last statuses before it closes
            if load is not None:
                load.stop()
            done = [r.to_dict() for r in recovering.recoveries]
            known = {"wall_s": time.monotonic() - started, "agent_exit_codes": codes, **_prefill_of(load, run)}
            setattr(exc, "run_report", write_unfinished_report(run, exc, done, known))  # noqa: B010 - `launch --json`
            raise
        if recovering.recoveries:
            layout = parse_layout(text)
        wall_s = time.monotonic() - started
        load_trained = _load_average()
        if load is not None:
            load.stop()  # every outstanding request is answered (or expires) before the agents stop
        if checkpoint_dir is not None and (checkpoint_every <= 0 or steps % checkpoint_every):  # the final state too
            final = asyncio.run(checkpoint_job(coordinator_url, job, **control))
            if out is not None:
                print(f"launch: checkpoint of step {final.step} (the final state) in {final.folder}", file=out)
        asyncio.run(stop_job(coordinator_url, job, **control))
        codes = agents.wait(20.0)
        refusals = dict(broker.refusals) if broker is not None else None
        wan = relays.wan_bytes()
    reports = load_rank_reports(run)
    timed = with_stages_timed_in_place(layout, calibration, run)  # the stages as the agents timed them
    predicted = predict(layout, wan_scale, timed)
    separate = predicted if timed is calibration else predict(layout, wan_scale, calibration)  # calibration's own
    replayed = replay(layout, wan_scale, calibration, reports)
    report = build_report(
        layout,
        reports,
        predicted_iteration_s=predicted.iteration_s,
        predicted_bubble_fraction=predicted.bubble_fraction,
        predicted_sync_s=sync_seconds(predicted),
        replayed_iteration_s=None if replayed is None else replayed.iteration_s,
        calibration_only_iteration_s=separate.iteration_s,
        wan_bytes=wan,
        extra={
            "outcome": "completed",
            "wan_scale": wan_scale,
            "wall_s": wall_s,
            "agent_exit_codes": codes,
            "calibrated": calibration is not None,
            "calibration_s": calibration_s,  # seconds spent measuring it (None: given or none)
            # the 1-minute load average after calibrating and after training: on a shared host the two differ
            # by what other jobs ran, which the prediction cannot know
            "load_average": {"calibration": load_calibrated, "training": load_trained},
            "predicted_unscaled_iteration_s": layout.predicted_iteration_s,
            "secure": keys is not None,
            "tls_ca": None if tls is None else str(tls.ca),  # what HTTPS clients of this run trust
            "broker_refusals": refusals,  # the embedded broker's refusals by kind (None: an outside broker)
            **({"prefill_http": http_urls} if http_urls else {}),  # rank -> URL of its OpenAI-style front end
            **({"metrics": metrics_urls} if metrics_urls else {}),  # coordinator, r<rank> -> Prometheus URL
            **({"recoveries": [r.to_dict() for r in recovering.recoveries]} if elastic else {}),
        },
    )
    if recovering.recoveries:  # steps/losses are the final plan's; the whole run's are its history
        from agents.runfolder.report import every_attempt

        report["history"] = every_attempt(run)
    report.update(_prefill_of(load, run))
    write_run_folder(run, layout, reports, report, predicted_timeline=predicted)
    if out is not None:
        print(report_text(report), file=out)
        if load is not None:
            from agents.rehearsal.prompt_load import prefill_text

            print(prefill_text(report["prefill"]), file=out)
        print(f"run folder: {run}", file=out, flush=True)
    return report


INSECURE_WARNING = (
    "launch: WARNING --insecure: no broker logins, unsigned commands, plain-TCP WAN links, plain HTTP and an "
    "open prefill endpoint; anyone who can reach these ports can read or steer the job"
)


@contextmanager
def _reported_if_unfinished(run: Path) -> Iterator[None]:
    """A run that fails or is interrupted before training (while it calibrates, starts its broker) leaves
    ``report.json`` too (``launch --json`` prints it); one whose training began reported it already."""
    try:
        yield
    except BaseException as exc:
        if getattr(exc, "run_report", None) is None:
            from agents.runfolder.report import write_unfinished_report

            setattr(exc, "run_report", write_unfinished_report(run, exc))  # noqa: B010 - for `launch --json`
        raise


def tls_args(prefix: str, tls: TlsFiles | None) -> list[str]:
    """An agent's flags for its HTTP endpoint ``prefix``: the run's certificate, or plain HTTP when insecure."""
    if tls is None:
        return [f"--{prefix}-insecure"]
    return [f"--{prefix}-tls-cert", str(tls.cert.resolve()), f"--{prefix}-tls-key", str(tls.key.resolve())]


def job_keys(folder: Path, ranks: int) -> JobKeys:
    """A fresh key folder for ``ranks`` agents (replacing any earlier one), loaded."""
    from agents.keys import load_job_keys, write_job_keys

    write_job_keys(folder, ranks, force=True)
    return load_job_keys(folder)


def broker_security(keys: JobKeys | None, job: str) -> dict[str, Any]:
    """The embedded broker's logins (one per identity) and ACLs, as keyword arguments; none when insecure."""
    if keys is None:
        return {"allow_anonymous": True, "warn_open": False}  # open only when told so; launch said it already
    from agents.control.broker_policy import JobAcl

    return {"users": keys.mqtt_users(), "acl": JobAcl(job)}


def _prefill_of(load: Any, run: Path) -> dict[str, Any]:
    """The report's ``prefill`` section: the launch's own load and what each agent saw, or what each serving agent
    saw of others' requests (``prefill-rank<R>.json``); none when no agent served prefill."""
    from agents.rehearsal.prompt_load import prefill_agents, prefill_section

    if load is not None:
        return {"prefill": prefill_section(load, run)}
    agents = prefill_agents(run)
    return {"prefill": {"agents": agents}} if agents else {}


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


def _load_average() -> float | None:
    """The host's 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
