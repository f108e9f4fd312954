"""The run folder of a training run: ``report.json``, measured timeline (PNG + Chrome trace), loss curve.

Inputs are the per-step reports of every rank (:class:`~agents.stage.report.StepReport`
with timed events: the ``<run>/rank<R>.jsonl`` agents write, or the metrics the
coordinator received, :mod:`agents.runfolder.record`), the plan's
layout and the prediction. :func:`build_report` makes the JSON-ready dict;
:func:`write_run_folder` writes it and the pictures::

    report.json       steps, losses (one per step), loss_rose (last/first where it rose by half: diverging),
                      predicted_iteration_s, measured_iteration_s, replayed_iteration_s and measured_vs_replayed
                      (the simulator fed this run's own compute times), predicted_iteration_s_calibration_only
                      (with the calibration's stage times where the agents timed theirs in place),
                      predicted_sync_s, measured_sync_s (the gradient sync), bubble_fraction_measured,
                      bubble_fraction_predicted, wan_bytes (per link direction; layout.wan_compression: the links
                      that travel compressed), memory (per rank: measured peak and predicted bytes),
                      memory_measured_vs_predicted_max, per-step detail, wan_messages (each WAN message's time
                      against the simulator's, per replica: agents.runfolder.messages)
    timeline.png      measured timeline of the last step (replica 0's pipeline), with link rows
    trace.json        the same as a Chrome trace (chrome://tracing, Perfetto)
    predicted.png     the simulator's timeline for the same layout
    timelines.png     predicted above measured, on one time axis
    loss.png          loss per step

Measured iteration time of a step is the slowest rank's, and so is its gradient
sync (the ALL_REDUCE action, :attr:`StepReport.sync_s`; with data parallelism
across DCs the part that crosses the WAN); the run's figures are the medians
over steps after the first (the first warms up caches and links). A rank's
sync also holds its wait for the replicas that reach the collective later
(on a host whose ranks time-share its cores, tens to hundreds of ms), which
the simulator's replicas, all in step, do not have: ``sync_collective_s`` is
the collective itself, per stage the shortest ALL_REDUCE of its ranks (the last
to arrive waits for nobody), the slowest stage's.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agents.control.losses import JobStopped
from agents.runfolder.messages import message_lines, wan_message_times
from agents.stage.report import StepReport, global_loss, measured_timeline
from geosched.compression import Codec, wire_ratio
from geosched.errors import GeoschedError
from geosched.yamlload import write_atomically

log = logging.getLogger(__name__)


def load_rank_reports(run_dir: str | os.PathLike[str]) -> dict[int, list[StepReport]]:
    """Every ``rank<R>.jsonl`` in ``run_dir``: rank -> its step reports in step order."""
    out: dict[int, list[StepReport]] = {}
    for path in sorted(Path(run_dir).glob("rank*.jsonl")):
        lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
        for n, line in enumerate(lines, 1):
            try:
                data = json.loads(line)
                out.setdefault(int(data["rank"]), []).append(StepReport.from_dict(data))
            except (ValueError, KeyError, TypeError) as exc:
                if n < len(lines):
                    raise GeoschedError(f"{path}: line {n} is not a step report ({exc}); see the agent's log") from None
                log.warning("%s: its last line is cut short (a full disk, a killed agent?); left out", path)
    for reports in out.values():
        reports.sort(key=lambda r: r.step)
    return out


def reports_by_step(reports: Mapping[int, list[StepReport]]) -> dict[int, list[StepReport]]:
    """Every rank's reports (rank -> its reports) regrouped by step: step -> the reports of that step."""
    by_step: dict[int, list[StepReport]] = {}
    for rank_reports in reports.values():
        for step_report in rank_reports:
            by_step.setdefault(step_report.step, []).append(step_report)
    return by_step


def steady(values: list[float]) -> float:
    """Median of the values after the first (all of them when there is only one)."""
    return statistics.median(values[1:] if len(values) > 1 else values)


def collective_sync_s(step_reports: list[StepReport]) -> float:
    """One step's gradient sync without the wait for peers: per stage the shortest ALL_REDUCE of its ranks, the
    largest over the stages."""
    by_stage: dict[int, float] = {}
    for r in step_reports:
        by_stage[r.stage] = min(r.sync_s, by_stage.get(r.stage, r.sync_s))
    return max(by_stage.values(), default=0.0)


def _sync_line(report: Mapping[str, Any], predicted_sync: float | None) -> str:
    """The gradient sync's summary line: the collective (the last replica's ALL_REDUCE, what the simulator
    prices) against the prediction first, then the slowest rank's, which adds its wait for later replicas."""
    measured, collective = report["measured_sync_s"], report.get("measured_sync_collective_s")

    def versus(ratio_key: str) -> str:  # the ratio build_report stored beside the figure
        if not predicted_sync:
            return ""
        return f", predicted {predicted_sync * 1e3:.1f} ms (measured/predicted {report[ratio_key]:.2f})"

    if collective is None:
        return f"gradient sync: measured {measured * 1e3:.1f} ms" + versus("sync_measured_vs_predicted")
    return (
        f"gradient sync: the collective {collective * 1e3:.1f} ms"
        + versus("sync_collective_measured_vs_predicted")
        + f"; with the wait for replicas that reach it later {measured * 1e3:.1f} ms"
    )


def _link_of(direction: str) -> str:
    """The ``layout.wan_compression`` key (``"eu-us"``: the sorted DC pair) of a link direction (``"us->eu"``)."""
    return "-".join(sorted(direction.split("->")))


def _uncompressed(report: Mapping[str, Any], element_bytes: int) -> dict[str, int]:
    """About what each compressed direction's ``wan_bytes`` would have been uncompressed (whole blocks assumed)."""
    codecs: Mapping[str, Codec] = report["layout"]["wan_compression"]
    return {
        link: round(nbytes / wire_ratio(element_bytes, codecs[_link_of(link)]))
        for link, nbytes in report["wan_bytes"].items()
        if _link_of(link) in codecs
    }


def build_report(
    layout: Any,
    reports: Mapping[int, list[StepReport]],
    *,
    predicted_iteration_s: float | None,
    predicted_bubble_fraction: float | None = None,
    predicted_sync_s: float | None = None,
    replayed_iteration_s: float | None = None,
    calibration_only_iteration_s: float | None = None,
    wan_bytes: Mapping[str, int] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``report.json`` content for a run of ``layout`` (a :class:`~agents.layout.JobLayout`)."""
    missing = [r.rank for r in layout.roles if not reports.get(r.rank)]
    if missing:
        raise GeoschedError(f"run report: no step reports from ranks {missing}; see their agent logs")
    by_step = reports_by_step(reports)
    complete = sorted(s for s, rs in by_step.items() if len(rs) == len(layout.roles))
    schedule = _schedule(layout)
    roles = {(role.stage, role.replica): role for role in layout.roles}  # a stage's tp ranks share its links
    per_step: list[dict[str, Any]] = []
    for step in complete:
        rs = by_step[step]
        pipeline = [r for r in rs if r.replica == 0]
        timeline = measured_timeline(schedule, pipeline)
        per_step.append(
            {
                "step": step,
                "loss": global_loss(r for r in rs if r.stage == layout.num_stages - 1),
                "iteration_s": max(r.iteration_s for r in rs),
                "bubble_fraction": timeline.bubble_fraction,
                "bytes_sent": sum(sum(r.bytes_sent.values()) for r in rs),  # every pipeline message, in DCs too
                "wan_bytes": sum(r.wan_bytes(roles[r.stage, r.replica]) for r in rs),  # as the metrics count them
                "sync_s": max(r.sync_s for r in rs),
                "sync_collective_s": collective_sync_s(rs),
                "sync_bytes": sum(sum(r.sync_bytes.values()) for r in rs),
                "lr": next((r.lr for r in rs if r.lr is not None), None),  # the same on every rank
                "grad_norm": next((r.grad_norm for r in rs if r.grad_norm is not None), None),  # the same on every rank
                "skipped": any(r.skipped for r in rs),  # fp16: every stage skipped its optimizer step
            }
        )
    if not per_step:
        raise GeoschedError("run report: no step completed on every rank")
    measured = steady([s["iteration_s"] for s in per_step])
    tokens = layout.job.global_batch * layout.job.model.seq_len
    sync = steady([s["sync_s"] for s in per_step])
    collective = steady([s["sync_collective_s"] for s in per_step])
    report: dict[str, Any] = {
        "steps": [s["step"] for s in per_step],
        "losses": [s["loss"] for s in per_step],
        "skipped_steps": [s for s in complete if any(r.skipped for r in by_step[s])],  # fp16: overflowed, not stepped
        "loss_rose": loss_rose([s["loss"] for s in per_step]),  # last/first loss where it rose by half: diverging
        "predicted_iteration_s": predicted_iteration_s,
        "measured_iteration_s": measured,
        "measured_vs_predicted": measured / predicted_iteration_s if predicted_iteration_s else None,
        # a step's tokens over the iteration, measured and as predicted here (at this run's --wan-scale)
        "tokens_per_s_measured": tokens / measured if measured else None,
        "tokens_per_s_predicted": tokens / predicted_iteration_s if predicted_iteration_s else None,
        # the simulator again with this run's own compute times (agents.runfolder.predict.replay): what is left
        # of measured/predicted once the calibration's compute is out of it
        "replayed_iteration_s": replayed_iteration_s,
        "measured_vs_replayed": measured / replayed_iteration_s if replayed_iteration_s else None,
        # the prediction with the separate calibration's stage times, where the agents timed their own in place
        # (agents.stage.in_place): the same as predicted when they did not
        "predicted_iteration_s_calibration_only": calibration_only_iteration_s,
        "measured_vs_predicted_calibration_only": (
            measured / calibration_only_iteration_s if calibration_only_iteration_s else None
        ),
        "predicted_sync_s": predicted_sync_s,
        "measured_sync_s": sync,
        "sync_measured_vs_predicted": sync / predicted_sync_s if predicted_sync_s else None,
        "measured_sync_collective_s": collective,  # without waiting for later replicas (module docstring)
        "sync_collective_measured_vs_predicted": collective / predicted_sync_s if predicted_sync_s else None,
        "bubble_fraction_measured": steady([s["bubble_fraction"] for s in per_step]),
        "bubble_fraction_predicted": predicted_bubble_fraction,
        "wan_bytes": dict(wan_bytes or {}),
        "layout": {
            "stages": [{"dc": dc, "layers": list(lay)} for dc, lay in zip(layout.stage_dcs, layout.stage_layers)],
            "dp": layout.dp,
            "pipelines": [list(layout.stage_dcs), *(list(dcs) for dcs in layout.extra_pipelines)],  # each one's DCs
            "replicas": layout.replicas,  # of every stage, over all pipelines
            "ranks": len(layout.roles),
            "schedule": layout.job.schedule,
            "tensor_parallel": layout.job.tp,
            "zero": layout.job.zero,
            "microbatches": schedule.num_microbatches,
            "wan_compression": {f"{a}-{b}": codec for (a, b), codec in getattr(layout, "compression", {}).items()},
        },
        "per_step": per_step,
        "memory": memory_rows(layout, reports),
    }
    report["wan_bytes_uncompressed"] = _uncompressed(report, layout.job.bytes_per_element)  # an estimate
    ratios = [row["measured_peak_bytes"] / row["predicted_bytes"] for row in report["memory"] if row["predicted_bytes"]]
    report["memory_measured_vs_predicted_max"] = max(ratios, default=None)
    report.update(extra or {})
    return report


def memory_rows(layout: Any, reports: Mapping[int, list[StepReport]]) -> list[dict[str, Any]]:
    """Per rank: the most memory any step held (:class:`~agents.stage.memory.MemoryMeter`) and the
    planner's prediction for its stage (:func:`agents.stage.schedule.predicted_stage_bytes`)."""
    from agents.stage.schedule import predicted_stage_bytes

    rows = []
    for role in layout.roles:
        measured = [r.memory for r in reports.get(role.rank, []) if r.memory]
        if not measured:
            continue
        predicted = predicted_stage_bytes(layout, role)
        row = {
            "rank": role.rank,
            "stage": role.stage,
            "measured_peak_bytes": max(m["peak_bytes"] for m in measured),
            "measured_state_bytes": max(m["state_bytes"] for m in measured),
            "predicted_bytes": predicted,
        }
        cuda = [m["cuda_max_allocated_bytes"] for m in measured if "cuda_max_allocated_bytes" in m]
        if cuda:
            row["cuda_max_allocated_bytes"] = max(cuda)
        rows.append(row)
    return rows


def _schedule(layout: Any) -> Any:
    from agents.stage.schedule import job_schedule

    return job_schedule(layout.job, layout.num_stages, layout.replicas, layout.stage_warmup)


def write_loss_png(
    steps: list[int], losses: list[float], path: str | os.PathLike[str], rates: Mapping[int, float] | None = None
) -> Path:
    """A loss-per-step line chart (Agg canvas, no pyplot state); ``rates`` (step -> learning rate), when they
    change over the run (a warm-up or decay), dashed on a second axis."""
    from geosched.schedule.plot import matplotlib_config_folder

    matplotlib_config_folder()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(steps, losses, marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    ax.grid(True, alpha=0.3)
    if rates and len(set(rates.values())) > 1:
        lr = ax.twinx()
        lr.plot(sorted(rates), [rates[s] for s in sorted(rates)], linestyle="--", color="tab:orange")
        lr.set_ylabel("learning rate", color="tab:orange")
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)


def write_unfinished_report(
    run_dir: str | os.PathLike[str],
    exc: BaseException,
    recoveries: list[dict[str, Any]] | None = None,
    known: dict[str, Any] | None = None,
) -> Path | None:
    """``report.json`` of a run that did not finish: its ``outcome`` (``stopped`` by an operator, ``interrupted``,
    ``failed``), the ``error`` line, the steps every rank completed, with their losses (and ``loss.png``), over
    every attempt of an elastic run (``attempt-<n>/``; a step redone after a recovery counts once, as last run),
    and its ``recoveries``, with what the caller ``known`` (its wall time, the agents' exit codes, prefill); no
    prediction, no timeline. Written from the rank files, whatever state the run is in; None (and a warning) if even
    that cannot be written (a full disk)."""
    try:
        return _write_unfinished(run_dir, exc, recoveries, known or {})
    except Exception as error:  # noqa: BLE001 - the run's own failure is what the caller reports
        log.warning("%s: report.json of the unfinished run not written: %s", run_dir, error)
        return None


def outcome_of(exc: BaseException) -> dict[str, str]:
    """The ``outcome`` (``stopped`` by 'geosched job stop', ``interrupted``: Ctrl-C, SIGTERM, SIGHUP; ``failed``)
    and the ``error`` line of a run that ``exc`` ended early."""
    outcome = (
        "stopped" if isinstance(exc, JobStopped) else "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
    )
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return {"outcome": outcome, "error": "interrupted" if text == "KeyboardInterrupt" else text}


def _completed_steps(folder: Path) -> dict[int, tuple[float | None, float | None]]:
    """Step -> (loss, learning rate) of every step all of ``folder``'s ranks completed."""
    reports = load_rank_reports(folder)
    by_step = reports_by_step(reports)
    last_stage = max((r.stage for rs in reports.values() for r in rs), default=0)
    done = sorted(s for s, rs in by_step.items() if len(rs) == len(reports))
    return {
        s: (
            global_loss(r for r in by_step[s] if r.stage == last_stage),
            next((r.lr for r in by_step[s] if r.lr is not None), None),
        )
        for s in done
    }


def every_attempt(run_dir: str | os.PathLike[str]) -> dict[str, list[Any]]:
    """The ``steps`` every rank completed, their ``losses`` and learning rates (``lr``) over every attempt of a
    run (``attempt-<n>/`` of an elastic run, then the folder itself; a step redone after a recovery counts
    once, as last run)."""
    run, done = Path(run_dir), {}
    attempts = sorted(run.glob("attempt-*"), key=lambda p: int(p.name[8:]) if p.name[8:].isdigit() else 0)
    for folder in [*attempts, run]:  # a later attempt's run of a step wins
        done.update(_completed_steps(folder))
    steps = sorted(done)
    return {"steps": steps, "losses": [done[s][0] for s in steps], "lr": [done[s][1] for s in steps]}


def _write_unfinished(run_dir: str | os.PathLike[str], exc: BaseException, recoveries: Any, known: Any) -> Path:
    run = Path(run_dir)
    history = every_attempt(run)
    steps, losses = history["steps"], history["losses"]
    report: dict[str, Any] = {
        **outcome_of(exc),
        "steps": steps,
        "losses": losses,
        **({"recoveries": recoveries} if recoveries else {}),
        **known,
    }
    known = [loss for loss in losses if loss is not None]
    if steps and len(known) == len(steps):
        report["loss_png"] = str(write_loss_png(steps, known, run / "loss.png", _rates_of({"history": history})))
    write_atomically(str(run / "report.json"), json.dumps(report, indent=2, allow_nan=True))  # never seen half-done
    return run / "report.json"


def write_run_folder(
    run_dir: str | os.PathLike[str],
    layout: Any,
    reports: Mapping[int, list[StepReport]],
    report: dict[str, Any],
    predicted_timeline: Any | None = None,
) -> dict[str, str]:
    """Write report.json and the pictures into ``run_dir``; return {what: path}."""
    from geosched.schedule import write_chrome_trace, write_timeline_png, write_timelines_png

    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    last = report["steps"][-1]
    pipeline = [r for rs in reports.values() for r in rs if r.step == last and r.replica == 0]
    timeline = measured_timeline(_schedule(layout), pipeline, layout.stage_dcs)
    measured_title = f"measured, step {last}: {_figures(timeline)}"
    rates = _rates_of(report)
    written = {
        "timeline": str(write_timeline_png(timeline, run / "timeline.png", title=measured_title)),
        "trace": str(write_chrome_trace(timeline, run / "trace.json")),
        "loss": str(write_loss_png(*_history_of(report), run / "loss.png", rates)),  # every attempt's steps
    }
    if predicted_timeline is not None:
        by_step = reports_by_step(reports)
        complete = {step: by_step[step] for step in report["steps"]}  # in step order
        times = wan_message_times(layout, _schedule(layout), complete, predicted_timeline)
        if times:
            report["wan_messages"] = times
        predicted_title = f"predicted: {_figures(predicted_timeline)}"
        written["predicted"] = str(write_timeline_png(predicted_timeline, run / "predicted.png", title=predicted_title))
        written["timelines"] = str(
            write_timelines_png(
                [(predicted_timeline, predicted_title), (timeline, measured_title)], run / "timelines.png"
            )
        )
    report["files"] = {**report.get("files", {}), **written}
    write_atomically(str(run / "report.json"), json.dumps(report, indent=1))  # a watcher never reads half of it
    return {**written, "report": str(run / "report.json")}


def _history_of(report: Mapping[str, Any]) -> tuple[list[int], list[float]]:
    """The steps and losses ``loss.png`` shows: an elastic run's ``history`` (every attempt), else its own."""
    history = report.get("history") or report
    pairs = [(s, x) for s, x in zip(history["steps"], history["losses"], strict=True) if x is not None]
    return [s for s, _ in pairs], [x for _, x in pairs]


def _rates_of(report: Mapping[str, Any]) -> dict[int, float]:
    """Step -> learning rate for ``loss.png``: an elastic run's ``history`` (every attempt), else ``per_step``."""
    history = report.get("history") or {}
    if "lr" in history:
        return {s: x for s, x in zip(history["steps"], history["lr"], strict=True) if x is not None}
    return {s["step"]: s["lr"] for s in report.get("per_step", []) if s.get("lr") is not None}


LOSS_ROSE = 1.5
"""A run whose last loss is this many times its first diverges (a sane rate never gets there, warm-up included)."""


def loss_rose(losses: list[float | None]) -> float | None:
    """Last loss over first where it is at least :data:`LOSS_ROSE` (or not finite), else None."""
    finite = [x for x in losses if x is not None and math.isfinite(x)]
    if not finite or finite[0] <= 0:
        return None
    last = losses[-1] if losses[-1] is not None else finite[-1]
    ratio = last / finite[0] if math.isfinite(last) else math.inf
    return ratio if ratio >= LOSS_ROSE else None


def _rose_line(report: Mapping[str, Any]) -> str:
    lr = next((s["lr"] for s in reversed(report.get("per_step", [])) if s.get("lr") is not None), None)
    return (
        f"WARNING: the loss rose {report['loss_rose']:,.0f}x over the run: training diverges; lower "
        f"job.learning_rate{f' ({lr:g} at the last step)' if lr is not None else ''} or warm it up "
        "(job.lr_warmup_steps)"
    )


def _figures(timeline: Any) -> str:
    return f"iteration {timeline.iteration_s * 1e3:.1f} ms, bubble {timeline.bubble_fraction:.1%}"


def report_text(report: Mapping[str, Any]) -> str:
    """A short human summary of a report."""
    predicted = report.get("predicted_iteration_s")
    steps, losses = _history_of(report)  # an elastic run's every attempt: the whole run, not its last plan's
    steps, losses = (steps, losses) if steps else (report["steps"], report["losses"])
    plans = f" over {len(report['recoveries']) + 1} plans" if report.get("history") and report.get("recoveries") else ""
    lines = [
        f"steps {steps[0]}-{steps[-1]}{plans}: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
        + (f" ({len(skipped)} skipped: fp16 overflow)" if (skipped := report.get("skipped_steps")) else ""),
        *([_rose_line(report)] if report.get("loss_rose") else []),
        f"iteration: measured {report['measured_iteration_s'] * 1e3:.1f} ms"
        + (
            f", predicted {predicted * 1e3:.1f} ms (measured/predicted {report['measured_vs_predicted']:.2f}"
            + ("; uncalibrated: from the config's GPUs and links" if report.get("calibrated") is False else "")
            + ")"
            if predicted
            else ""
        )
        + (
            f"; with the calibration's stage times {report['predicted_iteration_s_calibration_only'] * 1e3:.1f} ms"
            f" (measured/that {report['measured_vs_predicted_calibration_only']:.2f})"
            if report.get("predicted_iteration_s_calibration_only")
            and report["predicted_iteration_s_calibration_only"] != predicted
            else ""
        )
        + (
            f"; with this run's own compute times {report['replayed_iteration_s'] * 1e3:.1f} ms "
            f"(measured/replayed {report['measured_vs_replayed']:.2f})"
            if report.get("replayed_iteration_s")
            else ""
        ),
        f"bubbles: measured {100 * report['bubble_fraction_measured']:.1f}%"
        + (
            f", predicted {100 * report['bubble_fraction_predicted']:.1f}%"
            if report.get("bubble_fraction_predicted") is not None
            else ""
        ),
    ]
    predicted_sync = report.get("predicted_sync_s")
    if report.get("layout", {}).get("replicas", 2) > 1 and (report.get("measured_sync_s") or predicted_sync):
        lines.append(_sync_line(report, predicted_sync))  # none without data parallelism: nothing to sync
    codecs = report.get("layout", {}).get("wan_compression", {})
    uncompressed = report.get("wan_bytes_uncompressed") or {}
    for link, nbytes in sorted(report.get("wan_bytes", {}).items()):
        codec = codecs.get(_link_of(link))
        whole = f"; about {uncompressed[link] / 1e6:.2f} MB uncompressed" if link in uncompressed else ""
        lines.append(f"WAN {link}: {nbytes / 1e6:.2f} MB" + (f" ({codec}{whole})" if codec else ""))
    lines += message_lines(report.get("wan_messages", {}))
    rows = report.get("memory") or []
    if rows:
        peak = max(rows, key=lambda row: row["measured_peak_bytes"])
        lines.append(
            f"memory: peak {peak['measured_peak_bytes'] / 2**20:.1f} MiB (rank {peak['rank']}), predicted "
            f"{peak['predicted_bytes'] / 2**20:.1f} MiB; measured/predicted at most "
            f"{report['memory_measured_vs_predicted_max']:.2f} over {len(rows)} ranks"
        )
    return "\n".join(lines)
