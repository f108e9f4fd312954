"""Data parallelism across datacenters in the agents: pipelines on different DC paths train like one process.

The planner, pinned to ``--cross-dc-dp`` on the demo config, places two
pipelines on different DC paths; every rank of the plan then trains in its
own process (real WanLinks between stages, one gloo group per stage spanning
the DCs, ZeRO 0 and 1 over it) and the global loss of 10 steps equals a
one-process run within 1e-4.
"""

from __future__ import annotations

import pytest
from test_tp_pipeline import STEPS, _global_losses, run_layout

from agents.layout import parse_layout
from agents.stage.session import train_one_process
from geosched.config import load_config
from geosched.data import TextDataset, default_corpus_paths
from planner.plan import dump_plan
from planner.planning import make_plan
from planner.variants import Pins

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("zero", [0, 1], ids=["zero 0", "zero 1 across DCs"])
def test_pipelines_in_several_datacenters_train_like_one_process(zero: int) -> None:
    cfg = load_config("configs/demo-3dc.yaml")
    outcome = make_plan(cfg, pins=Pins(tp=1, zero=zero, cross_dc_dp=True))
    layout = parse_layout(dump_plan(outcome.plan))
    assert layout.extra_pipelines and layout.replicas == layout.dp * (1 + len(layout.extra_pipelines))
    paths = {tuple(r.dc for r in layout.roles if r.replica == replica) for replica in range(layout.replicas)}
    assert len(paths) >= 2  # the replicas of a stage live in different DCs
    assert {r.group for r in layout.roles} == {f"stage{s}" for s in range(layout.num_stages)}
    assert layout.job.zero == zero
    runs = run_layout(layout)
    job = layout.job
    reference = train_one_process(
        job, TextDataset(default_corpus_paths(), seq_len=job.model.seq_len, seed=job.seed), STEPS
    )
    assert _global_losses(layout, runs) == pytest.approx(reference, rel=1e-4)
    assert reference[-1] < reference[0]
