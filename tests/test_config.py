"""The config schema: shipped configs round-trip, broken ones fail with one clear line."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from geosched.cli import main
from geosched.config import CONFIG_LIMITS, config_from_dict, dump_config, load_config
from geosched.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def test_there_are_shipped_configs():
    names = {os.path.basename(p) for p in SHIPPED}
    assert "demo-3dc.yaml" in names and len(names) >= 4


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_shipped_config_round_trips(path, tmp_path):
    cfg = load_config(path)
    out = tmp_path / "dumped.yaml"
    out.write_text(dump_config(cfg))
    again = load_config(out)
    assert again == cfg
    assert dump_config(again) == dump_config(cfg)


def _demo() -> dict:
    with open(os.path.join(ROOT, "configs", "demo-3dc.yaml")) as fh:
        return yaml.safe_load(fh)


def _break_missing_field(d):
    del d["cluster"]["datacenters"][0]["gpus"]


def _break_negative_gpus(d):
    d["cluster"]["datacenters"][1]["gpus"] = -4


def _break_unknown_dc(d):
    d["cluster"]["links"][0]["between"] = ["us", "mars"]


def _break_unknown_key(d):
    d["job"]["model"]["hiden"] = 64


def _break_wrong_type(d):
    d["cluster"]["links"][1]["rtt_ms"] = "fast"


def _break_batch(d):
    d["job"]["global_batch"] = 15


def _break_heads(d):
    d["job"]["model"]["heads"] = 5


def _break_duplicate_dc(d):
    d["cluster"]["datacenters"][1]["name"] = "us"


def _break_precision(d):
    d["job"]["precision"] = "fp8"


def _break_name(d):
    d["cluster"]["datacenters"][0]["name"] = "-us"  # read as a flag by the agents' command line


def _break_streams(d):
    d["cluster"]["links"][0]["max_streams"] = 200  # a WanLink opens at most 64


def _break_tp(d):
    d["job"]["tensor_parallel"] = 4  # the demo's nodes have 2 GPUs


def _break_tiny_tflops(d):
    d["cluster"]["datacenters"][0]["gpu"]["tflops"] = 1e-300  # passed the schema and overflowed CP-SAT's ints


def _break_codec_case(d):
    d["job"]["wan_compression"] = "INT8"


def _break_codec_bool(d):
    d["job"]["wan_compression"] = False  # what YAML makes of an unquoted 'off'


BROKEN = {
    "codec case": (_break_codec_case, "(got 'INT8'); did you mean 'int8'?"),
    "codec bool": (_break_codec_bool, "(got False); YAML reads an unquoted yes/no/on/off/true/false as a boolean"),
    "missing field": (_break_missing_field, "cluster.datacenters[0].gpus: missing required field"),
    "negative gpus": (_break_negative_gpus, "cluster.datacenters[1].gpus: must be >= 1 (got -4)"),
    "unknown dc": (_break_unknown_dc, "cluster.links[0].between: unknown datacenter 'mars'"),
    "unknown key": (_break_unknown_key, "job.model.hiden: unknown key; did you mean 'hidden'?"),
    "wrong type": (_break_wrong_type, "cluster.links[1].rtt_ms: expected a number (got 'fast')"),
    "batch": (_break_batch, "global_batch(15) must be a multiple of microbatch_size(2)"),
    "heads": (_break_heads, "hidden(64) must be divisible by heads(5)"),
    "duplicate dc": (_break_duplicate_dc, "cluster.datacenters[1].name: duplicate datacenter 'us'"),
    "precision": (_break_precision, "job.precision: must be one of 'fp32', 'bf16', 'fp16' (got 'fp8')"),
    "streams": (_break_streams, "cluster.links[0].max_streams: must be <= 64 (got 200)"),
    "name": (_break_name, "cluster.datacenters[0].name: '-us' is not a name"),
    "tiny tflops": (_break_tiny_tflops, "cluster.datacenters[0].gpu.tflops: must be >= 0.001 (got 1e-300)"),
    "tp": (_break_tp, "job.tensor_parallel: no datacenter has a node of 4 GPUs (gpus_per_node: 2)"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_config_names_the_field(case, tmp_path, capsys):
    breaker, expected = BROKEN[case]
    data = _demo()
    breaker(data)
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert expected in str(info.value)
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["validate-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_not_yaml_and_missing_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: [unclosed\n")
    assert main(["validate-config", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["validate-config", str(tmp_path / "nope.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_cli_subprocess_exit_code_and_one_line(tmp_path):
    data = _demo()
    _break_negative_gpus(data)
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = subprocess.run(
        [sys.executable, "-m", "geosched.cli", "validate-config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"geosched validate-config: error: {path}: cluster.datacenters[1].gpus: must be >= 1 (got -4)"
    ]
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "geosched.cli",
            "validate-config",
            os.path.join(ROOT, "configs", "demo-3dc.yaml"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert '"total_gpus": 6' in ok.stdout


def test_validate_config_says_when_wan_compression_is_allowed(tmp_path, capsys):
    config = yaml.safe_load(open(os.path.join(ROOT, "configs/demo-3dc.yaml")))
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["validate-config", str(path)]) == 0
    assert "compression" not in capsys.readouterr().out  # 'none', the default: nothing to say
    config["job"]["wan_compression"] = "fp8"
    path.write_text(yaml.safe_dump(config))
    assert main(["validate-config", str(path)]) == 0
    assert "WAN compression: fp8 allowed (lossy)" in capsys.readouterr().out
    assert main(["validate-config", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["wan_compression"] == "fp8"


def test_reference_lists_every_field(capsys):
    assert main(["validate-config", "--reference"]) == 0
    out = capsys.readouterr().out
    for field in ("cluster.datacenters[].gpu.tflops", "cluster.links[].per_connection_gbps", "job.microbatch_size"):
        assert f"`{field}`" in out


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_shipped_config_within_the_limits(path):
    """Every shipped config fits the hardened loader's limits and the largest problem the planner accepts."""
    from planner.feasibility import check_size
    from planner.space import Problem

    assert os.path.getsize(path) <= CONFIG_LIMITS.max_bytes
    check_size(Problem(load_config(path)))


def test_bf16_with_fp32_optimizer_bytes_warns_once(tmp_path):
    data = _demo()
    data["job"]["precision"] = "bf16"  # the demo's optimizer_bytes_per_param (8) is fp32's
    path = tmp_path / "bf16.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = subprocess.run(
        [sys.executable, "-m", "geosched.cli", "plan", str(path), "--no-explain", "-o", str(tmp_path / "p.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "optimizer_bytes_per_param" in line]
    assert len(warnings) == 1 and "set 12" in warnings[0], proc.stderr
    data["job"]["optimizer_bytes_per_param"] = 12
    path.write_text(yaml.safe_dump(data))
    quiet = subprocess.run(
        [sys.executable, "-m", "geosched.cli", "validate-config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert quiet.returncode == 0 and "optimizer_bytes_per_param" not in quiet.stderr
    data["job"]["initial_loss_scale"] = 1024  # fp16's alone: set for bf16, it warns that nothing reads it
    path.write_text(yaml.safe_dump(data))
    command = [sys.executable, "-m", "geosched.cli", "validate-config", str(path)]
    ignored = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert ignored.returncode == 0 and "only fp16 scales its loss" in ignored.stderr, ignored.stderr
    data["job"].update(initial_loss_scale=65536, lr_min_ratio=0.05)  # the decay's end, with no decay
    path.write_text(yaml.safe_dump(data))
    ignored = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert ignored.returncode == 0 and "job.lr_decay is 'none', so the rate never decays" in ignored.stderr
    assert "lr_decay: linear or cosine" in ignored.stderr and ignored.stderr.count("\n") == 1, ignored.stderr


def test_exponent_numbers_are_numbers_and_number_like_names_stay_names(tmp_path):
    """``3e-3`` is YAML 1.2's float (YAML 1.1 reads it as a string); a DC named ``1e3`` still round-trips."""
    from agents.layout import layout_plan_text, parse_layout

    text = open(os.path.join(ROOT, "configs", "demo-3dc.yaml")).read()
    assert "learning_rate: 0.003" in text and "name: eu" in text
    path = tmp_path / "c.yaml"
    text = text.replace("learning_rate: 0.003", "learning_rate: 3e-3")
    path.write_text(text.replace("name: eu", "name: 1e3"))
    with pytest.raises(ConfigError, match=r"name: expected a non-empty string \(got 1000.0\); .* write it in quotes"):
        load_config(path)
    path.write_text(re.sub(r"\beu\b", "'1e3'", text))
    cfg = load_config(path)
    assert cfg.job.learning_rate == 0.003 and "1e3" in [dc.name for dc in cfg.cluster.datacenters]
    out = tmp_path / "dumped.yaml"
    out.write_text(dump_config(cfg))
    assert load_config(out) == cfg
    layout = parse_layout(layout_plan_text(cfg))
    assert "1e3" in {role.dc for role in layout.roles}


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("  steps: 1:30", "1:30 is a base-60 number in YAML 1.1"),  # PyYAML read it as 90
        ("  steps: 010", "010 is an octal number in YAML 1.1"),  # PyYAML read it as 8
        ("  steps: 3_0", r"3_0 is read as 30 in YAML 1.1 \(underscores dropped\); write 30"),  # YAML 1.2: text
        ("  steps: 0b11110", "0b11110 is a binary number in YAML 1.1"),  # PyYAML read it as 30
    ],
)
def test_yaml11_numbers_that_mean_something_else_are_refused(tmp_path, line: str, complaint: str):
    text = open(os.path.join(ROOT, "configs", "demo-3dc.yaml")).read()
    assert "\n  steps: " in text
    path = tmp_path / "c.yaml"
    path.write_text(re.sub(r"\n  steps: [0-9]+", "\n" + line, text, count=1))
    with pytest.raises(ConfigError, match=complaint):
        load_config(path)


def test_an_empty_file_or_no_datacenter_is_named_as_such(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError) as info:
        load_config(empty)
    assert str(info.value) == f"{empty}: expected a mapping with 'cluster' and 'job' (got nothing)"
    data = _demo()
    data["cluster"]["datacenters"], data["cluster"]["links"] = [], []
    with pytest.raises(ConfigError, match="cluster.datacenters: none listed"):
        config_from_dict(data)


def test_a_plan_given_as_a_config_is_named_as_such(tmp_path):
    from agents.layout import layout_plan_text

    plan = tmp_path / "plan.yaml"
    plan.write_text(layout_plan_text(load_config(os.path.join(ROOT, "configs", "demo-3dc.yaml"))))
    with pytest.raises(ConfigError, match="a plan file \\(written by 'geosched plan'\\), not a config"):
        load_config(plan)
