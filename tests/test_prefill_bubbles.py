"""Prefill inside the bubbles of a real 2-stage pipeline (StageRuntime + WanLink on loopback).

With ten times the bubble capacity of prefill load, training loses nothing
(losses equal to the run without prefill), every request is answered ok,
rejected or expired, the counts add up, and queue and KV memory stay bounded.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from agents.prefill.client import PrefillClient
from agents.prefill.service import PrefillService
from agents.stage.report import StepReport
from agents.stage.runtime import StageRuntime
from agents.stage.schedule import job_schedule
from agents.stage.transport import LinkTransport, link_id
from agents.wan.config import WanLinkConfig
from agents.wan.link import WanLink
from geosched.config import JobSpec, ModelSpec
from geosched.data import TextDataset
from geosched.errors import LinkError
from geosched.model import build_model, build_stage
from geosched.optim import MasterAdamW
from geosched.reference import train_one_process

pytestmark = pytest.mark.slow

MODEL = ModelSpec(layers=4, hidden=32, heads=4, seq_len=32)
JOB = JobSpec(model=MODEL, global_batch=8, microbatch_size=2, precision="fp32", seed=5, learning_rate=2e-3)
STEPS = 30
PROMPT = 32
MAX_QUEUE = 8
MAX_KV = 6 * PROMPT * 2 * MODEL.layers * MODEL.hidden * 4  # KV of 6 full prompts


DATASET = dict(seq_len=MODEL.seq_len, seed=JOB.seed)  # the ``dataset`` fixture's cut of the corpus (conftest.py)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def train(dataset: TextDataset, fillers: list[PrefillService | None]) -> list[list[StepReport]]:
    """Both stages for STEPS steps in two threads over a loopback WanLink; reports per stage."""
    config = WanLinkConfig(link_id=link_id(0, 0), streams=1, connect_timeout_s=10)
    listener = WanLink.listen("tcp://127.0.0.1:0", config)
    connector = WanLink.connect(f"tcp://127.0.0.1:{listener.port}", config)
    try:
        schedule = job_schedule(JOB, 2, 1)
        runtimes = []
        for stage, link in ((0, connector), (1, listener)):
            start, end = (0, 2) if stage == 0 else (2, 4)
            module = build_stage(MODEL, start, end, first=stage == 0, last=stage == 1, seed=JOB.seed)
            runtimes.append(
                StageRuntime(
                    module,
                    schedule,
                    stage,
                    transport=LinkTransport({1 - stage: link}, stage=stage),
                    optimizer=MasterAdamW(module.parameters(), lr=JOB.learning_rate),
                    bubble_filler=fillers[stage],
                    max_grad_norm=JOB.max_grad_norm,  # as the reference clips
                )
            )
        m = runtimes[0].num_microbatches

        def drive(runtime: StageRuntime) -> list[StepReport]:
            reports = []
            for step in range(STEPS):
                report = runtime.run_step(step, dataset.batch(step, 0, 1, JOB.microbatch_size, m))
                if runtime.bubble_filler is not None:
                    runtime.bubble_filler.record_step(report.busy_s, report.iteration_s)
                reports.append(report)
            runtime.transport.flush(10)
            return reports

        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(drive, rt) for rt in runtimes]
            return [f.result(timeout=300) for f in futures]
    finally:
        connector.close()
        listener.close()


class LoadGenerator:
    """Sends bursts of prompts to a service at a token rate and collects every answer."""

    def __init__(self, endpoint: str, tokens_per_s: float) -> None:
        self.endpoint = endpoint
        self.tokens_per_s = tokens_per_s
        self.sent: set[str] = set()
        self.answers: dict[str, str] = {}
        self.peak_queue = 0
        self.peak_kv = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        gen = torch.Generator().manual_seed(3)
        with PrefillClient(self.endpoint, timeout_s=10) as client:
            owed = 0.0
            while not self.stop.is_set():
                owed += self.tokens_per_s * 0.05
                while owed >= PROMPT:
                    owed -= PROMPT
                    prompt = torch.randint(0, 256, (PROMPT,), generator=gen)
                    self.sent.add(client.submit(prompt, deadline_s=1.0, return_kv=len(self.sent) % 4 == 0))
                end = time.monotonic() + 0.05
                while (left := end - time.monotonic()) > 0:
                    try:
                        answer = client.receive(left)
                    except LinkError:
                        break
                    self.answers[answer.id] = answer.status
            while len(self.answers) < len(self.sent):  # every request gets its answer (queued ones expire)
                answer = client.receive(10)
                self.answers[answer.id] = answer.status


def test_ten_times_the_bubble_capacity_is_answered_and_training_is_unchanged(dataset):
    reference = train(dataset, [None, None])
    reference_losses = [r.loss for r in reference[1]]
    assert reference_losses == pytest.approx(train_one_process(JOB, dataset, STEPS), rel=1e-5)

    models = [build_model(MODEL, seed=1).eval() for _ in range(2)]
    with (
        PrefillService(models[0], max_queue=MAX_QUEUE, max_kv_bytes=MAX_KV) as s0,
        PrefillService(models[1], max_queue=MAX_QUEUE, max_kv_bytes=MAX_KV) as s1,
    ):
        services = [s0, s1]
        bubble_share = sum(r.idle_s for r in reference[1]) / sum(r.iteration_s for r in reference[1])
        loads = [LoadGenerator(s.endpoint, 10 * bubble_share / s.sec_per_token) for s in services]
        for load in loads:
            load.thread.start()
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                for load, service in zip(loads, services):
                    m = service.metrics()
                    load.peak_queue = max(load.peak_queue, m["queue_len"])
                    load.peak_kv = max(load.peak_kv, m["kv_reserved_bytes"])
                time.sleep(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            with_prefill = train(dataset, services)
        finally:
            for load in loads:
                load.stop.set()
            for load in loads:
                load.thread.join(30)
            sampling.set()
            sampler.join(5)
        metrics = [s.metrics() for s in services]

    assert [r.loss for r in with_prefill[1]] == reference_losses  # bit-identical training
    assert len(with_prefill[0]) == len(with_prefill[1]) == STEPS
    for load, m in zip(loads, metrics):
        assert not load.thread.is_alive() and load.sent
        assert set(load.answers) == load.sent  # no request went unanswered
        statuses = list(load.answers.values())
        assert set(statuses) <= {"ok", "rejected", "expired"}
        assert statuses.count("ok") + statuses.count("rejected") + statuses.count("expired") == len(load.sent)
        assert (m["ok"], m["rejected"], m["expired"]) == tuple(statuses.count(s) for s in ("ok", "rejected", "expired"))
        assert m["received"] == len(load.sent) and m["rejected"] > 0  # overload is turned away, not queued
        assert load.peak_queue <= MAX_QUEUE + 1 and load.peak_kv <= MAX_KV  # + 1: the prompt being computed
        assert m["kv_reserved_bytes"] == 0 and m["queue_len"] == 0
    assert sum(m["ok"] for m in metrics) > 0 and sum(m["prefill_in_bubbles_s"] for m in metrics) > 0
    prefill_events = [e for reports in with_prefill for r in reports for e in r.events if e.category == "prefill"]
    assert prefill_events and all(e.kind == "PREFILL" for e in prefill_events)
    for reports in with_prefill:  # prefill chunks sit in bubbles: the stage's events never overlap
        for r in reports:
            for before, after in zip(r.events, r.events[1:]):
                assert before.end <= after.start + 1e-9
