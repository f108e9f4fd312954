"""``geosched agent --prefill-bind``: the agent serves prefill in its bubbles and reports it on MQTT.

Two agent processes (tiny job, us -> eu) with prefill on: each publishes its
bound prefill endpoint in its status (rank 0 also its HTTPS front end's URL, which
answers a completion over TLS with a certificate the test's CA signed), answers a request before the job starts,
every request sent while it trains and, idle afterwards, 40 sent at once; every
per-step metrics message carries the service's metrics.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import aiomqtt
import pytest
from agent_helpers import log_tail, spawn_agent, stop_processes, tiny_plan

from agents.control.coordinator import start_job

pytestmark = pytest.mark.slow
HTTP = ["--prefill-http", "127.0.0.1:0"]


def _send_prompts(endpoints: dict[int, str], stop: threading.Event, answers: list, sent: list) -> None:
    """Send a prompt to each endpoint every 20 ms until ``stop``; then collect the answers (deadline 3 s)."""
    from agents.prefill.client import PrefillClient
    from geosched.errors import LinkError

    clients = [PrefillClient(ep) for ep in endpoints.values()]
    try:
        while not stop.is_set():
            for client in clients:
                sent.append(client.submit(b"geosched prefill %d" % len(sent), deadline_s=3.0, return_kv=False))
            time.sleep(0.02)
        end = time.monotonic() + 8.0
        while len(answers) < len(sent) and time.monotonic() < end:
            for client in clients:
                try:
                    answers.append(client.receive(0.05))
                except LinkError:
                    pass
    finally:
        for client in clients:
            client.close()


def _prompts(endpoint: str, n: int) -> list:
    """Send ``n`` prompts at once to ``endpoint``; their answers (deadline 5 s), in any order."""
    from agents.prefill.client import PrefillClient

    client = PrefillClient(endpoint)
    try:
        for k in range(n):
            client.submit(b"prompt %d" % k, deadline_s=5.0, return_kv=False)
        return [client.receive(10.0) for _ in range(n)]
    finally:
        client.close()


def _http_completion(url: str, prompt: str, ca: Path) -> dict:
    """POST /v1/completions to an agent's prefill HTTPS front end (a real client trusting ``ca``); the JSON answer."""
    import urllib.request

    from agents.tls.context import client_context

    body = json.dumps({"prompt": prompt, "max_tokens": 1, "logprobs": 3}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30, context=client_context(ca)) as reply:
        return json.loads(reply.read())


def test_agent_serves_prefill_and_publishes_its_metrics(mqtt_broker, tmp_path: Path):
    from agents.tls.selfsigned import write_rehearsal_tls

    url, job = mqtt_broker.url_for("geosched"), "pf"
    plan = tiny_plan(tmp_path).read_text()
    tls = write_rehearsal_tls(tmp_path / "tls")
    https = [*HTTP, "--prefill-http-tls-cert", str(tls.cert), "--prefill-http-tls-key", str(tls.key)]
    binds = ["tcp://127.0.0.1:0", "tcp://0:0"]  # rank 1 on every interface (the any-address, tersely written)
    agents = [
        spawn_agent(url, job, rank, dc, tmp_path, "--prefill-bind", binds[rank], *(https if rank == 0 else []))
        for rank, dc in enumerate(["us", "eu"])
    ]
    stop, answers, sent, endpoints, early = threading.Event(), [], [], {}, []
    sender: list[threading.Thread] = []

    async def before_start(statuses: dict) -> dict:
        for rank, status in statuses.items():
            endpoints[rank] = status.extra["endpoints"][f"prefill/r{rank}"]
        http_url = statuses[0].extra["endpoints"]["prefill-http/r0"]  # rank 0 also serves OpenAI-style HTTP
        assert http_url.startswith("https://127.0.0.1:")
        early.append(await asyncio.to_thread(_http_completion, http_url, "geosched", tls.ca))
        early.append(await asyncio.to_thread(_prompts, endpoints[0], 1))  # before any training: served at once
        thread = threading.Thread(target=_send_prompts, args=(endpoints, stop, answers, sent), daemon=True)
        thread.start()
        sender.append(thread)
        return {}

    async def run() -> list[dict]:
        metrics: list[dict] = []
        user = "watcher" if mqtt_broker.users else None
        async with aiomqtt.Client(
            mqtt_broker.host, mqtt_broker.port, username=user, password=mqtt_broker.users[user] if user else None
        ) as client:
            await client.subscribe(f"geosched/{job}/agents/+/metrics", qos=0)

            async def collect() -> None:
                async for message in client.messages:
                    metrics.append(json.loads(bytes(message.payload)))

            task = asyncio.create_task(collect())
            await start_job(url, job, plan, steps=3, ready_timeout_s=60, before_start=before_start)
            await asyncio.sleep(0.5)
            task.cancel()
        return metrics

    try:
        metrics = asyncio.run(run())
        stop.set()
        sender[0].join(20)
        # published at --bind-host (127.0.0.1 by default), with a warning that only this host reaches it
        assert sorted(endpoints) == [0, 1] and all(ep.startswith("tcp://127.0.0.1:") for ep in endpoints.values())
        assert "--prefill-bind serves every interface" in (tmp_path / "agent1.log").read_text()
        assert sent and len(answers) == len(sent), log_tail(tmp_path)
        assert {a.status for a in answers} <= {"ok", "rejected", "expired"}
        assert any(a.status == "ok" and a.first_token is not None for a in answers)
        assert sorted((m["rank"], m["step"]) for m in metrics) == [(r, s) for r in (0, 1) for s in range(3)]
        for m in metrics:
            assert {
                "prefill_tokens_per_s",
                "ttft_p50_ms",
                "ttft_p99_ms",
                "rejected",
                "expired",
                "training_compute_s",
                "prefill_compute_s",
                "idle_s",
            } <= set(m["prefill"])
        assert sum(m["prefill"]["prefill_tokens"] for m in metrics if m["step"] == 2) > 0
        assert [a.status for a in early[1]] == ["ok"], early
        assert early[0]["object"] == "text_completion" and early[0]["usage"]["prompt_tokens"] == 8, early
        # after training the agent is idle: 40 prompts at once are all taken (no stale bubble share)
        assert [a.status for a in _prompts(endpoints[1], 40)] == ["ok"] * 40, log_tail(tmp_path)
    finally:
        stop.set()
        stop_processes(agents)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["agent", "--mqtt", "mqtt://127.0.0.1:1", "--rank", "0", "--prefill-bind", "udp://x"], "--prefill-bind"),
        (
            ["agent", "--mqtt", "mqtt://127.0.0.1:1", "--rank", "0", "--prefill-weights", "w.safetensors"],
            "needs --prefill-bind",
        ),
        (
            [
                "agent",
                "--mqtt",
                "mqtt://127.0.0.1:1",
                "--rank",
                "0",
                "--prefill-bind",
                "tcp://127.0.0.1:0",
                "--prefill-weights",
                "missing.safetensors",
            ],
            "does not exist",
        ),
        (["agent", "--mqtt", "mqtt://127.0.0.1:1", "--rank", "0", *HTTP], "--prefill-http needs --prefill-bind"),
        (
            ["agent", "--mqtt", "mqtt://127.0.0.1:1", "--rank", "0", "--prefill-bind", "tcp://127.0.0.1:0"]
            + ["--prefill-http", "localhost"],
            "--prefill-http: expected HOST:PORT",
        ),
        (["launch", "configs/demo-3dc.yaml", "--prefill-rate", "-1"], "--prefill-rate"),
    ],
)
def test_prefill_flags_bad_input_is_one_clear_line(args: list[str], needle: str, tmp_path: Path):
    import subprocess

    from agent_helpers import cli
    from mqtt_brokers import agent_subprocess_env

    done = subprocess.run(
        cli(*args),
        capture_output=True,
        text=True,
        timeout=60,
        env=agent_subprocess_env(),
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 2 and needle in done.stderr and "Traceback" not in done.stderr, done.stderr
