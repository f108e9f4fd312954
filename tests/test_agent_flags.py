"""``geosched agent`` flags a host cannot honour are refused at once, in one line, exit 2."""

from __future__ import annotations

import pytest

from geosched.cli import main

BASE = ["agent", "--mqtt", "mqtt://127.0.0.1:1", "--rank", "0", "--connect-timeout", "1"]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--bind-host", "192.0.2.1"], "--bind-host 192.0.2.1: not an address of this host"),  # TEST-NET-1
        (["--bind-host", "no-such-host.invalid"], "not an address or resolvable name"),
        (["--resume"], "--resume and --checkpoint-every need --checkpoint-dir DIR"),
    ],
)
def test_bad_agent_flags_are_one_line_before_any_connection(
    extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(BASE + extra) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
