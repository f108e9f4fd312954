"""``job stop`` is acknowledged: it is sent again until every agent says ``stopped``, including one whose
retained status was still its ``offline`` will (reconnecting) when the stop was first sent."""

from __future__ import annotations

import asyncio
import time

from agents.control.commands import stop_job
from agents.control.messages import CommandMessage
from agents.control.plane import ControlPlane


async def _agent(url: str, rank: int, back_after_s: float, stops: list[float]) -> None:
    """A stand-in agent on the real control plane. With ``back_after_s``: its status reads 'offline' (as its
    will would) and it is not connected until then, so it misses the first stop; then 'training' until it
    receives ``stop``, then 'stopped'."""
    if back_after_s:
        async with ControlPlane(url, "stopjob", f"stopjob-will-{rank}") as will:
            await will.publish_status(rank, "offline")
        await asyncio.sleep(back_after_s)
    async with ControlPlane(url, "stopjob", f"stopjob-agent-{rank}") as cp:
        async with await cp.subscribe("command") as sub:
            await cp.publish_status(rank, "training")
            while True:
                message = await sub.get(30.0)
                if isinstance(message, CommandMessage) and message.cmd == "stop":
                    stops.append(time.monotonic())
                    await cp.publish_status(rank, "stopped")
                    return


def test_stop_reaches_an_agent_back_from_a_reconnect(embedded_broker) -> None:
    url = embedded_broker.url_for("geosched")
    stops: list[float] = []

    async def run() -> list[int]:
        agents = [asyncio.create_task(_agent(url, r, back, stops)) for r, back in ((0, 0.0), (1, 3.0))]
        await asyncio.sleep(1.0)  # both statuses retained: rank 0 training, rank 1 offline
        left = await stop_job(url, "stopjob", timeout_s=20.0)
        await asyncio.wait_for(asyncio.gather(*agents), 10.0)
        return left

    assert asyncio.run(run()) == []
    assert len(stops) == 2  # rank 1 got a re-sent stop once it was back


def test_a_stop_for_one_plan_waits_only_for_its_agents_and_says_which_plan(embedded_broker) -> None:
    url = embedded_broker.url_for("geosched")
    seen: list[CommandMessage] = []

    async def run() -> list[int]:
        async with ControlPlane(url, "stopplan", "stopplan-agent-0") as cp:
            async with await cp.subscribe("command") as sub:
                await cp.publish_status(0, "training", plan_id="new")  # an agent of the next plan: not to stop
                left = await stop_job(url, "stopplan", timeout_s=20.0, plan_id="old")
                message = await sub.get(5.0)
                assert isinstance(message, CommandMessage)
                seen.append(message)
                return left

    assert asyncio.run(run()) == []  # rank 0 runs another plan: not waited for (else it would be left)
    assert seen[0].cmd == "stop" and seen[0].extra.get("plan_id") == "old"  # the agents of 'new' ignore it


def test_job_stop_names_the_ranks_that_stayed_offline(embedded_broker, capsys) -> None:
    """A frozen or cut-off agent (its will says offline) never acknowledges: 'every agent acknowledged' was printed
    anyway. The stop is still a success (the job is stopped), and the line names the offline rank."""
    from geosched.cli import main

    url = embedded_broker.url_for("geosched")

    async def statuses() -> None:
        async with ControlPlane(url, "stopgone", "stopgone-coordinator") as coordinator:
            await coordinator.publish_plan("an elastic re-plan, held after its job failed")
        async with ControlPlane(url, "stopgone", "stopgone-agent-0") as cp:
            await cp.publish_status(0, "stopped")  # rank 0 acknowledged an earlier stop
        async with ControlPlane(url, "stopgone", "stopgone-will-1") as will:
            await will.publish_status(1, "offline")  # rank 1's will: it never comes back

    asyncio.run(statuses())
    assert main(["job", "stop", "--mqtt", url, "--job", "stopgone"]) == 0
    out = capsys.readouterr().out
    assert "every agent acknowledged except ranks 1, which are offline" in out and "were not told" in out, out
    # the plan is no longer held: an agent started now waits for 'job start' (it adopted the held re-plan, and
    # 'job start' with the original plan was refused as 'running another plan': an operator's trial)
    assert "its plan is no longer held on the broker" in out

    async def held_plan() -> object:
        async with ControlPlane(url, "stopgone", "stopgone-agent-2") as late:
            async with await late.subscribe("plan"):
                await asyncio.sleep(1.0)  # a retained plan would have arrived
                return late.plan()

    assert asyncio.run(held_plan()) is None


def test_stopping_a_job_whose_agents_had_all_ended_says_so(embedded_broker, capsys) -> None:
    """Every agent stopped or failed already: 'every agent acknowledged' was printed (a trial); nothing had."""
    from geosched.cli import main

    url = embedded_broker.url_for("geosched")

    async def statuses() -> None:
        for rank, state in ((0, "stopped"), (1, "stopped"), (2, "error")):
            async with ControlPlane(url, "stopdone", f"stopdone-agent-{rank}") as cp:
                await cp.publish_status(rank, state)

    asyncio.run(statuses())
    assert main(["job", "stop", "--mqtt", url, "--job", "stopdone"]) == 0
    out = capsys.readouterr().out
    assert "job 'stopdone': every agent had ended already (1 error, 2 stopped); nothing to acknowledge" in out, out
    assert "every agent acknowledged" not in out


def test_stopping_a_job_no_agent_has_is_refused_not_reported_done(embedded_broker, capsys) -> None:
    """A mistyped --job printed "job 'nosuchjob' stopped: every agent acknowledged", exit 0 (a trial)."""
    from geosched.cli import main

    url = embedded_broker.url_for("geosched")
    assert main(["job", "stop", "--mqtt", url, "--job", "nosuchjob"]) == 2
    err = capsys.readouterr().err
    assert "job 'nosuchjob': no agent of it has a status on this broker" in err and len(err.splitlines()) == 1


def test_a_job_stop_ends_a_coordinator_waiting_for_agents_that_never_come(embedded_broker, tmp_path) -> None:
    """An elastic re-plan waiting for its agents (none restarted): 'job stop' cleared the plan and said every agent
    acknowledged, but the coordinator waited out its ready timeout and then blamed the agents (a re-test)."""
    import pytest
    from agent_helpers import tiny_plan

    from agents.control.coordinator import start_job
    from agents.control.losses import JobStopped

    url = embedded_broker.url_for("geosched")
    plan = tiny_plan(tmp_path, ["us", "eu"]).read_text()

    async def run() -> None:
        coordinator = asyncio.create_task(start_job(url, "stopwait", plan, steps=2, ready_timeout_s=600.0, out=None))
        await asyncio.sleep(1.5)  # the plan published, waiting for ranks 0 and 1
        async with ControlPlane(url, "stopwait", "stopwait-stop") as operator:
            await operator.publish_command("stop")  # what 'geosched job stop' sends
        async with asyncio.timeout(60):
            await coordinator

    with pytest.raises(JobStopped, match="stopped by 'geosched job stop' while it waited for its agents"):
        asyncio.run(run())


def test_a_broker_gone_after_it_took_the_stop_is_said_at_once(capsys) -> None:
    """A broker that took the stop and then went away: 'job stop' re-sent the stop into the void and failed
    'command not delivered: broker unreachable for 10 s' (a trial, against a launch, whose broker ended with the
    job it stopped). It now says, within seconds, which ranks it could not confirm; still exit 1: a broker's
    acknowledgement is no agent's (a later trial's relay acknowledged the stop, dropped it and hung up)."""
    import threading

    from mqtt_brokers import running_broker

    from geosched.cli import main

    got_stop = threading.Event()
    codes: list[int] = []
    with running_broker("embedded", None) as broker:
        url = broker.url_for("geosched")

        async def agent() -> None:  # rank 0 takes the stop, and the job ends before its status says so
            async with ControlPlane(url, "stopbye", "stopbye-agent-0") as cp:
                async with await cp.subscribe("command") as sub:
                    await cp.publish_status(0, "training")
                    while not got_stop.is_set():
                        message = await sub.get(30.0)
                        if isinstance(message, CommandMessage) and message.cmd == "stop":
                            got_stop.set()

        threading.Thread(target=asyncio.run, args=(agent(),), daemon=True).start()
        time.sleep(1.0)  # its status is retained
        args = ["job", "stop", "--mqtt", url, "--job", "stopbye"]
        stopper = threading.Thread(target=lambda: codes.append(main(args)))
        stopper.start()
        assert got_stop.wait(30.0)
    stopper.join(30.0)  # the broker is gone
    assert codes == [1]
    err = capsys.readouterr().err
    assert "the stop reached the broker, which went away before rank 0 acknowledged it; unconfirmed" in err, err
    assert "not delivered" not in err
