"""Bad input found by a hostile trial: each is refused in one line (exit 2) before any work grows with it."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from geosched.cli import main

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The one error line of ``argv``, which must exit 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "argv",
    [
        ["--stages", "1000", "--microbatches", "1000", "--grid-steps", "0"],  # ran 6 min at 3 GB
        ["--stages", "4096", "--microbatches", "244"],
        [str(CONFIGS / "demo-3dc.yaml"), "--stages", "6", "--microbatches", "100000"],
    ],
)
def test_simulate_refuses_a_schedule_too_large_to_simulate(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    err = refused(capsys, ["simulate", *argv])
    assert "exceeds 65536" in err and "lower --stages or --microbatches" in err


def test_simulate_refuses_a_negative_grid(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, ["simulate", "--stages", "2", "--microbatches", "4", "--grid-steps", "-1"])
    assert "--grid-steps must be >= 0" in err


def huge_batch(tmp_path: Path) -> str:
    data = yaml.safe_load((CONFIGS / "demo-3dc.yaml").read_text())
    data["job"].update(global_batch=16777216, microbatch_size=1)
    path = tmp_path / "gb16m.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("command", ["validate-config", "plan"])
def test_a_batch_no_schedule_can_hold_is_refused_naming_the_fields(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    err = refused(capsys, [command, huge_batch(tmp_path)])
    assert "job.global_batch" in err and "raise job.microbatch_size or lower job.global_batch" in err
    assert "stages(" not in err  # not the planner's flags, which the user never gave


def test_keys_name_makes_its_folder_as_the_help_says(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["keys", "--help"])
    assert "must exist" not in capsys.readouterr().out
    folder = tmp_path / "newdir"
    assert main(["keys", str(folder), "--name", "foo"]) == 0
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and (folder / "foo.key.pub").is_file()


def test_wanem_names_the_route_whose_port_is_taken(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:  # a port free now; the first route never binds (refused before any socket)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = str(CONFIGS / "demo-3dc.yaml")
    links = ["-".join(link["between"]) for link in yaml.safe_load(Path(config).read_text())["cluster"]["links"]]
    routes = [f"{links[0]}:{port}=127.0.0.1:9", f"{links[1]}:{port}=127.0.0.1:9"]
    err = refused(capsys, ["wanem", config, "--route", routes[0], "--route", routes[1], "--duration", "1"])
    assert f"--route {routes[1]!r}" in err and "--listen" not in err


@pytest.mark.skipif(not os.path.exists("/proc/version"), reason="needs /proc")
def test_plan_output_where_no_file_can_be_written() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "geosched.cli", "plan", str(CONFIGS / "demo-3dc.yaml"), "--no-explain"]
        + ["-o", "/proc/version"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert "cannot be written there" in run.stderr and "No such file or directory;" not in run.stderr
