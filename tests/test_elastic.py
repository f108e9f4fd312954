"""Elastic recovery: which GPUs remain after a loss, and the re-plan on them (the rehearsal that survives a
killed datacenter is in tests/test_launch_elastic.py)."""

from __future__ import annotations

import pytest
from agent_helpers import TINY_CONFIG, three_dc_config

from agents.layout import layout_plan_text, parse_layout
from agents.rehearsal.elastic import ReturnPolicy, describe, surviving_config
from agents.runnable import plan_for_config
from geosched.config import config_from_dict
from geosched.errors import PlanInfeasible


def test_a_dc_whose_every_rank_is_lost_goes_with_its_links_and_the_rest_is_replanned() -> None:
    config = config_from_dict(three_dc_config())
    layout = parse_layout(layout_plan_text(config, ["us", "eu"], dp=2))  # ranks: us 0,1; eu 2,3
    eu = [r.rank for r in layout.roles if r.dc == "eu"]
    left, gone = surviving_config(config, layout, eu)
    assert gone == ["eu"]
    assert [dc.name for dc in left.cluster.datacenters] == ["us", "ap"]
    assert all("eu" not in link.between for link in left.cluster.links) and left.cluster.links
    assert left.job == config.job  # the same global batch: the same optimisation
    new = parse_layout(plan_for_config(left))
    assert {r.dc for r in new.roles} <= {"us", "ap"} and "eu" not in describe(new)


def test_a_partly_lost_dc_keeps_its_other_gpus() -> None:
    config = config_from_dict(three_dc_config())
    layout = parse_layout(layout_plan_text(config, ["us", "eu"], dp=2))
    one_eu = next(r.rank for r in layout.roles if r.dc == "eu")
    left, gone = surviving_config(config, layout, [one_eu])
    assert gone == [] and {dc.name: dc.gpus for dc in left.cluster.datacenters} == {"us": 2, "eu": 1, "ap": 2}


def test_losing_every_dc_is_a_clear_error() -> None:
    config = config_from_dict(TINY_CONFIG)
    layout = parse_layout(layout_plan_text(config, ["us", "eu"], dp=1))
    with pytest.raises(PlanInfeasible, match="every datacenter was lost"):
        surviving_config(config, layout, [r.rank for r in layout.roles])


def test_moving_back_waits_for_the_return_then_for_the_next_checkpoint() -> None:
    policy = ReturnPolicy(5.0)
    assert not policy.due(100.0, 3)  # no loss yet
    assert not policy.pending()
    policy.lost(10.0)
    assert policy.pending()  # a run that ends now says it did not move back
    assert not policy.due(14.9, 3)  # the GPUs are not back yet
    assert not policy.due(15.0, 3)  # back: the checkpoint complete now is not the next one
    assert not policy.due(16.0, 3)
    assert policy.due(17.0, 4)  # the next checkpoint: move back at this step boundary
    policy.moved()
    assert not policy.due(30.0, 9) and not policy.pending()
    never = ReturnPolicy(None)
    never.lost(0.0)
    assert not never.due(1e9, 100) and not never.pending()


def test_a_loss_past_the_recovery_limit_says_so_and_a_recovery_names_every_rank_that_exited(tmp_path) -> None:
    """On a 4th loss the run ended with the loss's own line, as if it had never recovered; and a recovery's
    reason named only the rank the coordinator saw exit first, not the one found dead when the others stopped."""
    from agents.control.coordinator import AgentLost
    from agents.rehearsal.elastic import ElasticJob

    config = config_from_dict(three_dc_config())
    plan = layout_plan_text(config, ["us", "eu"], dp=2)  # ranks: us 0, 1; eu 2, 3
    losses = iter([AgentLost("rank 2 exited", [2]), AgentLost("rank 0 exited", [0])])

    def run(text: str, count: int, *_: object) -> None:
        raise next(losses)

    stopped = iter([[3], []])  # stopping the first attempt finds rank 3 dead too
    job = ElasticJob(config, tmp_path, tmp_path, lambda layout, resume: None, run, lambda _: next(stopped), most=1)
    with pytest.raises(AgentLost, match=r"rank 0 exited \(not recovered: this run recovered 1 time already"):
        job.train(plan, 5)
    (recovery,) = job.recoveries
    assert recovery.lost_ranks == [2, 3] and recovery.reason == "rank 2 exited (ranks 3 exited too)"
    losses = iter([AgentLost("rank 1 exited", [1])])  # a run without --elastic: the flag that would recover it
    plain = ElasticJob(config, tmp_path, tmp_path, lambda layout, resume: None, run, lambda _: [], most=0)
    with pytest.raises(AgentLost, match=r"rank 1 exited \(not recovered: --elastic re-plans around lost agents"):
        plain.train(plan, 5)
