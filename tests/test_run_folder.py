"""The run folder without processes: pictures (predicted above measured, link rows), the coordinator's
recorder (metrics -> report.json and pictures), endpoints.json.

The measured step reports are cut from the simulated timeline of the tiny two-DC job, one per stage, as the
runtime would time them (the recorder and the report are pure logic; the real agents behind them are
exercised in test_agent_control.py and test_launch.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
from agent_helpers import TINY_CONFIG

from agents.control.messages import MetricsMessage, StatusMessage
from agents.layout import layout_plan_text, parse_layout
from agents.runfolder.messages import message_lines, wan_message_times
from agents.runfolder.predict import predict, replay, sync_seconds, with_stages_timed_in_place
from agents.runfolder.record import RunRecorder, endpoints_hook, load_metrics_reports
from agents.runfolder.report import build_report, collective_sync_s, loss_rose, report_text
from agents.stage.in_place import write_stage_time
from agents.stage.report import StepReport, measured_timeline
from agents.stage.schedule import job_schedule
from agents.worker import metrics_record
from geosched.calibration import Calibration, StageTime
from geosched.compression import wire_ratio
from geosched.config import config_from_dict
from geosched.schedule import timelines_figure
from geosched.schedule.plot import COLOURS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def job():
    """The tiny job over us -> eu with dp 2 (4 ranks), its prediction, and three steps of step reports."""
    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"], dp=2))
    predicted = predict(layout)
    return layout, predicted, _reports_from(predicted, layout)


def _reports_from(timeline, layout, forward_scale: float = 1.0) -> dict[int, list[StepReport]]:
    """Three steps per rank whose events and bubbles are ``timeline``'s, every F ``forward_scale`` times as
    long."""
    reports: dict[int, list[StepReport]] = {}
    for role in layout.roles:
        events = [
            e._replace(end=e.start + (e.end - e.start) * (forward_scale if e.kind == "F" else 1.0))
            for e in timeline.events
            if e.stage == role.stage
        ]
        gaps = [g for g in timeline.idle_gaps if g.stage == role.stage]
        for step in range(3):
            reports.setdefault(role.rank, []).append(
                StepReport.from_events(
                    step=step,
                    stage=role.stage,
                    replica=role.replica,
                    loss=5.0 - step if role.last else None,
                    iteration_s=timeline.iteration_s,
                    started_at=1000.0 + 10 * step,
                    events=events,
                    idle_gaps=gaps,
                    bytes_sent={1 - role.stage: 1000},
                    memory={"peak_bytes": 2000, "state_bytes": 1000},
                )
            )
    return reports


def test_predicted_and_measured_share_one_figure_with_link_rows_in_both(job) -> None:
    layout, predicted, reports = job
    schedule = job_schedule(layout.job, layout.num_stages, layout.replicas)
    measured = measured_timeline(schedule, [r[-1] for r in reports.values() if r[-1].replica == 0], layout.stage_dcs)
    assert {u.link for u in measured.links} == {("us", "eu"), ("eu", "us")}
    fig = timelines_figure([(predicted, "predicted"), (measured, "measured")])
    top, bottom = fig.axes
    assert top.get_title(loc="left") == "predicted" and bottom.get_title(loc="left") == "measured"
    for ax in (top, bottom):
        rows = [label.get_text() for label in ax.get_yticklabels()]
        assert rows == ["stage 0", "stage 1", "link eu -> us", "link us -> eu"], rows
        assert {t.get_text() for t in ax.texts} >= {"0", "1"}  # microbatch numbers on the wide blocks
    assert top.get_shared_x_axes().joined(top, bottom) and top.get_xlim() == bottom.get_xlim()
    assert len({colour for colour, _ in COLOURS.values()}) == len(COLOURS)  # every category its own colour


def test_recorder_writes_the_run_folder_from_metrics(job, tmp_path: Path) -> None:
    layout, predicted, reports = job
    run = tmp_path / "run"
    recorder = RunRecorder(run, layout)
    ready = {r.rank: StatusMessage(r.rank, "ready", dc=r.dc, stage=r.stage, replica=r.replica) for r in layout.roles}
    for rank, status in ready.items():
        status.extra["endpoints"] = {f"pipe/s{status.stage}/r{status.replica}": f"tcp://127.0.0.1:{5000 + rank}"}
    assert asyncio.run(recorder.ready(ready)) == {}
    endpoints = json.loads((run / "endpoints.json").read_text())
    assert endpoints["ranks"]["3"]["endpoints"] == {"pipe/s1/r1": "tcp://127.0.0.1:5003"}
    assert endpoints["ranks"]["3"]["dc"] == "eu"
    for step in range(3):
        for role in layout.roles:
            step_report = reports[role.rank][step]
            if step == 1:  # as fp16 reports a step every stage skipped
                step_report = dataclasses.replace(step_report, loss_scale=1024.0, skipped=True)
            record = metrics_record(step_report, role)
            assert ("events" in record) == (role.replica == 0)  # only the drawn pipeline sends its events
            recorder.record(MetricsMessage(role.rank, step, values=record))
    report = recorder.finish(predicted)
    assert report == json.loads((run / "report.json").read_text())
    assert report["steps"] == [0, 1, 2] and report["losses"] == [5.0, 4.0, 3.0]
    assert report["measured_iteration_s"] == pytest.approx(predicted.iteration_s)
    tokens = layout.job.global_batch * layout.job.model.seq_len  # a step's: the plan's tokens_per_s counts these
    assert report["tokens_per_s_measured"] == pytest.approx(tokens / predicted.iteration_s)
    assert report["tokens_per_s_predicted"] == pytest.approx(tokens / predicted.iteration_s)  # the simulated run
    assert [s["skipped"] for s in report["per_step"]] == [False, True, False]  # step 1: every stage skipped it
    assert (report["layout"]["tensor_parallel"], report["layout"]["zero"]) == (layout.job.tp, layout.job.zero)
    assert report["layout"]["pipelines"] == [list(layout.stage_dcs)] and report["layout"]["replicas"] == 2
    assert report["bubble_fraction_measured"] == pytest.approx(predicted.bubble_fraction, abs=1e-6)
    assert report["predicted_sync_s"] == sync_seconds(predicted) > 0  # the stages' ALL_REDUCE, dp 2
    assert report["measured_sync_s"] == pytest.approx(report["predicted_sync_s"])
    assert report["measured_sync_collective_s"] == pytest.approx(report["predicted_sync_s"])  # replicas in step
    sync_line = next(line for line in report_text(report).splitlines() if line.startswith("gradient sync:"))
    assert sync_line.startswith("gradient sync: the collective") and "(measured/predicted 1.00)" in sync_line
    assert sync_line.endswith(f"reach it later {report['measured_sync_s'] * 1e3:.1f} ms")
    alone = {**report, "layout": {**report["layout"], "replicas": 1}}  # dp 1: no sync to speak of (a trial: 0.0 ms)
    assert not any(line.startswith("gradient sync:") for line in report_text(alone).splitlines())
    assert report["skipped_steps"] == [1] and "loss 5.0000 -> 3.0000 (1 skipped: fp16 overflow)" in report_text(report)
    assert report["loss_rose"] is None and "WARNING" not in report_text(report)  # falling: nothing to say
    iteration = next(line for line in report_text({**report, "calibrated": False}).splitlines() if "iteration" in line)
    assert "(measured/predicted 1.00; uncalibrated: from the config's GPUs and links)" in iteration, iteration
    assert report["wan_bytes"] == {"us->eu": 6000, "eu->us": 6000}
    for step, row in enumerate(report["per_step"]):  # each step's WAN bytes, as the agents' metrics count them
        wan = sum(metrics_record(reports[r.rank][step], r)["wan_bytes"] for r in layout.roles)
        assert row["wan_bytes"] == wan and 0 < wan <= row["bytes_sent"], (row, wan)
    for name in ("timeline.png", "predicted.png", "timelines.png", "loss.png"):
        assert (run / name).read_bytes().startswith(PNG_MAGIC), name
    trace = json.loads((run / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {"link us -> eu", "link eu -> us"} <= names
    assert set(load_metrics_reports(run / "metrics.jsonl")) == {0, 1, 2, 3}
    rows = report["wan_messages"]["by_link"]  # the coordinator has the events of replica 0's pipeline only
    assert set(rows) == {"us->eu", "eu->us"} and all([row["replica"] for row in r] == [0] for r in rows.values())
    assert "WAN us->eu messages (median): replica 0" in report_text(report)


def test_a_compressed_links_report_says_what_its_bytes_would_have_been(job) -> None:
    layout, predicted, reports = job
    wan = {"us->eu": 3_000_000, "eu->us": 3_000_000}
    plain = build_report(layout, reports, predicted_iteration_s=predicted.iteration_s, wan_bytes=wan)
    assert plain["wan_bytes_uncompressed"] == {} and "uncompressed" not in report_text(plain)
    compressed = dataclasses.replace(layout, compression={("eu", "us"): "int8"})
    report = build_report(compressed, reports, predicted_iteration_s=predicted.iteration_s, wan_bytes=wan)
    whole = round(3e6 / wire_ratio(layout.job.bytes_per_element, "int8"))  # fp32 activations: 1 byte + scales
    assert report["wan_bytes_uncompressed"] == {"us->eu": whole, "eu->us": whole} and whole > 3.5 * 3e6
    assert f"WAN us->eu: 3.00 MB (int8; about {whole / 1e6:.2f} MB uncompressed)" in report_text(report)


def test_each_wan_message_is_timed_against_the_simulator_per_replica(job) -> None:
    layout, predicted, reports = job
    schedule = job_schedule(layout.job, layout.num_stages, layout.replicas)
    by_step = {step: [r[step] for r in reports.values()] for step in range(3)}
    times = wan_message_times(layout, schedule, by_step, predicted)
    m = schedule.num_microbatches
    assert times["step"] == 2 and len(times["last_step"]) == 2 * 2 * m  # F and B of every microbatch, 2 replicas
    for rows in times["by_link"].values():
        assert [row["replica"] for row in rows] == [0, 1]
        for row in rows:  # steps 1 and 2; cut from the prediction, so measured is what the simulator says
            assert row["messages"] == 2 * m and row["measured_vs_predicted"] == pytest.approx(1.0)
    assert message_lines({}) == [] and len(message_lines(times)) == 2


def test_the_recorder_keeps_only_well_formed_reports_of_each_ranks_place_once_a_step(job, tmp_path: Path) -> None:
    """A rank's key signs whatever it sends: one malformed report failed the whole run folder at the end, and a
    flood of large ones filled the coordinator's disk. Such messages are counted and not recorded."""
    layout, predicted, reports = job
    recorder = RunRecorder(tmp_path / "run", layout)
    role = layout.role(1)
    good = metrics_record(reports[1][0], role)
    event = {"stage": role.stage, "action": "0F0", "start": 0, "end": 1, "category": "compute", "kind": "F"}
    bad = [
        {},  # the insider trial's {"rank": 1, "step": 10}
        {**good, "stage": 1 - role.stage},  # another stage's place
        {**good, "iteration_s": float("nan")},
        {**good, "events": [{**event, "action": "x" * 10_000}]},
        {**good, "events": [{**event, "stage": 1 - role.stage}]},
        {**good, "bytes_sent": {"7": 10}},  # no such neighbour
        {**good, "bytes_sent": {"0": -1}},
        {**good, "busy_s": "1"},
    ]
    for values in bad:
        recorder.record(MetricsMessage(1, 0, values=values))
    assert recorder.refused == len(bad)
    for step in range(3):
        for r in layout.roles:
            recorder.record(MetricsMessage(r.rank, step, values=metrics_record(reports[r.rank][step], r)))
    big = {**good, "padding": "x" * 500_000}
    for _ in range(100):  # the same step again, or an earlier one: not recorded
        recorder.record(MetricsMessage(1, 2, values=big))
        recorder.record(MetricsMessage(1, 0, values=big))
    assert recorder.refused == len(bad) + 200
    assert (tmp_path / "run" / "metrics.jsonl").stat().st_size < 100_000
    report = recorder.finish(predicted)
    assert report["steps"] == [0, 1, 2] and report["losses"] == [5.0, 4.0, 3.0]


def test_endpoints_json_carries_the_routes_the_hook_returns(tmp_path: Path) -> None:
    async def relays(statuses: dict[int, StatusMessage]) -> dict[str, str]:
        return {"pipe/s1/r0": "tcp://127.0.0.1:9999"}

    status = StatusMessage(0, "ready", dc="us", extra={"endpoints": {"prefill/r0": "tcp://127.0.0.1:7000"}})
    assert asyncio.run(endpoints_hook(tmp_path, relays)({0: status})) == {"pipe/s1/r0": "tcp://127.0.0.1:9999"}
    written = json.loads((tmp_path / "endpoints.json").read_text())
    assert written["routes"] == {"pipe/s1/r0": "tcp://127.0.0.1:9999"}
    assert written["ranks"]["0"]["endpoints"] == {"prefill/r0": "tcp://127.0.0.1:7000"}
    assert written["coordinator"] == {}  # a coordinator serving no metrics lists none
    coordinator = {"metrics": "https://127.0.0.1:9400/metrics"}
    asyncio.run(endpoints_hook(tmp_path, relays, coordinator)({0: status}))
    assert json.loads((tmp_path / "endpoints.json").read_text())["coordinator"] == coordinator


def test_the_collective_alone_leaves_out_the_wait_for_a_later_replica() -> None:
    def rank(stage: int, replica: int, sync_s: float) -> StepReport:
        return StepReport(0, stage, replica, None, 1.0, 0.5, 0.1, 0.4, 0.0, sync_s=sync_s)

    # replica 0 of each stage reached the all-reduce first and waited for replica 1
    reports = [rank(0, 0, 0.200), rank(0, 1, 0.006), rank(1, 0, 0.150), rank(1, 1, 0.008)]
    assert collective_sync_s(reports) == pytest.approx(0.008)  # the slowest stage's last arrival


def test_replay_feeds_the_run_s_own_compute_times_to_the_simulator() -> None:
    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"], dp=2))
    b = layout.job.batch
    whole = [
        StageTime(a, z, s == 0, s == layout.num_stages - 1, forward_s=0.01 * (s + 1), backward_s=0.02, step_s=0.003)
        for s, (a, z) in enumerate(layout.stage_layers)
    ]
    cal = Calibration("cpu", 1e-4, 2e-4, 1e-5, 2e-5, 1e-5, 2e-5, tflops=1.0, stage_times=tuple(whole))
    predicted = predict(layout, 1.0, cal)
    assert [e.end - e.start for e in predicted.events if e.kind == "F" and e.stage == 1][0] == pytest.approx(0.02 * b)
    assert replay(layout, 1.0, None, _reports_from(predicted, layout)) is None  # nothing to replay against
    # the simulator's own compute times replayed: the same timeline
    same = replay(layout, 1.0, cal, _reports_from(predicted, layout))
    assert same.iteration_s == pytest.approx(predicted.iteration_s)
    # every forward took twice as long as calibrated: the replay is the prediction with doubled forwards
    slow = replay(layout, 1.0, cal, _reports_from(predicted, layout, forward_scale=2.0))
    doubled = tuple(dataclasses.replace(t, forward_s=2 * t.forward_s) for t in whole)
    expected = predict(layout, 1.0, dataclasses.replace(cal, stage_times=doubled))
    assert slow.iteration_s == pytest.approx(expected.iteration_s) and slow.iteration_s > predicted.iteration_s


def test_stage_times_the_agents_took_in_place_price_the_prediction(tmp_path: Path) -> None:
    layout = parse_layout(layout_plan_text(config_from_dict(TINY_CONFIG), ["us", "eu"], dp=2))
    last = layout.num_stages - 1
    whole = [
        StageTime(a, z, s == 0, s == last, forward_s=0.01, backward_s=0.02, dp=2, step_s=0.003, sync_s=0.004)
        for s, (a, z) in enumerate(layout.stage_layers)
    ]
    cal = Calibration("cpu", 1e-4, 2e-4, 1e-5, 2e-5, 1e-5, 2e-5, tflops=1.0, stage_times=tuple(whole))
    assert with_stages_timed_in_place(layout, None, tmp_path) is None
    # no agent timed its stage: the calibration as it was
    assert with_stages_timed_in_place(layout, cal, tmp_path) is cal

    def record(stage: int, layers: tuple[int, int], forward_s: float) -> dict:
        split = {"input_backward_s": None, "weight_backward_s": None}
        return {"stage": stage, "layers": list(layers), "first": stage == 0, "last": stage == last, "tp": 1,
                "forward_s": forward_s, "backward_s": 0.02, **split}  # fmt: skip

    a, z = layout.stage_layers[last]
    records = [record(last, (a, z), 0.25), record(last, (a, z), 0.75), record(last, (a, z - 1), 9.0)]
    for rank, rec in enumerate(records):  # two replicas timed the last stage; the third entry is another stage
        write_stage_time(tmp_path, rank, rec)
    bad = {"stage": 0, "layers": list(layout.stage_layers[0]), "tp": 1, "forward_s": "fast", "backward_s": 0.1}
    (tmp_path / "stage-rank7.json").write_text(json.dumps(bad))
    (tmp_path / "stage-rank8.json").write_text("{not json")
    timed = with_stages_timed_in_place(layout, cal, tmp_path)  # the two files no agent wrote: left out, warned
    expected = tuple(dataclasses.replace(t, forward_s=0.5) if t.last else t for t in whole)  # the median
    assert timed.stage_times == expected  # the ALL_REDUCE and STEP stay the calibration's (measured at dp 2)
    assert predict(layout, 1.0, timed).iteration_s > predict(layout, 1.0, cal).iteration_s


def test_a_loss_that_rises_by_half_over_the_run_is_called_diverging(job, tmp_path: Path) -> None:
    """fp32 at a learning rate of 10 never overflows: a trial's run ended 'loss 5.5552 -> 7015.3325' and
    nothing else said that it diverged."""
    layout, predicted, reports = job
    recorder = RunRecorder(tmp_path / "run", layout)
    for step, loss in enumerate([5.5, 7097.2, 7015.3]):
        for role in layout.roles:
            rose = reports[role.rank][step]
            rose = dataclasses.replace(rose, loss=None if rose.loss is None else loss, lr=10.0)
            recorder.record(MetricsMessage(role.rank, step, values=metrics_record(rose, role)))
    report = recorder.finish(predicted)
    assert report["loss_rose"] == pytest.approx(7015.3 / 5.5)
    warning = next(line for line in report_text(report).splitlines() if line.startswith("WARNING"))
    assert warning.startswith("WARNING: the loss rose 1,276x over the run: training diverges")
    assert "lower job.learning_rate (10 at the last step)" in warning
    assert loss_rose([5.5, 5.0, 8.0]) is None and loss_rose([5.5, 4.0, 8.3]) == pytest.approx(8.3 / 5.5)
    assert loss_rose([5.5, float("nan")]) == float("inf") and loss_rose([None, 5.0]) is None
