"""The stage runtime on a real 2-stage pipeline: two stages in two threads joined by a real WanLink on
loopback, checked against a one-process run, plus the measured timeline and its views."""

from __future__ import annotations

import contextlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from agents.stage.report import StepReport, global_loss, measured_timeline
from agents.stage.runtime import StageRuntime
from agents.stage.schedule import job_schedule
from agents.stage.transport import LinkTransport
from agents.wan.link import WanLink
from geosched.config import JobSpec, ModelSpec
from geosched.data import TextDataset
from geosched.errors import TrainingDiverged
from geosched.model import build_stage
from geosched.optim import MasterAdamW
from geosched.reference import train_one_process
from geosched.schedule import render_grid, write_chrome_trace, write_timeline_png

MODEL = ModelSpec(layers=4, hidden=32, heads=4, seq_len=32)
JOB = JobSpec(model=MODEL, global_batch=8, microbatch_size=2, precision="fp32", seed=5, learning_rate=2e-3)
STEPS = 4
CUT = 2  # stage 0: layers [0, 2), stage 1: [2, 4)


DATASET = dict(seq_len=MODEL.seq_len, seed=JOB.seed)  # the ``dataset`` fixture's cut of the corpus (conftest.py)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_runtime(job: JobSpec, stage: int, link: WanLink, **options) -> StageRuntime:
    start, end = (0, CUT) if stage == 0 else (CUT, MODEL.layers)
    module = build_stage(job.model, start, end, first=stage == 0, last=stage == 1, seed=job.seed)
    schedule = job_schedule(job, 2, 1)
    transport = LinkTransport({1 - stage: link}, stage=stage)
    optimizer = MasterAdamW(module.parameters(), lr=job.learning_rate)
    options.setdefault("max_grad_norm", job.max_grad_norm)  # as the reference clips
    return StageRuntime(module, schedule, stage, transport=transport, optimizer=optimizer, **options)


def run_pipeline(job: JobSpec, dataset: TextDataset, link_pair, steps: int = STEPS) -> list[list[StepReport]]:
    """Both stages for ``steps`` steps, each in its own thread; returns the reports per stage."""
    listener, connector = link_pair
    runtimes = [make_runtime(job, 0, connector), make_runtime(job, 1, listener)]
    m = runtimes[0].num_microbatches

    def drive(runtime: StageRuntime) -> list[StepReport]:
        reports = [runtime.run_step(step, dataset.batch(step, 0, 1, job.microbatch_size, m)) for step in range(steps)]
        runtime.transport.flush(10)
        return reports

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(drive, rt) for rt in runtimes]
        return [f.result(timeout=120) for f in futures]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stage_pipeline_trains_like_one_process(dataset, link_pair, schedule):
    job = JobSpec(**{**JOB.__dict__, "schedule": schedule})
    stage0, stage1 = run_pipeline(job, dataset, link_pair)
    reference = train_one_process(job, dataset, STEPS)
    assert [global_loss([r]) for r in stage1] == pytest.approx(reference, rel=1e-5)
    assert all(r.loss is None for r in stage0)
    m = JOB.global_batch // JOB.microbatch_size
    activation = JOB.microbatch_size * MODEL.seq_len * MODEL.hidden * 4
    assert all(r.bytes_sent == {1: m * activation} for r in stage0)  # activations forward
    assert all(r.bytes_sent == {0: m * activation} for r in stage1)  # their gradients back


def test_measured_timeline_is_well_formed_and_drawable(dataset, link_pair, tmp_path):
    stage0, stage1 = run_pipeline(JOB, dataset, link_pair, steps=2)
    schedule = job_schedule(JOB, 2, 1)
    last = [stage0[-1], stage1[-1]]
    timeline = measured_timeline(schedule, last)

    for s in range(2):
        events = timeline.events_of(s)
        assert [e.action for e in events] == [str(a) for a in schedule.actions[s]]  # every action, in order
        for before, after in zip(events, events[1:]):
            assert 0 <= before.start <= before.end <= after.start + 1e-9  # one action at a time
        assert {e.category for e in events} <= {"compute", "comm", "idle"}
        assert {e.category for e in events if e.kind in ("F", "B", "STEP")} == {"compute"}
        report = last[s]
        assert report.busy_s > 0 and report.iteration_s >= report.busy_s + report.comm_s + report.idle_s - 1e-6
    assert timeline.iteration_s == pytest.approx(max(e.end for e in timeline.events))
    assert all(0 <= st.bubble_fraction < 1 for st in timeline.stages)
    # stage 1 waits for stage 0's first activation: a bubble (in the first step surely; in a later one, unless
    # stage 1 is preempted after its STEP for longer than stage 0 takes for its last B, STEP and first F)
    gaps = [gap for report in stage1 for gap in report.idle_gaps]
    assert gaps and all(g.waiting_for and "RECV" in g.waiting_for for g in gaps)

    grid = render_grid(timeline)
    assert "0F0" in grid and "1B3" in grid
    png = write_timeline_png(timeline, tmp_path / "measured.png", title="measured")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads(write_chrome_trace(timeline, tmp_path / "measured.json").read_text())
    complete = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert len(complete) >= len(timeline.events) - len(timeline.idle_gaps)

    again = StepReport.from_dict(json.loads(json.dumps(last[1].to_dict())))
    assert again == last[1]


def test_poll_says_whether_a_message_has_arrived(link_pair):
    listener, connector = link_pair
    upstream = LinkTransport({1: connector}, stage=0)
    downstream = LinkTransport({0: listener}, stage=1)
    assert not downstream.poll(0, "F", 0, 0)
    sent = torch.arange(12, dtype=torch.float32).view(3, 4)
    upstream.send(sent, 1, "F", 0, 0)
    upstream.flush(10)
    assert downstream.poll(0, "F", 0, 0)
    assert torch.equal(downstream.recv(0, "F", 0, 0, timeout=5), sent)
    assert upstream.bytes_sent() == {1: sent.numel() * 4}


class RecordingTransport(LinkTransport):
    """The real LinkTransport, noting the order of first polls (which post receives) and of receives."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, tuple]] = []

    def poll(self, peer_stage, kind, step, microbatch):
        key = (peer_stage, kind, step, microbatch)
        if ("poll", key) not in self.calls and ("recv", key) not in self.calls:
            self.calls.append(("poll", key))
        return super().poll(peer_stage, kind, step, microbatch)

    def recv(self, peer_stage, kind, step, microbatch, timeout=None):
        self.calls.append(("recv", (peer_stage, kind, step, microbatch)))
        return super().recv(peer_stage, kind, step, microbatch, timeout)


def test_receives_are_posted_before_the_receive_ahead_of_them(dataset, link_pair):
    listener, connector = link_pair
    runtimes = [make_runtime(JOB, 0, connector), make_runtime(JOB, 1, listener)]
    for runtime in runtimes:
        runtime.transport = RecordingTransport(runtime.transport.links, stage=runtime.stage)
    m = runtimes[0].num_microbatches

    def drive(runtime: StageRuntime) -> None:
        runtime.run_step(0, dataset.batch(0, 0, 1, JOB.microbatch_size, m))
        runtime.transport.flush(10)

    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(drive, rt) for rt in runtimes]:
            future.result(timeout=120)
    for runtime in runtimes:
        calls = runtime.transport.calls
        received = [key for what, key in calls if what == "recv"]
        assert len(received) == m  # stage 0: m gradients, stage 1: m activations
        for earlier, later in zip(received, received[1:]):
            # posted (first polled) before the runtime even waited for the receive ahead of it
            assert calls.index(("poll", later)) < calls.index(("recv", earlier)), (earlier, later)


def test_a_non_finite_activation_from_upstream_is_named_when_the_loss_is_nan(dataset, link_pair):
    """A stage that sends NaN activations (a diverged or misbehaving peer) made the last stage report only that
    training diverged; it now says which stage's activation was not finite."""
    listener, connector = link_pair
    upstream, last = make_runtime(JOB, 0, connector), make_runtime(JOB, 1, listener)
    with torch.no_grad():
        next(upstream.module.parameters()).fill_(float("nan"))
    batch = dataset.batch(0, 0, 1, JOB.microbatch_size, last.num_microbatches)

    def run_upstream() -> None:
        with contextlib.suppress(Exception):  # its gradients never come: the links close at the end
            upstream.run_step(0, batch)

    threading.Thread(target=run_upstream, daemon=True).start()
    with pytest.raises(TrainingDiverged, match="the activation stage 0 sent for it is not finite"):
        last.run_step(0, batch)
