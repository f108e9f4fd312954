"""The summary: a DC behind a slow link stays idle and the summary says why, with numbers."""

from __future__ import annotations

import json

import yaml

from geosched.cli import main
from geosched.config import load_config
from planner.cpsat import Goal
from planner.evaluate import Evaluator
from planner.explain import UnusedReason, _reason, summary_dict, summary_text, unused_reasons
from planner.generate import two_datacenters
from planner.planning import make_plan
from planner.space import Candidate, Problem, Variant


def test_dc_behind_a_slow_link_is_left_idle_and_explained() -> None:
    slow = make_plan(two_datacenters(bandwidth_gbps=2, rtt_ms=150, per_connection_gbps=0.5))
    idle = [d for d in slow.plan.datacenters if d.used == 0]
    assert len(idle) == 1 and not slow.plan.links
    reasons = unused_reasons(slow.problem, slow.evaluator, slow.best)
    assert [r.dc for r in reasons] == [idle[0].name]
    reason = reasons[0]
    assert reason.counterfactual_s is not None and reason.counterfactual_s > slow.best.iteration_s
    text = summary_text(slow.plan, reasons)
    assert f"dc {idle[0].name}: 0/8 GPUs" in text
    assert "2 Gb/s, 150 ms RTT" in text and "per microbatch" in text
    assert summary_dict(slow.plan, reasons)["unused"][0]["counterfactual_s"] == reason.counterfactual_s


def test_the_same_dc_is_used_once_its_link_is_fast() -> None:
    fast = make_plan(two_datacenters(bandwidth_gbps=100, rtt_ms=2, per_connection_gbps=25))
    assert all(d.used > 0 for d in fast.plan.datacenters)
    assert fast.plan.links and fast.plan.links[0].streams == 5  # 100 Gb/s / 25 Gb/s per connection, x 1.25
    assert fast.plan.prediction.wan_usd_per_iteration > 0
    slow = make_plan(two_datacenters(bandwidth_gbps=2, rtt_ms=150, per_connection_gbps=0.5))
    assert fast.best.iteration_s < slow.best.iteration_s


def test_cli_summary_and_json_carry_the_same_facts(tmp_path, capsys) -> None:
    config = tmp_path / "demo.yaml"
    config.write_text(open("configs/demo-3dc.yaml").read())
    assert main(["plan", str(config), "-o", str(tmp_path / "plan.yaml")]) == 0
    text = capsys.readouterr().out
    assert main(["plan", str(config), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for dc in data["datacenters"]:
        assert dc["name"] in text
    for reason in data["unused"]:
        assert reason["text"] in text
    assert f"{data['prediction']['iteration_s']:.4g} s" in text


def test_summary_prints_the_rank_layout_in_runs_not_one_line_per_rank() -> None:
    """512 ranks over two DCs: one line per stage's run of ranks, with the replicas it holds."""
    import copy

    from agent_helpers import TINY_CONFIG

    from agents.layout import layout_plan_text
    from geosched.config import config_from_dict
    from planner.explain import rank_blocks
    from planner.plan import plan_from_dict

    data = copy.deepcopy(TINY_CONFIG)
    for dc in data["cluster"]["datacenters"]:
        dc["gpus"] = 256
    data["job"]["global_batch"] = 1024
    plan = plan_from_dict(yaml.safe_load(layout_plan_text(config_from_dict(data), ["us", "eu"], dp=256)))
    assert plan.world_size == 512
    text = summary_text(plan, [])
    section = text[text.index("ranks (512") :].splitlines()
    assert section[0] == "ranks (512, rank = (stage x 256 + replica)):"
    assert section[1].split() == ["ranks", "datacenter", "stage", "replicas", "blocks"]
    assert section[2].split() == ["0-255", "us", "0", "0-255", "0-0"]
    assert section[3].split() == ["256-511", "eu", "1", "0-255", "1-1"]
    assert len(section) == 4
    assert (
        summary_dict(plan, [])["rank_layout"]
        == rank_blocks(plan)
        == [
            {"ranks": [0, 255], "dc": "us", "stage": 0, "replicas": [0, 255], "layers": [0, 1]},
            {"ranks": [256, 511], "dc": "eu", "stage": 1, "replicas": [0, 255], "layers": [1, 2]},
        ]
    )


def test_a_dc_no_link_reaches_is_named_as_such(tmp_path, capsys) -> None:
    """The demo with only the us-eu link: "ap" cannot join any plan, and the summary says it is the missing
    link, not memory."""
    data = yaml.safe_load(open("configs/demo-3dc.yaml"))
    data["cluster"]["links"] = [link for link in data["cluster"]["links"] if "ap" not in link["between"]]
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(data))
    assert main(["plan", str(config), "--json"]) == 0
    unused = {r["dc"]: r["text"] for r in json.loads(capsys.readouterr().out)["unused"]}
    assert "no WAN link joins it" in unused["ap"] and "us" in unused["ap"]


def test_a_counterfactual_that_adds_the_dc_as_another_pipeline_is_explained() -> None:
    """The idle DC hosts a second pipeline of the counterfactual, not a stage of the first: the text says so
    (it used to look the DC up in the first pipeline's path and crash)."""
    problem = Problem(load_config("configs/demo-3dc.yaml"), Variant(1, 0, "1f1b", 2))
    evaluator = Evaluator(problem)
    best = evaluator.evaluate(Candidate(1, 8, ("us", "eu"), ((0, 3), (3, 6))))
    alt = evaluator.evaluate(Candidate(1, 4, ("us", "eu"), ((0, 3), (3, 6)), (("ap", "ap"),)))
    reason = _reason(problem, best, Goal(), UnusedReason("ap", 2, 0, "dc ap: 0/2 GPUs"), alt, lambda ev: None)
    assert reason.counterfactual_s == alt.iteration_s
    assert "2 pipelines" in reason.text and "across DCs" in reason.text, reason.text
