"""Zero-bubble ZB-H1 ("zb1p"): the order against torch's, I/W rules in the validator and lowering,
the simulator's verdict against 1F1B, the views, and real pipelines in processes against one process."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import queue
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from agents.layout import RankRole, layout_roles
from agents.stage.report import StepReport, global_loss
from agents.stage.runtime import StageRuntime
from agents.stage.schedule import job_schedule
from agents.stage.session import run_rank
from agents.stage.transport import LinkTransport, StoreAddressBook, link_id
from agents.wan.config import WanLinkConfig
from agents.wan.link import WanLink
from geosched.cli import main
from geosched.config import JobSpec, ModelSpec
from geosched.data import TextDataset, default_corpus_paths
from geosched.errors import ScheduleError
from geosched.model import build_stage
from geosched.optim import MasterAdamW
from geosched.reference import train_one_process
from geosched.schedule import (
    Action,
    ActionKind,
    Schedule,
    UniformCosts,
    build_1f1b,
    build_schedule,
    build_zb1p,
    chrome_trace,
    lower,
    render_grid,
    simulate,
    validate,
    write_timeline_png,
)
from geosched.schedule.plot import COLOURS, colour_key

K = ActionKind


def torch_zb1p_order(num_stages: int, num_microbatches: int) -> dict[int, list[str]]:
    """torch's ZB1P ``pipeline_order`` for one stage per rank, bubbles (None) dropped.

    ``ScheduleInterleavedZeroBubble.__init__`` needs PipelineStage objects on a
    process group, so this sets the attributes its order computation reads and
    runs the same two steps its constructor runs (torch/distributed/pipelining/
    schedules.py: ``_calculate_single_rank_operations`` per rank, then
    ``_add_bubbles_to_actions``, which only inserts None).
    """
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    zb = object.__new__(ScheduleInterleavedZeroBubble)
    zb.n_local_stages, zb.pp_group_size, zb._n_microbatches = 1, num_stages, num_microbatches
    zb.number_of_rounds = max(1, num_microbatches // num_stages)
    zb.microbatches_per_round = num_microbatches // zb.number_of_rounds
    zb.pipeline_order = {rank: zb._calculate_single_rank_operations(rank) for rank in range(num_stages)}
    order = zb._add_bubbles_to_actions(num_stages)
    return {rank: [str(a) for a in acts if a is not None] for rank, acts in order.items()}


@pytest.mark.parametrize("p", range(1, 9))
def test_order_is_torchs_zb1p(p: int) -> None:
    for m in range(1, 17):
        ours = build_schedule("zb1p", p, m)
        assert ours.name == "zb1p"
        assert {s: [str(a) for a in acts] for s, acts in ours.actions.items()} == torch_zb1p_order(p, m), (p, m)


def test_order_of_a_small_case_reads_as_documented() -> None:
    schedule = build_zb1p(3, 4)
    assert " ".join(map(str, schedule.actions[0])) == "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3"
    assert " ".join(map(str, schedule.actions[2])) == "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3"


def test_lowering_treats_i_like_b_and_w_as_local() -> None:
    lowered = lower(build_zb1p(3, 4))
    validate(lowered)
    middle = [str(a) for a in lowered.actions[1]]
    assert middle[middle.index("1I0") - 1] == "1RECV_B0"  # the output gradient from stage 2 first
    assert middle[middle.index("1I0") + 1] == "1SEND_B0"  # then the input gradient to stage 0
    assert not any(middle[i + 1].startswith("1SEND") for i, a in enumerate(middle) if "W" in a)
    for s, acts in lowered.actions.items():
        texts = [str(a) for a in acts]
        assert texts[-2:] == [f"{s}ALL_REDUCE", f"{s}STEP"]
        assert texts[-3] == f"{s}W{lowered.num_microbatches - 1}"  # the sync follows the last W
    first = [str(a) for a in lowered.actions[0]]
    assert not any(t.startswith("0SEND_B") or t.startswith("0RECV_F") for t in first)


def _with_stage(schedule: Schedule, stage: int, texts: str) -> Schedule:
    actions = dict(schedule.actions)
    actions[stage] = [Action.parse(t) for t in texts.split()]
    return Schedule(actions, schedule.num_stages, schedule.num_microbatches, "edited")


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        ("1F0 1W0 1I0 1F1 1I1 1W1", "stage 1: 1W0 runs before 1I0"),
        ("1F0 1I0 1F1 1I1 1W1", "stage 1: 1W0 is missing"),
        ("1F0 1I0 1W0 1B0 1F1 1I1 1W1", "1B0 and 1I0 both present"),
        ("1I0 1F0 1W0 1F1 1I1 1W1", "stage 1: 1I0 runs before 1F0"),
        ("1F0 1I0 1ALL_REDUCE 1W0 1F1 1I1 1W1", "stage 1: 1ALL_REDUCE runs before 1W0"),
    ],
)
def test_validator_rejects_bad_split_backwards(texts: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate(_with_stage(build_zb1p(2, 2), 1, texts))


def test_validator_rejects_a_send_b_before_its_i() -> None:
    lowered = lower(build_zb1p(2, 1))
    bad = "1RECV_F0 1F0 1SEND_B0 1I0 1W0 1ALL_REDUCE 1STEP"
    with pytest.raises(ScheduleError, match=r"stage 1: 1I0 needs 1SEND_B0 after it"):
        validate(_with_stage(lowered, 1, bad))


def test_mixed_b_and_split_backwards_are_valid() -> None:
    validate(lower(_with_stage(build_zb1p(2, 2), 1, "1F0 1B0 1F1 1I1 1W1")))


def test_simulator_prices_i_and_w_and_they_are_compute() -> None:
    costs = UniformCosts(forward_s=1.0, backward_s=2.0, backward_input_s=1.5, backward_weight_s=0.25)
    timeline = simulate(lower(build_zb1p(3, 6)), costs)
    durations = {e.kind: e.end - e.start for e in timeline.events if e.kind in ("I", "W")}
    assert durations == {"I": 1.5, "W": 0.25}
    assert {e.category for e in timeline.events if e.kind in ("I", "W")} == {"compute"}
    assert all(st.busy_s == pytest.approx(6 * (1.0 + 1.5 + 0.25)) for st in timeline.stages)
    assert UniformCosts(backward_s=3.0).compute_s(Action(0, K.BACKWARD_WEIGHT, 0)) == 1.5  # default: B/2
    with pytest.raises(ScheduleError, match="UniformCosts.backward_weight_s"):
        UniformCosts(backward_weight_s=-1.0)


@pytest.mark.parametrize("p", range(2, 7))
def test_zb1p_beats_1f1b_when_i_and_w_are_half_a_b(p: int) -> None:
    costs = UniformCosts(forward_s=1.0, backward_s=2.0)  # I = W = B / 2
    for m in (1, 2, p, 2 * p + 1):
        zero_bubble, one_f_one_b = simulate(lower(build_zb1p(p, m)), costs), simulate(lower(build_1f1b(p, m)), costs)
        assert zero_bubble.iteration_s <= one_f_one_b.iteration_s, (p, m)
        assert zero_bubble.bubble_fraction < one_f_one_b.bubble_fraction, (p, m)
        if m >= p:  # ZB-H1's bubble (Qi et al. 2023, Table 1): (p - 1)(T_F + T_I - T_W)
            assert zero_bubble.iteration_s == pytest.approx(m * 3.0 + (p - 1) * (1.0 + 1.0 - 1.0)), (p, m)


def test_views_show_i_and_w_apart(tmp_path: Path) -> None:
    timeline = simulate(lower(build_zb1p(3, 4)), UniformCosts())
    grid = render_grid(timeline)
    assert "2I0" in grid and "2W0" in grid
    assert len({COLOURS[colour_key(kind, "compute")][0] for kind in ("F", "B", "I", "W")}) == 4
    png = write_timeline_png(timeline, tmp_path / "zb.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    complete = [e for e in chrome_trace(timeline)["traceEvents"] if e.get("ph") == "X" and e["cat"] == "compute"]
    colour_of = {e["args"]["kind"]: e["cname"] for e in complete if e["args"]["kind"] in ("F", "I", "W")}
    assert len(set(colour_of.values())) == 3 and {e["name"] for e in complete} >= {"1I3", "1W3"}


def test_cli_simulates_zb1p(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "zb1p", "--stages", "4", "--microbatches", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["schedule"] == "zb1p"
    assert result["iteration_time_s"] == pytest.approx((8 * 3 + 3 * 1) / 1000)  # 1 ms F, 2 ms B by default


# ---------------------------------------------------------------- the runtime against one process

MODEL = ModelSpec(layers=4, hidden=32, heads=4, seq_len=32)
JOB = JobSpec(
    model=MODEL, global_batch=16, microbatch_size=2, precision="fp32", seed=13, learning_rate=3e-3, schedule="zb1p"
)
STEPS = 4


@pytest.mark.usefixtures("one_torch_thread")
def test_one_stage_zb1p_runtime_trains_like_one_process() -> None:
    """One stage is first and last: I runs the whole backward with B's loss scaling, W is a no-op."""
    dataset = TextDataset(default_corpus_paths(), seq_len=MODEL.seq_len, seed=JOB.seed)
    module = build_stage(MODEL, 0, MODEL.layers, first=True, last=True, seed=JOB.seed)
    optimizer = MasterAdamW(module.parameters(), lr=JOB.learning_rate)
    schedule = job_schedule(JOB, 1, 1)
    runtime = StageRuntime(module, schedule, 0, transport=None, optimizer=optimizer, max_grad_norm=JOB.max_grad_norm)
    m = runtime.num_microbatches
    reports = [runtime.run_step(step, dataset.batch(step, 0, 1, JOB.microbatch_size, m)) for step in range(STEPS)]
    assert [r.loss for r in reports] == pytest.approx(train_one_process(JOB, dataset, STEPS), rel=1e-5)
    assert {e.category for e in reports[-1].events if e.kind in ("I", "W")} == {"compute"}


LAYOUTS = {  # name: (DC per stage, layer range per stage, data-parallel degree, ZeRO stage)
    "2 stages x dp 2": (["us", "eu"], [(0, 2), (2, 4)], 2, 0),
    "2 stages x dp 2 zero 2": (["us", "eu"], [(0, 2), (2, 4)], 2, 2),  # W hands its gradients to the buckets
    "3 stages": (["us", "eu", "ap"], [(0, 1), (1, 3), (3, 4)], 1, 0),
}


def _rank_main(role: RankRole, store_port: int, prefix: str, results: Any, job: JobSpec) -> None:
    """One rank process: train ``STEPS`` zb1p steps over real links and a gloo group; report to the test."""
    try:
        book = StoreAddressBook.connect("127.0.0.1", store_port, prefix=prefix)
        reports = run_rank(
            job,
            role,
            steps=STEPS,
            data=default_corpus_paths(),
            addresses=book,
            threads=1,
            connect_timeout_s=40,
            recv_timeout_s=40,
        )
        results.put((role.rank, [r.to_dict() for r in reports]))
    except BaseException:  # noqa: BLE001 - handed to the test
        results.put((role.rank, traceback.format_exc()))


def run_pipeline(roles: list[RankRole], prefix: str, job: JobSpec = JOB) -> dict[int, list[StepReport]]:
    """Every rank of ``roles`` in its own process; return their reports by rank."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "agents.stage.session", "agents.wan.link", "agents.dp.group"])
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, store.port, prefix, results, job), daemon=True) for r in roles]
    finished = False
    try:
        for proc in procs:
            proc.start()
        runs: dict[int, list[StepReport]] = {}
        for _ in roles:
            try:
                rank, payload = results.get(timeout=150)
            except queue.Empty:
                pytest.fail("zb1p ranks did not report within 150 s")
            assert not isinstance(payload, str), f"rank {rank} failed:\n{payload}"
            runs[rank] = [StepReport.from_dict(d) for d in payload]
        finished = True
        return runs
    finally:
        for proc in procs:
            proc.join(timeout=20 if finished else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
        del store


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_zb1p_pipeline_in_processes_trains_like_one_process(layout: str) -> None:
    stage_dcs, stage_layers, dp, zero = LAYOUTS[layout]
    roles = layout_roles(stage_dcs, stage_layers, dp)
    runs = run_pipeline(roles, prefix=layout.replace(" ", "-"), job=dataclasses.replace(JOB, zero=zero))
    dataset = TextDataset(default_corpus_paths(), seq_len=MODEL.seq_len, seed=JOB.seed)
    reference = train_one_process(JOB, dataset, STEPS)
    last_stage = [role for role in roles if role.last]
    per_step = [global_loss(runs[role.rank][i] for role in last_stage) for i in range(STEPS)]
    assert per_step == pytest.approx(reference, rel=1e-4)
    lowered = job_schedule(JOB, len(stage_dcs), dp)
    for role in roles:  # every rank ran its zb1p actions in order; a W may have run early, in a receive's wait
        for report in runs[role.rank]:
            check_weights_in_order([e.action for e in report.events], [str(a) for a in lowered.actions[role.stage]])


def check_weights_in_order(ran: list[str], scheduled: list[str]) -> int:
    """``ran`` is ``scheduled`` plus Ws run early, each in a receive's wait (before that receive's event, its
    own W's event following as a no-op), and every W in the schedule's order; the count of early Ws."""
    weights = [a for a in scheduled if Action.parse(a).kind is K.BACKWARD_WEIGHT]
    early = {i for i, a in enumerate(ran) if a in weights and a in ran[i + 1 :]}
    assert [a for i, a in enumerate(ran) if i not in early] == scheduled
    assert all(i + 1 in early or "RECV" in ran[i + 1] for i in early), ran  # inside a receive's wait
    assert list(dict.fromkeys(a for a in ran if a in weights)) == weights  # the gradients accumulate as scheduled
    return len(early)


@pytest.mark.usefixtures("one_torch_thread")
def test_a_stage_waiting_for_an_activation_runs_its_pending_w_there_with_the_same_gradients() -> None:
    """The last stage of a 2-stage zb1p pipeline, its upstream played by hand over a real WanLink: sent late,
    the activations leave the stage waiting with a W pending, which it runs in the wait; the weights after two
    steps are bit for bit those of the same stage fed without delay."""
    job = dataclasses.replace(JOB, global_batch=8)  # 4 microbatches: 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 ...
    schedule = job_schedule(job, 2, 1)
    dataset = TextDataset(default_corpus_paths(), seq_len=MODEL.seq_len, seed=JOB.seed)

    def train_last_stage(delay_s: float) -> tuple[list[list[str]], list[torch.Tensor]]:
        config = WanLinkConfig(link_id=link_id(0, 0), streams=1, connect_timeout_s=10)
        listener = WanLink.listen("tcp://127.0.0.1:0", config)
        connector = WanLink.connect(f"tcp://127.0.0.1:{listener.port}", config)
        try:
            module = build_stage(MODEL, 2, 4, first=False, last=True, seed=JOB.seed)
            runtime = StageRuntime(
                module,
                schedule,
                1,
                transport=LinkTransport({0: listener}, stage=1),
                optimizer=torch.optim.AdamW(module.parameters(), lr=JOB.learning_rate),
            )
            m = runtime.num_microbatches
            upstream = LinkTransport({1: connector}, stage=0)
            gen = torch.Generator().manual_seed(0)
            with ThreadPoolExecutor(1) as pool:
                reports = [
                    pool.submit(runtime.run_step, step, dataset.batch(step, 0, 1, job.microbatch_size, m))
                    for step in range(2)
                ]
                for step in range(2):
                    for mb in range(m):
                        if mb >= 2:  # 1F1B's steady state: the activation follows the gradient two back
                            upstream.recv(1, "B", step, mb - 2, timeout=30)
                            time.sleep(delay_s)
                        upstream.send(torch.randn(2, MODEL.seq_len, MODEL.hidden, generator=gen), 1, "F", step, mb)
                    for mb in range(m - 2, m):
                        upstream.recv(1, "B", step, mb, timeout=30)
                events = [[e.action for e in f.result(timeout=60).events] for f in reports]
            upstream.flush(10)
            return events, [p.detach().clone() for p in module.parameters()]
        finally:
            connector.close()
            listener.close()

    late_events, late = train_last_stage(0.05)
    _, prompt = train_last_stage(0.0)
    scheduled = [str(a) for a in schedule.actions[1]]
    assert all(check_weights_in_order(events, scheduled) >= 2 for events in late_events), late_events
    assert all(torch.equal(a, b) for a, b in zip(late, prompt, strict=True))
