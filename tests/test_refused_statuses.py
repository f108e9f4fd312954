"""The coordinator's commands say why a rank's status was not believed (agents/control/refused.py).

A trial (multi-host, Mosquitto, a job signed with ``geosched keys``): without ``--keys``, ``job status`` printed
``no agents of job 'gpt-demo'`` (exit 0) while 4 agents were live, and ``job stop`` said there was nothing to stop;
with one host's ``agent-3.sign``/``.sign.pub`` from another key folder, ``job status`` printed 3 rows for a 4-rank
plan and ``job start`` failed with ``ranks 3 (no status)``. The reasons were only in rate-limited warnings.

Here the agents' statuses are real signed messages (a ``ControlPlane`` with keys loaded from folders written by
``geosched keys``, retained on a real Mosquitto), and the commands run as the ``geosched`` CLI runs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from pathlib import Path

import pytest
from agent_helpers import tiny_plan

from agents.control.auth import ControlKeys
from agents.control.plane import ControlPlane
from agents.keys import load_job_keys, write_job_keys
from agents.layout import parse_layout, plan_id
from geosched.cli import main

JOB = "gpt-demo"
SIGNED = f"the statuses of job {JOB!r} on this broker are signed: pass --keys DIR (the job's key folder)"
BAD_SIGNATURE = "status refused, bad signature: its signing key is not the one in this key folder"


def publish_ready(url: str, plan_text: str, folders: dict[int, Path], states: dict[int, str] | None = None) -> None:
    """Each rank of the plan publishes (retained) a ``ready`` status (or its ``states``) for it, signed with
    ``agent-<rank>.sign`` of its host's key folder, as its agent does, and disconnects (the retained statuses stay)."""
    layout = parse_layout(plan_text)

    async def run() -> None:
        for role in layout.roles:
            keys = ControlKeys(*load_job_keys(folders[role.rank]).control_fields(f"agent-{role.rank}"))
            async with ControlPlane(url, JOB, f"{JOB}-agent-{role.rank}", keys=keys) as cp:
                fields = {"dc": role.dc, "stage": role.stage, "replica": role.replica}
                state = (states or {}).get(role.rank, "ready")
                assert await cp.publish_status(role.rank, state, plan_id=plan_id(plan_text), next_step=0, **fields)

    asyncio.run(run())


def geosched(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``geosched ARGS`` run as the console script runs it: (exit code, stdout, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def four_ranks(tmp_path: Path) -> tuple[Path, str]:
    """A 4-rank plan (2 DCs x 2 replicas): its file and text."""
    path = tiny_plan(tmp_path, dp=2)
    text = path.read_text()
    assert len(parse_layout(text).roles) == 4
    return path, text


@pytest.mark.parametrize(
    "command",
    [("status",), ("status", "--json"), ("stop",), ("checkpoint",), ("start", "PLAN", "--ready-timeout", "5")],
    ids=["status", "status-json", "stop", "checkpoint", "start"],
)
def test_without_keys_the_command_says_the_job_is_signed(
    mosquitto_broker, tmp_path: Path, four_ranks, capsys, command: tuple[str, ...]
):
    plan, text = four_ranks
    secrets = tmp_path / "secrets"
    write_job_keys(secrets, 4)
    url = mosquitto_broker.url_for("geosched")
    publish_ready(url, text, dict.fromkeys(range(4), secrets))
    args = [str(plan) if arg == "PLAN" else arg for arg in command]
    code, out, err = geosched(capsys, "job", *args, "--mqtt", url, "--job", JOB)
    assert (code, err.strip().splitlines()[-1:]) == (2, [f"geosched job: error: {SIGNED}"]), (out, err)
    assert "no agents" not in out and "nothing to stop" not in err and "payload is not JSON" not in err


def rank_3_signed_by_another_folder(
    url: str, tmp_path: Path, four_ranks: tuple[Path, str], states: dict[int, str] | None = None
) -> tuple[Path, tuple[str, ...]]:
    """Retained statuses (``ready`` unless ``states`` says otherwise) of a 4-rank plan, rank 3's signed with the
    ``agent-3.sign``/``.sign.pub`` pair of another key folder (consistent with each other); the plan file and
    the coordinator's flags."""
    plan, text = four_ranks
    secrets, other, host3 = tmp_path / "secrets", tmp_path / "other", tmp_path / "host3"
    write_job_keys(secrets, 4)
    write_job_keys(other, 4)
    shutil.copytree(secrets, host3)  # rank 3's host: the job's folder, but its signing key pair from another one
    for name in ("agent-3.sign", "agent-3.sign.pub"):
        shutil.copy2(other / name, host3 / name)
    publish_ready(url, text, {0: secrets, 1: secrets, 2: secrets, 3: host3}, states)
    return plan, ("--mqtt", url, "--job", JOB, "--keys", str(secrets))


@pytest.fixture
def rank_3_of_another_key_folder(mosquitto_broker, tmp_path: Path, four_ranks) -> tuple[Path, tuple[str, ...]]:
    """Ready statuses of a 4-rank plan, rank 3's signed by another key folder (rank_3_signed_by_another_folder)."""
    return rank_3_signed_by_another_folder(mosquitto_broker.url_for("geosched"), tmp_path, four_ranks)


def test_job_status_shows_the_rank_whose_status_has_a_bad_signature(rank_3_of_another_key_folder, capsys):
    _, flags = rank_3_of_another_key_folder
    code, out, err = geosched(capsys, "job", "status", *flags)
    rows = [line.split() for line in out.splitlines()]
    assert code == 0, err
    assert [row[:2] for row in rows[1:5]] == [["0", "ready"], ["1", "ready"], ["2", "ready"], ["3", "refused"]], out
    assert rows[4] == ["3", "refused", *["-"] * 7], out  # nothing of the refused payload (its DC, host) is shown
    assert out.splitlines()[5] == f"rank 3: {BAD_SIGNATURE}", out

    code, out, err = geosched(capsys, "job", "status", "--json", *flags)
    shown = json.loads(out)
    assert code == 0 and sorted(shown) == ["0", "1", "2", "3"], err
    assert (shown["3"]["state"], shown["3"]["message"], shown["3"]["dc"]) == ("refused", BAD_SIGNATURE, None)


def test_job_start_names_the_bad_signature_of_the_rank_not_ready(rank_3_of_another_key_folder, capsys):
    plan, flags = rank_3_of_another_key_folder
    code, out, err = geosched(capsys, "job", "start", str(plan), "--ready-timeout", "3", *flags)
    assert code == 1, (out, err)
    assert f"1 of 4 agents not ready after 3 s: ranks 3 ({BAD_SIGNATURE}); they run, but their statuses were " in err
    assert "refused: restart them with this job's --keys folder" in err, err
    assert "no status" not in err


def test_job_stop_does_not_say_every_agent_acknowledged_when_a_status_was_refused(
    mosquitto_broker, tmp_path: Path, four_ranks, capsys
):
    """A trial: with rank 3's status refused, ``job stop`` said ``every agent acknowledged`` (exit 0), though
    nothing said that rank stopped. Ranks 0-2 have stopped here; rank 3's status cannot be believed."""
    url = mosquitto_broker.url_for("geosched")
    _, flags = rank_3_signed_by_another_folder(url, tmp_path, four_ranks, dict.fromkeys(range(3), "stopped"))
    code, out, err = geosched(capsys, "job", "stop", *flags)
    assert code == 1, (out, err)
    assert "every agent acknowledged" not in out, out
    assert err.strip().splitlines()[-1] == (
        f"geosched job: error: job {JOB!r}: the stop was sent, but no stop can be confirmed for rank 3: their "
        f"statuses were refused (rank 3: {BAD_SIGNATURE}); check their hosts and key folders"
    ), err


def test_job_checkpoint_refuses_at_once_when_a_status_was_refused(rank_3_of_another_key_folder, capsys):
    """A trial: ``job checkpoint`` asked only the readable ranks and reported ``acknowledged by 3 agents`` for a
    4-rank job, a checkpoint no one could say was whole. It now refuses before asking, naming the rank."""
    _, flags = rank_3_of_another_key_folder
    code, out, err = geosched(capsys, "job", "checkpoint", "--timeout", "60", *flags)
    assert code == 2, (out, err)
    assert err.strip().splitlines()[-1] == (
        f"geosched job: error: job {JOB!r}: no checkpoint asked for: the acknowledgements of rank 3 could not be "
        f"read, their statuses were refused (rank 3: {BAD_SIGNATURE}); fix their key folders, or pass --keys DIR "
        "of the job's key folder"
    ), err


def test_job_status_watch_shows_the_refused_rank(rank_3_of_another_key_folder):
    """A trial: ``job status --watch`` showed ranks 0-2 and nothing of rank 3, whose status was refused."""
    import io

    from agents.control.watch import watch_job

    _, flags = rank_3_of_another_key_folder
    url, keys = flags[1], ControlKeys(*load_job_keys(Path(flags[-1])).control_fields("coordinator"))
    out = io.StringIO()

    async def watch_a_while() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(watch_job(url, JOB, out=out, keys=keys, settle_s=0.5, interval_s=0.3), 2.0)

    asyncio.run(watch_a_while())
    table = out.getvalue().split("\n\n")[0].splitlines()
    assert table[0].startswith(f"job {JOB!r} at ") and table[0].endswith(": 4 agents (3 ready, 1 refused)"), table
    rows = [line.split() for line in table[2:]]
    assert [(row[0], row[2]) for row in rows] == [("0", "ready"), ("1", "ready"), ("2", "ready"), ("3", "refused")], (
        table
    )
    assert " ".join(rows[3][3:]).startswith("- - - - - status refused, bad signature"), table  # nothing of its payload


def publish_raw(url: str, messages: list[tuple[str, bytes]], retain: bool = False) -> None:
    """A stranger with a login to the broker (an open broker, or Mosquitto without the ACL) publishes these
    payloads as they are: unsigned, malformed, for any topic."""
    import aiomqtt

    from agents.control.address import BrokerAddress

    address = BrokerAddress.parse(url)

    async def run() -> None:
        async with aiomqtt.Client(
            address.host, address.port, username=address.username, password=address.password, identifier="stranger"
        ) as client:
            for topic, payload in messages:
                await client.publish(topic, payload, qos=1, retain=retain)

    asyncio.run(run())


def test_a_strangers_status_for_a_rank_the_job_lacks_changes_no_command(
    mosquitto_broker, tmp_path: Path, four_ranks, capsys
):
    """A hostile trial: one unsigned retained status for rank 5 of a 4-rank signed job made ``job checkpoint``
    refuse (``ranks 5 ... refused``) and ``job stop`` exit 1; 20,000 of them made its line 74 KB. A rank with no key
    in the job's key folder is no rank of the job: its status is dropped (counted), not reported as refused. And a
    client without keys, which can check none of the signed statuses, showed the forged rank ``ready`` (exit 0)."""
    url = mosquitto_broker.url_for("geosched")
    _, flags = rank_3_signed_by_another_folder(url, tmp_path, four_ranks, dict.fromkeys(range(4), "stopped"))
    forged = json.dumps({"state": "ready", "host": "evil"}).encode()
    publish_raw(url, [(f"geosched/{JOB}/agents/{r}/status", forged) for r in (5, 6, 4000)], retain=True)

    code, out, err = geosched(capsys, "job", "status", *flags)
    assert code == 0 and [line.split()[0] for line in out.splitlines()[1:5]] == ["0", "1", "2", "3"], (out, err)
    assert "evil" not in out and not any(line.split()[0] in ("5", "6", "4000") for line in out.splitlines()[1:])

    code, out, err = geosched(capsys, "job", "stop", *flags)  # only rank 3, of the job's ranks, is unconfirmed
    assert code == 1 and "no stop can be confirmed for rank 3:" in err and "5" not in err.split("rank 3")[0], err

    code, out, err = geosched(capsys, "job", "status", *flags[:-2])  # no --keys: the job is signed, say so
    assert (code, err.strip().splitlines()[-1]) == (2, f"geosched job: error: {SIGNED}"), (out, err)
    assert "evil" not in out


def test_job_status_needs_the_public_files_only_and_commands_name_the_signing_key(
    mosquitto_broker, tmp_path: Path, four_ranks, capsys
):
    """A three-host trial: ``job status --keys`` on an agent's host failed (exit 2) for want of the coordinator's
    private ``coordinator.sign``, though it only reads; it checks the statuses with the public keys now."""
    plan, text = four_ranks
    secrets, reader = tmp_path / "secrets", tmp_path / "reader"
    write_job_keys(secrets, 4)
    url = mosquitto_broker.url_for("geosched")
    publish_ready(url, text, dict.fromkeys(range(4), secrets))
    shutil.copytree(secrets, reader)
    (reader / "coordinator.sign").unlink()
    flags = ("--mqtt", url, "--job", JOB, "--keys", str(reader))
    code, out, err = geosched(capsys, "job", "status", *flags)
    assert code == 0 and [line.split()[:2] for line in out.splitlines()[1:5]] == [[str(r), "ready"] for r in range(4)]
    code, out, err = geosched(capsys, "job", "stop", *flags)  # a command is signed: the key is named
    assert code == 2 and err.strip().endswith(
        f"{reader / 'coordinator.sign'} is missing: copy it from the job's key folder"
    )


def test_a_client_without_keys_drops_signed_heartbeats_quietly(mosquitto_broker, tmp_path: Path, caplog) -> None:
    """A three-host trial: ``job status`` without ``--keys`` printed ``WARNING ... heartbeat: payload is not JSON``
    (a live agent's signed heartbeat) above its one line saying the job is signed."""
    url, secrets = mosquitto_broker.url_for("geosched"), tmp_path / "secrets"
    write_job_keys(secrets, 1)
    keys = ControlKeys(*load_job_keys(secrets).control_fields("agent-0"))

    async def run() -> None:
        async with ControlPlane(url, JOB, "keyless") as reader, await reader.subscribe("heartbeat", "status") as sub:
            async with ControlPlane(url, JOB, f"{JOB}-agent-0", keys=keys) as agent:
                for seq in range(3):
                    assert await agent.publish_heartbeat(0, seq, state="training")
                assert await agent.publish_status(0, "training")
            with pytest.raises(TimeoutError):
                await sub.get(1.0)  # nothing it cannot check is handed on
            assert list(reader.refused_statuses.of(())) == [0]  # the status is noted: the commands say it is signed

    with caplog.at_level("WARNING", logger="agents.control.plane"):
        asyncio.run(run())
    assert not [r.getMessage() for r in caplog.records if "not JSON" in r.getMessage()]


def test_many_refused_ranks_are_one_bounded_line() -> None:
    from agents.control.refused import summary

    refused = {r: "status refused, bad signature" for r in range(5000)} | {7000: "status refused, replay"}
    line = summary(refused)
    assert line == (
        "ranks 0, 1, 2, 3, 4, 5, 6, 7 and 4992 more: status refused, bad signature; rank 7000: status refused, replay"
    )


def test_a_flood_of_malformed_control_messages_is_logged_once_per_interval(
    mosquitto_broker, caplog: pytest.LogCaptureFixture
) -> None:
    """A hostile trial: 5,000 publishes in 3 s, each on a topic naming a 60,000-digit rank, grew a keyless agent's
    log by 300 MB, one 60 KB line each ("dropped a message" was not rate limited, nor cut)."""
    url = mosquitto_broker.url_for("geosched")

    async def listen_while(flood: list[tuple[str, bytes]]) -> None:
        async with ControlPlane(url, JOB, "watcher") as cp:
            async with await cp.subscribe("status", "metrics"):
                await asyncio.to_thread(publish_raw, url, flood)
                await asyncio.sleep(1.0)
            assert cp.stats.dropped_malformed >= len(flood) // 2, cp.stats

    rank = "9" * 5000
    flood = [(f"geosched/{JOB}/agents/{rank}/status", b"{}")] * 100 + [(f"geosched/{JOB}/agents/1/metrics", b"[")] * 100
    with caplog.at_level("WARNING", logger="agents.control.plane"):
        asyncio.run(listen_while(flood))
    lines = [r.getMessage() for r in caplog.records if "dropped a message" in r.getMessage()]
    assert 1 <= len(lines) <= 2 and all(len(line) < 600 for line in lines), [line[:200] for line in lines]
