"""``geosched job status --watch``: the live table as a pure function of statuses and metrics; the flags of
the live view, the run folder (``job start --run-dir``) and ``launch --checkpoint-*``."""

from __future__ import annotations

import time

from agents.control.commands import status_table
from agents.control.losses import lost_message
from agents.control.messages import MetricsMessage, StatusMessage
from agents.control.watch import HEADER, view_lines
from geosched.cli import main
from geosched.text import printable


def _columns(line: str) -> list[str]:
    return line.split()


def test_the_table_shows_every_rank_from_statuses_and_metrics() -> None:
    statuses = {
        0: StatusMessage(0, "training", dc="us", extra={"next_step": 4}),
        1: StatusMessage(1, "error", dc="eu", extra={"message": "link to stage 0 lost\nsee the log"}),
        2: StatusMessage(2, "ready", dc="ap", extra={"next_step": 3}),
    }
    metrics = {
        0: MetricsMessage(
            0,
            5,
            values={
                "iteration_s": 0.25,
                "bubble_fraction": 0.412,
                "wan_bytes": 500_000,
                "prefill": {"queue_len": 3},
            },
        ),
        3: MetricsMessage(3, 5, values={"dc": "eu", "iteration_s": 0.0, "wan_bytes": 10}),
    }
    lines = view_lines("demo", statuses, metrics, now=0.0)
    assert lines[0].startswith("job 'demo' at ") and "4 agents (1 error, 1 ready, 1 training)" in lines[0]
    assert lines[0].endswith("newest step 5 (WAN 2.00 MB/s, all ranks)")  # the step line's; the column: a rank's
    assert _columns(lines[1]) == "rank dc state step iter ms bubble WAN MB/s prefill q message".split()
    assert len(HEADER) == 9
    assert _columns(lines[2]) == ["0", "us", "training", "5", "250.0", "41.2%", "2.00", "3"]
    assert _columns(lines[3])[:8] == ["1", "eu", "error", "-", "-", "-", "-", "-"]
    assert lines[3].endswith("link to stage 0 lost see the log")  # one line, whatever the message holds
    assert _columns(lines[4]) == ["2", "ap", "ready", "2", "-", "-", "-", "-"]  # the last step done
    assert _columns(lines[5]) == ["3", "eu", "?", "5", "0.0", "-", "-", "-"]  # metrics before any status
    # the message column starts where the header says, in every row
    at = lines[1].index("message")
    assert lines[3][at:].startswith("link to stage 0")


def test_an_agents_own_text_is_shown_as_one_bounded_line_without_control_characters() -> None:
    escape = "\x1b[2J\x1b]0;owned\x07"  # clear the screen, set the terminal's title
    forged = StatusMessage(
        7, "error", dc="eu" + escape, host="h\rx" * 5_000, stage=1, extra={"message": "boom\n" + escape + "x" * 10**6}
    )
    training = StatusMessage(8, "training", extra={"step": escape + "PWNED"})  # a step is no number it checks
    lines = [
        *view_lines("demo", {7: forged}, {}, now=0.0),
        status_table({7: forged, 8: training}),
        lost_message("demo", forged, 3),
    ]
    for line in lines:
        assert "\x1b" not in line and "\x07" not in line and "\r" not in line, line[:200]
        assert len(line) < 1_000, len(line)
    assert lines[-1].startswith("job 'demo': agent rank 7 (eu [2J ]0;owned , stage 1) on h xh x")
    assert "boom" in lines[-1] and "(1000019 characters)" in lines[-1]
    assert printable("ok") == "ok" and printable("a" * 10, 4) == "aaaa... (10 characters)"


def test_ranks_of_an_earlier_plan_are_counted_not_shown() -> None:
    statuses = {
        0: StatusMessage(0, "training", dc="us", extra={"plan_id": "new"}),
        1: StatusMessage(1, "training", dc="ap"),  # no plan named: shown
        3: StatusMessage(3, "stopped", dc="eu", extra={"plan_id": "old"}),
    }
    metrics = {3: MetricsMessage(3, 9, values={"iteration_s": 0.1})}
    lines = view_lines("demo", statuses, metrics, now=0.0, plan="new")
    assert "2 agents (2 training); 1 rank of an earlier plan not shown" in lines[0], lines[0]
    assert [line.split()[0] for line in lines[2:]] == ["0", "1"]
    assert len(view_lines("demo", statuses, metrics, now=0.0)) == 5  # no plan known: every rank


def test_a_watcher_that_lost_the_broker_says_so_in_its_headline() -> None:
    """A trial restarted Mosquitto: the watch redrew the same table for 9 s with nothing saying it was stale."""
    statuses = {0: StatusMessage(0, "training", dc="us")}
    away = time.mktime((2026, 12, 6, 13, 39, 42, 0, 0, -1))
    lines = view_lines("demo", statuses, {}, now=away + 5, broker_away_since=away)
    assert lines[0].endswith("; the broker is unreachable since 13:39:42: the table is what it said before")
    assert "unreachable" not in view_lines("demo", statuses, {}, now=away)[0]


def test_a_big_job_is_cut_to_the_screen_and_an_empty_one_says_so() -> None:
    statuses = {r: StatusMessage(r, "training", dc="us") for r in range(500)}
    lines = view_lines("big", statuses, {}, max_rows=20)
    assert len(lines) == 2 + 20 + 1 and lines[-1].startswith("... 480 more ranks")
    assert view_lines("none", {}, {})[1] == "no agents seen yet (waiting for their statuses)"


def test_watch_flags_are_checked_before_connecting(capsys) -> None:
    broker = ["--mqtt", "mqtt://127.0.0.1:1", "--job", "w"]
    assert main(["job", "status", "--watch", "--interval", "0", *broker]) == 2
    assert "--interval" in capsys.readouterr().err
    assert main(["job", "status", "--watch", "--json", *broker]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--json" in err and "Traceback" not in err


def test_run_dir_and_checkpoint_flags_refuse_bad_input(tmp_path, capsys) -> None:
    from agent_helpers import tiny_plan

    plan = str(tiny_plan(tmp_path))
    assert main(["job", "start", plan, "--mqtt", "mqtt://127.0.0.1:1", "--run-dir", "/proc/no/such/folder"]) == 2
    assert "--run-dir /proc/no/such/folder: cannot make or read a folder there" in capsys.readouterr().err
    assert main(["launch", "configs/demo-3dc.yaml", "--checkpoint-every", "3"]) == 2
    assert "--checkpoint-every needs --checkpoint-dir" in capsys.readouterr().err
