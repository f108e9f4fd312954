"""What a coordinator keeps of a running job for its run folder: endpoints and every step's metrics.

``endpoints.json`` is written as soon as every agent is ready (the
``before_start`` hook of :func:`~agents.control.coordinator.start_job`, see
:func:`endpoints_hook`): per rank its DC, stage, replica, host, pid and the
endpoints it published, plus the ``routes`` the start command gives (WAN
relays in a rehearsal).

:class:`RunRecorder` is how ``geosched job start --run-dir DIR`` writes the
same run folder as ``geosched launch`` without reading the agents' disks:
every metrics message goes to ``DIR/metrics.jsonl`` as it arrives (replica
0's ranks send their step's timed events too, see
:func:`agents.worker.metrics_record`), and :meth:`RunRecorder.finish` turns
them into step reports and writes ``report.json`` and the pictures
(:func:`agents.runfolder.report.write_run_folder`)::

    recorder = RunRecorder("runs/demo", layout)
    result = await start_job(url, job, text, before_start=recorder.ready, on_metrics=recorder.record)
    report = recorder.finish(predict(layout))
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from agents.control.messages import MetricsMessage, StatusMessage
from agents.runfolder.claim import clear_previous_run
from agents.stage.report import StepReport
from geosched.errors import GeoschedError
from geosched.text import printable
from geosched.yamlload import write_atomically

log = logging.getLogger(__name__)

BeforeStart = Callable[[dict[int, StatusMessage]], Awaitable[dict[str, str]]]
"""The coordinator's ``before_start`` hook: ready statuses in, routes out."""


def endpoints_of(
    statuses: Mapping[int, StatusMessage],
    routes: Mapping[str, str] | None = None,
    coordinator: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The ``endpoints.json`` content: every rank's place and published endpoints, the routes, and the
    coordinator's own endpoints (``metrics``: its Prometheus URL, when it serves one)."""
    ranks = {
        str(rank): {
            "dc": st.dc,
            "stage": st.stage,
            "replica": st.replica,
            "host": st.host,
            "pid": st.pid,
            "plan_id": st.extra.get("plan_id"),
            "endpoints": dict(st.extra.get("endpoints") or {}),
        }
        for rank, st in sorted(statuses.items())
    }
    return {"time": time.time(), "ranks": ranks, "routes": dict(routes or {}), "coordinator": dict(coordinator or {})}


def write_endpoints(
    run_dir: str | os.PathLike[str],
    statuses: Mapping[int, StatusMessage],
    routes: Mapping[str, str] | None = None,
    coordinator: Mapping[str, str] | None = None,
) -> Path:
    """Write ``run_dir/endpoints.json`` atomically (a reader never sees half of it); return its path."""
    path = Path(run_dir) / "endpoints.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(str(path), json.dumps(endpoints_of(statuses, routes, coordinator), indent=1))
    return path


def endpoints_hook(
    run_dir: str | os.PathLike[str], then: BeforeStart | None = None, coordinator: Mapping[str, str] | None = None
) -> BeforeStart:
    """A ``before_start`` hook: write ``endpoints.json`` at once, run ``then`` (e.g. the WAN relays) and
    write it again with the routes ``then`` returns; ``coordinator`` is listed as the coordinator's endpoints."""

    async def hook(statuses: dict[int, StatusMessage]) -> dict[str, str]:
        write_endpoints(run_dir, statuses, coordinator=coordinator)
        routes = await then(statuses) if then is not None else {}
        if routes:
            write_endpoints(run_dir, statuses, routes, coordinator)
        return routes

    return hook


class RunRecorder:
    """A job's run folder from the coordinator's side: endpoints on ready, metrics as they come, report at the end.

    ``run_dir`` may be an earlier run's (a resume): what of it could pass for this run's is cleared first
    (:func:`~agents.runfolder.claim.clear_previous_run`, said in ``reused``), its metrics kept as
    ``metrics-<N>.jsonl``. The CLI claims the folder first (:func:`~agents.runfolder.claim.claim_run_dir`)."""

    def __init__(
        self, run_dir: str | os.PathLike[str], layout: Any, coordinator: Mapping[str, str] | None = None
    ) -> None:
        self.run, self.layout = Path(run_dir), layout
        self.run.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.reused = clear_previous_run(self.run)  # what an earlier run left, in words (None: nothing)
        (self.run / "plan.yaml").write_text(layout.text, encoding="utf-8")
        self.metrics_path = self.run / "metrics.jsonl"
        self._out = open(self.metrics_path, "w", encoding="utf-8")  # noqa: SIM115 - closed by finish/close
        self._newest: dict[int, int] = {}  # rank -> the newest step recorded
        self.refused = 0  # metrics messages not recorded (see record)
        self.ready = endpoints_hook(self.run, coordinator=coordinator)

    def record(self, message: MetricsMessage) -> None:
        """Append one metrics message (the coordinator's ``on_metrics`` hook) if it is a step report of its
        rank's place in the plan, for a step after the last one recorded for that rank: a rank's key can sign
        anything, and one malformed report failed the whole run folder at the end, a flood of them filled the
        disk. The others are counted (``refused``) and logged once."""
        if self._out.closed:
            return
        data = {**message.values, "rank": message.rank, "step": message.step}
        why = self._refusal(message.rank, data)
        if why is not None:
            self.refused += 1
            if self.refused == 1:
                log.warning(
                    "run folder: not recorded: metrics of rank %d for step %d: %s", message.rank, message.step, why
                )
            return
        self._newest[message.rank] = message.step
        self._out.write(json.dumps(data) + "\n")
        self._out.flush()

    def _refusal(self, rank: int, data: Mapping[str, Any]) -> str | None:
        """Why ``data`` is not recorded for ``rank``; None to record it."""
        if data["step"] <= self._newest.get(rank, -1):
            return f"step {data['step']} is not after the last recorded one ({self._newest[rank]})"
        try:
            report = StepReport.from_dict(data)
            role = self.layout.role(rank)
        except (KeyError, TypeError, ValueError, GeoschedError) as exc:
            return f"not a step report ({type(exc).__name__}: {printable(exc, 200)})"
        if (report.stage, report.replica) != (role.stage, role.replica):
            return (
                f"stage {report.stage} replica {report.replica}: the rank is stage {role.stage}, replica {role.replica}"
            )
        if any(peer not in (role.stage - 1, role.stage + 1) for peer in report.bytes_sent):
            return f"bytes sent to stages {sorted(report.bytes_sent)}, not the rank's neighbours"
        return None

    def close(self) -> None:
        """Stop recording (idempotent)."""
        self._out.close()

    def finish(
        self, predicted: Any = None, extra: Mapping[str, Any] | None = None, failure: BaseException | None = None
    ) -> dict[str, Any]:
        """Write report.json and the pictures from what was recorded; return the report.

        ``predicted``: the simulator's Timeline of the layout (``predicted.png``, ``timelines.png`` and the
        predicted figures of the report), or None. ``failure``: what ended the job early (its ``outcome`` and
        ``error`` in the report; with no step recorded, the report is those and the empty ``steps``).
        """
        from agents.runfolder.predict import sync_seconds
        from agents.runfolder.report import build_report, outcome_of, write_run_folder

        self.close()
        reports = load_metrics_reports(self.metrics_path)
        ending: dict[str, str] = {"outcome": "completed"} if failure is None else outcome_of(failure)
        if failure is not None and not any(reports.values()):
            report: dict[str, Any] = {**ending, "steps": [], "losses": [], "source": "coordinator metrics"}
            write_atomically(str(self.run / "report.json"), json.dumps(report, indent=1))
            return report
        report = build_report(
            self.layout,
            reports,
            predicted_iteration_s=None if predicted is None else predicted.iteration_s,
            predicted_bubble_fraction=None if predicted is None else predicted.bubble_fraction,
            predicted_sync_s=None if predicted is None else sync_seconds(predicted),
            wan_bytes=wan_bytes_sent(self.layout, reports),
            extra={**ending, "source": "coordinator metrics", "calibrated": False, **(extra or {})},
        )
        report["files"] = {"endpoints": str(self.run / "endpoints.json"), "metrics": str(self.metrics_path)}
        write_run_folder(self.run, self.layout, reports, report, predicted_timeline=predicted)
        return report


def load_metrics_reports(path: str | os.PathLike[str]) -> dict[int, list[StepReport]]:
    """``metrics.jsonl`` as rank -> step reports in step order (a step reported twice: the later one)."""
    by_rank: dict[int, dict[int, StepReport]] = {}
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                report = StepReport.from_dict(data)
                by_rank.setdefault(int(data["rank"]), {})[report.step] = report
            except (KeyError, TypeError, ValueError) as exc:
                raise GeoschedError(
                    f"{path} line {number}: not a step report ({type(exc).__name__}: {exc}); the agents and the "
                    "coordinator must run the same geosched version"
                ) from None
    return {rank: [steps[s] for s in sorted(steps)] for rank, steps in by_rank.items()}


def wan_bytes_sent(layout: Any, reports: Mapping[int, list[StepReport]]) -> dict[str, int]:
    """Bytes the ranks sent across datacenters, per direction (``{"us->eu": n}``), over every reported step."""
    out: dict[str, int] = {}
    for rank, steps in reports.items():
        role = layout.role(rank)
        for report in steps:
            for peer, nbytes in report.bytes_sent.items():
                peer_dc = role.wan_peer_dc(peer)
                if peer_dc is not None:
                    out[f"{role.dc}->{peer_dc}"] = out.get(f"{role.dc}->{peer_dc}", 0) + nbytes
            for peer_dc, nbytes in report.sync_bytes.items():  # gradient links (data parallelism across DCs)
                out[f"{role.dc}->{peer_dc}"] = out.get(f"{role.dc}->{peer_dc}", 0) + nbytes
    return out
