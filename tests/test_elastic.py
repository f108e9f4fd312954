"""Elastic recovery: which GPUs remain after a loss, and the re-plan on them (the rehearsal that survives a
killed datacenter is in tests/test_launch_elastic.py)."""

from __future__ import annotations

import copy

import pytest
from agent_helpers import TINY_CONFIG

from agents.layout import layout_plan_text, parse_layout
from agents.rehearsal.elastic import describe, surviving_config
from agents.runnable import plan_for_config
from geosched.config import config_from_dict
from geosched.errors import PlanInfeasible


def _three_dcs() -> dict:
    raw = copy.deepcopy(TINY_CONFIG)
    raw["cluster"]["datacenters"].append(
        {"name": "ap", "gpus": 2, "gpu": {"name": "cpu", "tflops": 0.01, "memory_gib": 2}}
    )
    raw["cluster"]["links"] += [
        {"between": ["eu", "ap"], "bandwidth_gbps": 1, "rtt_ms": 2, "per_connection_gbps": 0.5},
        {"between": ["us", "ap"], "bandwidth_gbps": 1, "rtt_ms": 2, "per_connection_gbps": 0.5},
    ]
    return raw


def test_a_dc_whose_every_rank_is_lost_goes_with_its_links_and_the_rest_is_replanned() -> None:
    config = config_from_dict(_three_dcs())
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
    config = config_from_dict(_three_dcs())
    layout = parse_layout(layout_plan_text(config, ["us", "eu"], dp=2))
    one_eu = next(r.rank for r in layout.roles if r.dc == "eu")
    left, gone = surviving_config(config, layout, [one_eu])
    assert gone == [] and {dc.name: dc.gpus for dc in left.cluster.datacenters} == {"us": 2, "eu": 1, "ap": 2}


def test_losing_every_dc_is_a_clear_error() -> None:
    config = config_from_dict(TINY_CONFIG)
    layout = parse_layout(layout_plan_text(config, ["us", "eu"], dp=1))
    with pytest.raises(PlanInfeasible, match="every datacenter was lost"):
        surviving_config(config, layout, [r.rank for r in layout.roles])
