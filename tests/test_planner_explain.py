"""The summary: a DC behind a slow link stays idle and the summary says why, with numbers."""

from __future__ import annotations

import json

from geosched.cli import main
from planner.explain import summary_dict, summary_text, unused_reasons
from planner.generate import two_datacenters
from planner.planning import make_plan


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
    assert fast.plan.links and fast.plan.links[0].streams == 4  # 100 Gb/s / 25 Gb/s per connection
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
