"""Coordinate a job over MQTT: start it (publish the plan, wait for every agent, train), show or stop it.

  geosched job start plan.yaml --mqtt mqtt://broker:1883 --job demo --steps 100 --run-dir runs/demo
  geosched job status --mqtt mqtt://broker:1883 --job demo [--json]
  geosched job status --mqtt mqtt://broker:1883 --job demo --watch   # live table until Ctrl-C
  geosched job checkpoint --mqtt mqtt://broker:1883 --job demo [--after-step N]
  geosched job stop --mqtt mqtt://broker:1883 --job demo
  geosched job start plan.yaml --mqtt mqtts://broker:8883 --job demo --keys secrets   # secure
  geosched job start plan.yaml --mqtt mqtt://broker:1883 --job demo --elastic --config cluster.yaml \
      --checkpoint-dir /shared/ckpt     # re-plan around lost ranks; agents run with --resume (docs/launch.md)
  geosched job start plan.yaml --mqtt mqtt://broker:1883 --job demo --metrics-bind 127.0.0.1:9400 \
      --metrics-tls-cert tls.crt --metrics-tls-key tls.key     # Prometheus over TLS (or --metrics-insecure)

With ``--keys DIR`` (from ``geosched keys DIR --ranks N``) the coordinator logs
in to the broker as ``coordinator`` with its password from DIR and signs its
commands and plans with DIR/coordinator.sign.

``start`` prints one line per step (step, loss, iteration ms, bubble %, WAN MB/s)
with a progress bar and exits 1 naming the agent if one goes offline. With
``--run-dir DIR`` it writes the run folder ``geosched launch`` writes (endpoints.json
once every agent is ready; report.json, timeline.png, predicted.png, timelines.png,
trace.json, loss.png at the end) from the metrics it receives. It takes DIR as
``geosched launch`` takes its ``--run-dir`` (:mod:`agents.runfolder.claim`), before
the broker is contacted: a new or empty folder, or an earlier run's (reused, and said).

``start --elastic`` survives lost ranks or DCs: it re-plans CONFIG on the GPUs
left (same global batch), publishes the new plan (also written to
CHECKPOINT_DIR/plans/), stops the survivors and waits for agents of the new
plan, which their supervisor restarts with ``--resume --checkpoint-dir`` on
the shared folder (:mod:`agents.rehearsal.supervised`); it prints each recovery.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
from collections import Counter
from typing import Any

from geosched.commands.agent import add_mqtt_arguments, load_keys, mqtt_url
from geosched.commands.checks import above, at_least, at_most, usable_checkpoint_folder
from geosched.commands.http_flags import (
    add_allow_argument,
    add_tls_arguments,
    allowed_networks,
    tls_context,
    unused_tls_flags,
)
from geosched.commands.signals import stops_as_ctrl_c
from geosched.errors import GeoschedError, InputError

FOREIGN = (
    "holds files that are no run folder's ({files}); pick a new or empty folder, or the run folder of an earlier "
    "job start or launch (the coordinator writes its report, pictures and metrics there, in place of that run's)"
)
"""Why ``--run-dir`` is refused when it holds other files (:func:`agents.runfolder.claim.claim_run_dir`)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``geosched job``."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    start = sub.add_parser("start", help="publish the plan, wait for the agents, train")
    start.add_argument("plan", help="plan file (from 'geosched plan')")
    start.add_argument(
        "--steps",
        type=int,
        metavar="N",
        help="steps to train, from the step the agents are at (after a resume: that many more; default: the job's)",
    )
    start.add_argument(
        "--ready-timeout", type=float, default=120.0, help="seconds to wait for every agent to be ready (default 120)"
    )
    start.add_argument("--json", action="store_true", help="print the step summaries as JSON at the end")
    start.add_argument(
        "--run-dir",
        metavar="DIR",
        help="write the run folder here: endpoints.json on ready; report.json and the pictures at the end",
    )
    start.add_argument(
        "--metrics-bind",
        metavar="HOST:PORT",
        help="serve the job's Prometheus metrics (/metrics) and /health on HOST:PORT while it runs, e.g. "
        "127.0.0.1:9400 (port 0: any; off by default)",
    )
    add_tls_arguments(start, "metrics", "the job's metrics endpoint")
    add_allow_argument(start, "metrics", "the job's metrics endpoint")
    start.add_argument(
        "--elastic",
        action="store_true",
        help="on lost ranks or DCs: re-plan --config on the GPUs left, publish the new plan, stop the survivors and "
        "wait for agents of the new plan (restarted by their supervisor with --resume) to resume from the newest "
        "complete checkpoint in --checkpoint-dir",
    )
    start.add_argument("--config", metavar="CONFIG", help="with --elastic: the cluster/job config to re-plan")
    start.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="with --elastic: the checkpoint folder every agent shares (the agents' --checkpoint-dir; made if new)",
    )
    status = sub.add_parser("status", help="table of the agents' retained statuses")
    status.add_argument("--json", action="store_true", help="JSON instead of a table")
    status.add_argument(
        "--watch", action="store_true", help="a live table (state, step, iteration, bubble, WAN, prefill) until Ctrl-C"
    )
    status.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="with --watch: seconds between redraws (default 1)"
    )
    sub.add_parser("stop", help="tell every agent of the job to stop")
    checkpoint = sub.add_parser("checkpoint", help="ask every agent (with --checkpoint-dir) for a checkpoint")
    checkpoint.add_argument(
        "--after-step",
        type=int,
        help="after this step (0-based; default: now if idle, else after the step past the one in progress, "
        "the same for every rank)",
    )
    checkpoint.add_argument(
        "--timeout", type=float, default=120.0, metavar="S", help="wait this long for every agent's acknowledgement"
    )
    checkpoint.add_argument("--json", action="store_true", help="print the step, folder and ranks as JSON")
    for p in (start, status, sub.choices["stop"], checkpoint):
        add_mqtt_arguments(p)


def _job_metrics(args: argparse.Namespace, out: Any) -> tuple[Any, Any]:
    """With ``--metrics-bind``: the coordinator's JobMetrics and its server, started (its URL printed);
    else (None, None)."""
    if args.metrics_bind is None:
        unused_tls_flags(args, "metrics", "--metrics-bind")
        return None, None
    from agents.metrics.families import JobMetrics
    from agents.metrics.server import MetricsServer
    from geosched.commands.wanem import parse_address

    host, port = parse_address(args.metrics_bind, "--metrics-bind")
    tls = tls_context(args, "metrics", "--metrics-bind")
    metrics = JobMetrics(args.job)
    allow = allowed_networks(args, "metrics")
    server = MetricsServer(host, port, metrics.registry, metrics.health, tls=tls, allow=allow).start()
    print(f"metrics of job {args.job!r}: {server.url()} (health: /health)", file=out, flush=True)
    return metrics, server


def recovery_line(r: Any) -> str:
    """The line ``job start --elastic`` prints for one recovery (an :class:`agents.rehearsal.elastic.Recovery`)."""
    down = f"down {r.downtime_s:.1f} s" if r.downtime_s >= 0 else "the new plan never started (lost again first)"
    return (
        f"recovery: lost ranks {r.lost_ranks}{' (DC ' + ', '.join(r.lost_dcs) + ')' if r.lost_dcs else ''}; "
        f"{r.old_plan} -> {r.new_plan}; resumed from step {r.resumed_from_step}, {r.steps_redone} steps redone, {down}"
    )


def run(args: argparse.Namespace) -> int:
    """Run the chosen action."""
    from agents.control import commands
    from agents.control.auth import ControlKeys
    from agents.control.coordinator import AgentLost

    keys = load_keys(args)
    reads = args.action == "status"  # reading statuses needs the public keys only, not coordinator.sign
    signing = None if keys is None else ControlKeys(*keys.control_fields("coordinator", signs=not reads))
    url = mqtt_url(args, keys, "coordinator")
    if args.action == "start":
        from agents.layout import load_plan_file

        at_least(args, "steps", 1)
        above(args, "ready_timeout", 0, "seconds to wait for every agent, e.g. 120")
        at_most(args, "ready_timeout", 86_400, "a day")
        text = load_plan_file(args.plan)
        out = sys.stderr if args.json else sys.stdout
        args.run_stops = True  # a closed stdout stops the run: exit 1 (geosched.cli)
        if args.elastic or args.config or args.checkpoint_dir:
            with stops_as_ctrl_c():
                return _start_elastic(args, url, signing, text, out)
        if args.run_dir is None:
            return _start(args, url, signing, text, out)
        from agents.runfolder.claim import claim_run_dir

        with claim_run_dir(args.run_dir, foreign=FOREIGN):  # before the broker: a refusal is one line, exit 2
            return _start(args, url, signing, text, out)
    if args.action == "status" and args.watch:
        from agents.control.watch import watch_job

        above(args, "interval", 0, "seconds")
        if args.json:
            raise InputError("--watch draws a live table for people; scripts read 'geosched job status --json'")
        try:
            asyncio.run(watch_job(url, args.job, interval_s=args.interval, ca_file=args.ca_file, keys=signing))
        except KeyboardInterrupt:
            print(file=sys.stdout)
        return 0
    if args.action == "status":
        statuses = asyncio.run(commands.job_statuses(url, args.job, ca_file=args.ca_file, keys=signing))
        if args.json:  # ranks in order, each with every key (null where its status has none), then the rest
            stable = {"step": None, "next_step": None, "plan_id": None, "current_plan": None, "message": None}
            print(
                json.dumps(
                    {
                        str(r): {
                            "state": s.state,
                            "dc": s.dc,
                            "stage": s.stage,
                            "replica": s.replica,
                            "host": s.host,
                            "pid": s.pid,
                            **stable,
                            "endpoints": {},
                            **s.extra,
                        }
                        for r, s in sorted(statuses.items())
                    }
                )
            )
        else:
            print(
                commands.status_table(statuses)
                if statuses
                else f"no agents of job {args.job!r} on this broker (agents and 'job' name theirs with --job; "
                "a 'geosched launch' rehearsal's is 'launch' unless its --job said otherwise)"
            )
        return 0
    if args.action == "checkpoint":
        at_least(args, "after_step", 0)
        above(args, "timeout", 0, "seconds")
        written = asyncio.run(
            commands.checkpoint_job(
                url, args.job, after_step=args.after_step, ca_file=args.ca_file, keys=signing, timeout_s=args.timeout
            )
        )
        if args.json:
            print(json.dumps({"step": written.step, "folder": written.folder, "ranks": list(written.ranks)}))
        else:
            print(
                f"checkpoint step {written.step} of job {args.job!r} written to {written.folder} "
                f"(acknowledged by {len(written.ranks)} agents)"
            )
        return 0
    seen: dict[int, str] = {}
    left = asyncio.run(  # StopUnconfirmed (exit 1): the broker took the stop, then went away
        commands.stop_job(
            url, args.job, ca_file=args.ca_file, keys=signing, known_job=True, forget_plan=True, seen=seen
        )
    )
    if left:
        raise AgentLost(
            f"job {args.job!r}: ranks {left} did not acknowledge stop within {commands.STOP_TIMEOUT_S:g} s; "
            "see their logs"
            + (
                " (an agent refuses a stop signed with a key its key folder does not hold: is --keys this job's?)"
                if signing is not None
                else ""
            )
        )
    statuses = asyncio.run(commands.job_statuses(url, args.job, ca_file=args.ca_file, keys=signing))
    if refused := {r: str(st.extra["message"]) for r, st in statuses.items() if st.state == "refused"}:
        from agents.control.refused import rank_list, summary

        raise AgentLost(
            f"job {args.job!r}: the stop was sent, but no stop can be confirmed for {rank_list(list(refused))}: their "
            f"statuses were refused ({summary(refused)}); check their hosts and key folders"
        )
    offline = sorted(
        r for r, st in statuses.items() if st.state == "offline" and st.extra.get("current_plan") is not False
    )
    forgot = "; its plan is no longer held on the broker (agents started now wait for 'job start')"
    if seen and all(state in ("stopped", "error") for state in seen.values()):  # a trial's said 'acknowledged'
        states = ", ".join(f"{n} {state}" for state, n in sorted(Counter(seen.values()).items()))
        print(f"job {args.job!r}: every agent had ended already ({states}); nothing to acknowledge{forgot}")
    elif offline:  # its will: gone, frozen or cut off; a stop it never saw
        print(
            f"job {args.job!r} stopped: every agent acknowledged except ranks {', '.join(map(str, offline))}, which "
            f"are offline (gone, frozen or cut off: they were not told; check their hosts){forgot}"
        )
    else:
        print(f"job {args.job!r} stopped: every agent acknowledged{forgot}")
    return 0


def _start(args: argparse.Namespace, url: str, signing: Any, text: str, out: Any) -> int:
    """``job start`` without ``--elastic``: train, print the steps, write the run folder (``--run-dir``, claimed)."""
    from agents.control import coordinator
    from agents.control.coordinator import JobResult

    metrics, server = _job_metrics(args, out)
    recorder = _recorder(args.run_dir, text, args.plan, {} if server is None else {"metrics": server.url()}, out)
    hooks: dict[str, Any] = {} if recorder is None else {"before_start": recorder.ready, "on_metrics": recorder.record}
    done = JobResult()  # the steps that complete, also when the job does not
    try:
        with stops_as_ctrl_c():
            result = asyncio.run(
                coordinator.start_job(
                    url,
                    args.job,
                    text,
                    steps=args.steps,
                    ready_timeout_s=args.ready_timeout,
                    ca_file=args.ca_file,
                    keys=signing,
                    plan_source=args.plan,
                    out=out,
                    metrics=metrics,
                    result=done,
                    **hooks,
                )
            )
    except BaseException as exc:  # failed, stopped, interrupted (Ctrl-C, SIGTERM, SIGHUP)
        if recorder is not None:  # what the steps that did complete show, with the outcome and the error
            with contextlib.suppress(GeoschedError, OSError):
                _write_run_folder(recorder, args.run_dir, out, exc)
        if args.json:  # as on success: stdout ends with one JSON object, here with the outcome and error
            from agents.runfolder.report import outcome_of

            print(json.dumps({**outcome_of(exc), "steps": [vars(s) for s in done.steps]}), flush=True)
        raise
    finally:
        if recorder is not None:
            recorder.close()
        if server is not None:
            server.close()
    if recorder is not None:
        _write_run_folder(recorder, args.run_dir, out)
    print(_completed(args.job, result), file=out, flush=True)  # after the last step line: it ended well
    if args.json:
        print(json.dumps({"outcome": "completed", "steps": [vars(s) for s in result.steps]}))
    return 0


def _completed(job: str, result: Any) -> str:
    """``job 'demo' completed: steps 0-11 (12 steps), median iteration 31.2 ms, final loss 3.6990``; the steps
    whose metrics were lost count too (a re-test's 6 steps read 'steps 2-5 (4 steps)')."""
    steps, trained = result.steps, sorted({s.step for s in result.steps} | set(result.missing))
    if not trained:
        return f"job {job!r} completed: no step was left to run"
    lost = f", {len(trained) - len(steps)} without metrics" if len(trained) > len(steps) else ""
    median = f", median iteration {statistics.median(s.iteration_s for s in steps) * 1e3:.1f} ms" if steps else ""
    loss = f", final loss {steps[-1].loss:.4f}" if steps and steps[-1].loss is not None else ""
    if loss and steps[-1].step != trained[-1]:  # the last step's metrics were lost (the broker was away)
        loss = f", last loss seen {steps[-1].loss:.4f} (step {steps[-1].step})"
    count = f"{len(trained)} step{'s' * (len(trained) != 1)}{lost}"
    return f"job {job!r} completed: steps {trained[0]}-{trained[-1]} ({count}){median}{loss}"


def _start_elastic(args: argparse.Namespace, url: str, signing: Any, text: str, out: Any) -> int:
    """``job start --elastic``: run the steps, recovering from lost ranks (agents.rehearsal.supervised)."""
    from pathlib import Path

    from agents.layout import parse_layout
    from agents.rehearsal.elastic import describe
    from agents.rehearsal.supervised import SupervisedResult, run_supervised
    from geosched.config import load_config

    if not args.elastic:
        raise InputError("--config and --checkpoint-dir are for --elastic; add --elastic or leave them out")
    if not args.config or not args.checkpoint_dir:
        raise InputError(
            "--elastic needs --config CONFIG (to re-plan) and --checkpoint-dir DIR (the agents' shared folder)"
        )
    if args.run_dir or args.metrics_bind:
        raise InputError(
            "--elastic does not write a run folder or serve metrics yet; leave out --run-dir/--metrics-bind"
        )
    usable_checkpoint_folder(args.checkpoint_dir)  # made if new: the agents' first checkpoint goes there
    layout = parse_layout(text, args.plan)
    done = SupervisedResult(None, plan_text=text)

    def ended(outcome: dict[str, str]) -> str:
        """The --json line: the outcome, the last attempt's steps, the plan in force, the recoveries."""
        steps = [] if done.result is None else [vars(s) for s in done.result.steps]
        plan = describe(parse_layout(done.plan_text))
        return json.dumps(
            {**outcome, "steps": steps, "plan": plan, "recoveries": [r.to_dict() for r in done.recoveries]}
        )

    try:
        run_supervised(
            url,
            args.job,
            text,
            load_config(args.config),
            Path(args.checkpoint_dir),
            steps=args.steps or layout.job.steps,
            out=out,
            ready_timeout_s=args.ready_timeout,
            ca_file=args.ca_file,
            keys=signing,
            done=done,
        )
    except BaseException as exc:  # failed, stopped, interrupted: as on success, stdout ends with one JSON object
        if args.json:
            from agents.runfolder.report import outcome_of

            print(ended(outcome_of(exc)), flush=True)
        raise
    for r in done.recoveries:
        print(recovery_line(r), file=out, flush=True)
    if done.result is not None:
        print(_completed(args.job, done.result), file=out, flush=True)
    if args.json:
        print(ended({"outcome": "completed"}))
    return 0


def _recorder(run_dir: str | None, text: str, source: str, coordinator: dict[str, str], out: Any) -> Any:
    """The run folder's recorder for ``--run-dir`` (None without it; the folder is claimed), listing the
    ``coordinator``'s endpoints in endpoints.json; it says what it reuses of an earlier run's folder."""
    if run_dir is None:
        return None
    from agents.layout import parse_layout
    from agents.runfolder.record import RunRecorder

    try:
        recorder = RunRecorder(run_dir, parse_layout(text, source), coordinator)
    except OSError as exc:
        raise InputError(f"--run-dir {run_dir}: {exc.strerror or exc}; pick a writable folder") from None
    if recorder.reused is not None:
        print(f"run folder {run_dir}: {recorder.reused}", file=out, flush=True)
    return recorder


def _write_run_folder(recorder: Any, run_dir: str, out: Any, failure: BaseException | None = None) -> dict[str, Any]:
    """report.json and the pictures from the recorded metrics, compared with the plan's prediction (``failure``:
    what ended the job early, its outcome and error in the report); the report."""
    from agents.runfolder.predict import predict
    from agents.runfolder.report import report_text

    report: dict[str, Any] = recorder.finish(predict(recorder.layout), failure=failure)
    if report.get("steps"):
        print(report_text(report), file=out)
    print(f"run folder: {run_dir} ({report['outcome']})", file=out, flush=True)
    return report
