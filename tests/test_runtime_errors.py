"""Stage runtime failures: the failing action is marked in the schedule grid, errors keep their class,
and bad wiring is refused before anything runs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from agents.layout import layout_roles
from agents.stage.runtime import StageRuntime
from agents.stage.schedule import job_schedule, num_microbatches
from agents.stage.transport import LinkTransport
from agents.wan.link import WanLink
from geosched.config import JobSpec, ModelSpec
from geosched.data import TextDataset, default_corpus_paths
from geosched.errors import LinkError, PlanError, StageError
from geosched.model import build_stage

MODEL = ModelSpec(layers=2, hidden=16, heads=2, seq_len=16)
JOB = JobSpec(model=MODEL, global_batch=4, microbatch_size=2, precision="fp32", schedule="gpipe", seed=1)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def runtime(stage: int, link: WanLink | None, shape: ModelSpec = MODEL, **options) -> StageRuntime:
    module = build_stage(shape, stage, stage + 1, first=stage == 0, last=stage == 1, seed=1)
    transport = None if link is None else LinkTransport({1 - stage: link}, stage=stage)
    return StageRuntime(
        module,
        job_schedule(JOB, 2, 1),
        stage,
        transport=transport,
        optimizer=torch.optim.AdamW(module.parameters()),
        **options,
    )


def test_failing_actions_are_marked_in_the_grid(link_pair):
    listener, connector = link_pair
    data = TextDataset(default_corpus_paths(), seq_len=MODEL.seq_len, seed=1).batch(0, 0, 1, 2, 2)
    first = runtime(0, connector, recv_timeout_s=1.0)
    # stage 1 built for another hidden size: its first forward cannot take stage 0's activations
    wrong = runtime(1, listener, shape=ModelSpec(layers=2, hidden=8, heads=2, seq_len=16))
    with ThreadPoolExecutor(2) as pool:
        upstream = pool.submit(first.run_step, 0, data)
        downstream = pool.submit(wrong.run_step, 0, data)
        with pytest.raises(StageError) as failed:
            downstream.result(timeout=60)
        with pytest.raises(LinkError) as timed_out:  # keeps its class; stage 0 never gets a gradient
            upstream.result(timeout=60)

    message = str(failed.value)
    assert "stage 1 replica 0 step 0: action 1F0 failed" in message
    assert ">1F0<" in message and "stage 0" in message.splitlines()[-2]  # the grid, both stages
    assert isinstance(failed.value.__cause__, AssertionError)  # the stage's own shape check
    message = str(timed_out.value)
    assert "action 0RECV_B0 failed" in message and ">0RECV_B0<" in message
    assert "from stage 1" in message and "within 1 s" in message


def test_a_cause_whose_text_begins_with_an_empty_line_is_on_the_first_line():
    """A tensor-parallel peer killed mid-step gave 'action 1I2 failed: ;' in the coordinator's line: the torch
    error's text began with an empty line, and an agent's status keeps the first line of its error."""
    from geosched.schedule import Action, ActionKind

    module = build_stage(MODEL, 0, 2, first=True, last=True, seed=1)
    single = StageRuntime(
        module, job_schedule(JOB, 1, 1), 0, transport=None, optimizer=torch.optim.AdamW(module.parameters())
    )
    failure = single._failure(Action(0, ActionKind.FORWARD, 1), 3, RuntimeError("\n  Connection closed by peer\nmore"))
    first, second = str(failure).splitlines()[:2]
    assert first == "stage 0 replica 0 step 3: action 0F1 failed: Connection closed by peer" and second == "more"


def test_wrong_microbatch_count_is_refused():
    module = build_stage(MODEL, 0, 2, first=True, last=True, seed=1)
    single = StageRuntime(
        module, job_schedule(JOB, 1, 1), 0, transport=None, optimizer=torch.optim.AdamW(module.parameters())
    )
    data = TextDataset(default_corpus_paths(), seq_len=MODEL.seq_len, seed=1).batch(0, 0, 1, 2, 2)
    assert single.run_step(0, data).loss > 0  # one stage: no transport needed
    with pytest.raises(StageError, match="needs 2 microbatches .* got 1"):
        single.run_step(1, data[:1])


def test_stage_and_model_part_must_agree(link_pair):
    _, connector = link_pair
    middle = build_stage(MODEL, 0, 1, first=False, last=False, seed=1)  # no embeddings: cannot be stage 0
    with pytest.raises(StageError, match="needs first=True, last=False"):
        StageRuntime(
            middle,
            job_schedule(JOB, 2, 1),
            0,
            transport=LinkTransport({1: connector}, stage=0),
            optimizer=torch.optim.AdamW(middle.parameters()),
        )
    first = build_stage(MODEL, 0, 1, first=True, last=False, seed=1)
    with pytest.raises(StageError, match="needs a transport"):
        StageRuntime(first, job_schedule(JOB, 2, 1), 0, transport=None, optimizer=torch.optim.AdamW(first.parameters()))


def test_bad_layouts_name_the_problem():
    with pytest.raises(PlanError, match=r"global_batch\(4\) is not a multiple of dp\(3\)"):
        num_microbatches(JOB, 3)
    with pytest.raises(PlanError, match="stage 1 starts at layer 3 but stage 0 ends at 2"):
        layout_roles(["us", "eu"], [(0, 2), (3, 4)], dp=1)
    roles = layout_roles(["us", "us", "eu"], [(0, 1), (1, 2), (2, 3)], dp=2, wan_streams=8)
    assert [r.rank for r in roles] == list(range(6))
    assert (roles[2].group, roles[2].streams_prev, roles[2].streams_next) == ("us/stage1", 1, 8)
    assert roles[5].last and roles[5].prev_dc == "us" and roles[5].next_dc is None
