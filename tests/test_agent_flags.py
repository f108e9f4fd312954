"""``geosched agent`` (and ``job start``) flags a host cannot honour are refused at once, in one line, exit 2.

Among them the HTTP endpoints' TLS choice: a certificate and its key, or plain HTTP asked for by name.
"""

from __future__ import annotations

import pytest
import torch

from geosched.cli import main

BASE = ["agent", "--mqtt", "mqtt://127.0.0.1:1", "--rank", "0", "--connect-timeout", "1"]
HTTP = ["--prefill-bind", "tcp://127.0.0.1:0", "--prefill-http", "127.0.0.1:0"]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--bind-host", "192.0.2.1"], "--bind-host 192.0.2.1: not an address of this host"),  # TEST-NET-1
        (["--bind-host", "no-such-host.invalid"], "not an address or resolvable name"),
        # these passed the check and failed once the agent ran (exit 1), or bound another port (a hostile trial)
        (["--bind-host", "*"], "--bind-host *: the any-address; the agent publishes it to its peers"),
        (["--bind-host", "::"], "--bind-host ::: the any-address; the agent publishes it"),  # the job hung 300 s
        (["--bind-host", "::0"], "--bind-host ::0: the any-address;"),  # however written (a re-test)
        (["--bind-host", "0"], "--bind-host 0: the any-address;"),
        (["--bind-host", "224.0.0.1"], "--bind-host 224.0.0.1: a multicast or broadcast address;"),
        (["--bind-host", "0.0.0.0"], "give this host's address, the one the other hosts reach it by"),
        (["--bind-host", "::ffff:127.0.0.1"], "an IPv4-mapped IPv6 address; give the IPv4 address 127.0.0.1"),
        (["--bind-host", "fe80::1%lo"], "--bind-host fe80::1%lo: an address with a scope"),
        (["--bind-host", "[::1]"], "--bind-host [::1]: an address, without brackets (--bind-host ::1)"),
        (["--prefill-bind", "tcp://127.0.0.1:70000"], "--prefill-bind: endpoint 'tcp://127.0.0.1:70000': port 70000"),
        (["--prefill-bind", "tcp://127.0.0.1:-5"], "port -5 is not a number (0-65535)"),
        (["--prefill-bind", "tcp://::1:0"], "--prefill-bind: endpoint 'tcp://::1:0': an IPv6 host goes in brackets"),
        (["--prefill-bind", "tcp://[::1]:abc"], "port abc is not a number"),
        (["--prefill-bind", "tcp://192.0.2.1:0"], "--prefill-bind 192.0.2.1: not an address of this host"),
        (["--peer-override", "pipe/s1/r0=tcp://fd00:61::3:4000"], "an IPv6 host goes in brackets"),
        (["--peer-override", "pipe/s1/r0=tcp://10.0.0.5:70000"], "port 70000 is out of range (1-65535)"),
        (["--resume"], "--resume, --checkpoint-every and --checkpoint-keep need --checkpoint-dir DIR"),
        (["--checkpoint-keep", "2"], "--checkpoint-keep need --checkpoint-dir DIR"),
        (["--checkpoint-dir", "c", "--checkpoint-keep", "-1"], "--checkpoint-keep: must be >= 0"),
        (HTTP, "--prefill-http: serve it over TLS (--prefill-http-tls-cert FILE --prefill-http-tls-key FILE), or"),
        ([*HTTP, "--prefill-http-tls-cert", "c.pem"], "--prefill-http-tls-cert and --prefill-http-tls-key go together"),
        ([*HTTP, "--prefill-http-tls-cert", "c", "--prefill-http-tls-key", "k"], "'c' does not exist"),
        ([*HTTP, "--prefill-http-tls-cert", "README.md", "--prefill-http-tls-key", "k"], "-tls-key: 'k' does"),
        ([*HTTP, "--prefill-http-insecure", "--prefill-http-limit", "max_inflight=0"], "max_inflight: must be between"),
        (["--prefill-http-insecure"], "--prefill-http-insecure goes with --prefill-http HOST:PORT"),
        (["--metrics-bind", "127.0.0.1:0"], "--metrics-bind: serve it over TLS (--metrics-tls-cert FILE"),
        (["--metrics-bind", "[::1"], "--metrics-bind: an IPv6 host goes in brackets, then :PORT"),  # was '[:]:1'
        (["--metrics-bind", "::1:0"], "--metrics-bind: an IPv6 host goes in brackets"),  # --prefill-bind's rule
        # bound on IPv4 only and published at an IPv6 --bind-host: nobody could connect (a re-test)
        (["--bind-host", "::1", "--metrics-bind", "0:0"], "--metrics-bind 0:0: listens on IPv4 only, but is"),
        (["--bind-host", "::1", "--prefill-bind", "tcp://*:0"], "--prefill-bind tcp://*:0: listens on IPv4 only"),
        (["--bind-host", "::1", "--prefill-bind", "tcp://0.0.0.0:0"], "bind every interface as [::] instead"),
        (["--metrics-tls-key", "k"], "--metrics-tls-key goes with --metrics-bind HOST:PORT"),
        (["--device", "gpu"], "--device 'gpu': expected cpu, cuda (GPU rank % GPUs) or cuda:N"),
        (["--device", "cuda:x"], "--device 'cuda:x': expected cpu, cuda"),
        pytest.param(
            ["--device", "cuda"],
            "--device cuda: this torch",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU"),
        ),
        pytest.param(
            ["--device", "cuda:999"],
            "--device cuda:999: this host has",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"),
        ),
    ],
)
def test_bad_agent_flags_are_one_line_before_any_connection(
    extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(BASE + extra) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_prefill_weights_that_are_no_safetensors_are_refused_at_start_without_a_plan(tmp_path, capsys) -> None:
    """An operator's trial: without --plan a truncated --prefill-weights file was taken, and failed only when a plan
    arrived; its header is read at start now (as with --plan), one line, exit 2, before the broker."""
    from safetensors.torch import save_file

    whole = tmp_path / "w.safetensors"
    save_file({"w": torch.zeros(64)}, str(whole))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(whole.read_bytes()[:20])
    text = tmp_path / "notes.safetensors"
    text.write_text("not weights at all\n" * 10)
    for path in (truncated, text):
        argv = [*BASE, "--prefill-bind", "tcp://127.0.0.1:0", "--prefill-weights", str(path)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"--prefill-weights: cannot read weights '{path}' as safetensors" in err and err.count("\n") == 1, err


def test_job_start_wants_tls_or_insecure_for_its_metrics(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from agent_helpers import tiny_plan

    start = ["job", "start", str(tiny_plan(tmp_path)), "--mqtt", "mqtt://127.0.0.1:1", "--metrics-bind", "127.0.0.1:0"]
    assert main(start) == 2
    err = capsys.readouterr().err
    assert "--metrics-bind: serve it over TLS (--metrics-tls-cert FILE --metrics-tls-key FILE)" in err, err


def test_launch_follows_checkpoints_only_with_a_folder(capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    config = str(Path(__file__).resolve().parent.parent / "configs" / "demo-3dc.yaml")
    assert main(["launch", config, "--prefill-follow-checkpoints"]) == 2
    assert "--prefill-follow-checkpoints needs --checkpoint-dir DIR (or --elastic)" in capsys.readouterr().err


@pytest.mark.parametrize("keep", ["0", "-2"])
@pytest.mark.parametrize("where", ["--checkpoint-dir", "--elastic"])
def test_launch_keeps_at_least_one_checkpoint(keep: str, where: str, tmp_path, capsys) -> None:
    """An operator's trial: `launch --checkpoint-keep 0` was taken and kept every checkpoint (the agents' 0);
    "keep the N newest" of 0 is refused, and leaving the flag out keeps every one."""
    from pathlib import Path

    config = str(Path(__file__).resolve().parent.parent / "configs" / "demo-3dc.yaml")
    folder = tmp_path / "ckpt"
    extra = ["--checkpoint-dir", str(folder)] if where == "--checkpoint-dir" else ["--elastic"]
    assert main(["launch", config, *extra, "--checkpoint-keep", keep, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"--checkpoint-keep: must be >= 1 (got {keep}); leave it out to keep every checkpoint" in err, err
    assert err.count("\n") == 1 and not folder.exists() and not (tmp_path / "run").exists()


def test_launch_resumes_only_from_a_folder_of_checkpoints(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    config = str(Path(__file__).resolve().parent.parent / "configs" / "demo-3dc.yaml")
    (tmp_path / "empty").mkdir()
    for extra, needle in (
        ([], "--resume needs --checkpoint-dir DIR"),
        (["--checkpoint-dir", str(tmp_path / "none")], "is not a checkpoint folder (no such directory)"),
        (["--checkpoint-dir", str(tmp_path / "empty")], "holds no checkpoint (no step-NNNNNN folder)"),
    ):
        assert main(["launch", config, "--resume", *extra]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--connect-timeout", "0"], "--connect-timeout: must be > 0"),
        (["--wan-chunk-bytes", "99999999999999"], "--wan-chunk-bytes: must be <= 16777216"),
        (["--data", "/nonexistent/*.txt"], "data pattern '/nonexistent/*.txt' matches no files"),
    ],
)
def test_flags_read_only_at_training_are_checked_before_the_broker(extra, needle, capsys) -> None:
    """Refused at once, not after 'cannot reach the broker' (here: nothing listens) or when training starts."""
    assert main(["agent", "--rank", "0", "--mqtt", "mqtt://127.0.0.1:9", *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_an_agent_raises_its_open_files_limit_to_the_hard_one() -> None:
    """Every peer connection holds a descriptor: a shell's soft default (1,024 here) is raised, never the hard."""
    import resource
    import subprocess
    import sys

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 256 if hard == resource.RLIM_INFINITY else min(256, hard)
    code = (
        "import resource; from geosched.processes import raise_open_files_limit as r; n = r(); "
        "print(n, resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    reported, now = map(int, done.stdout.split())
    expected = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    assert reported == now == max(low, expected)


def test_keys_decide_an_agents_broker_login_over_another_user_in_the_environment(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator's trial: an agent started with --keys from the coordinator's shell (GEOSCHED_MQTT_USERNAME=
    coordinator, as the multi-host guide exports it) logged in as the coordinator; the broker's ACL dropped its
    statuses and 'job start' waited for a running agent, 'ranks 0 (stopped)'."""
    import argparse
    from urllib.parse import unquote, urlsplit

    from agents.keys import load_job_keys, write_job_keys
    from geosched.commands.agent import mqtt_url

    write_job_keys(tmp_path / "k", 2)
    keys = load_job_keys(tmp_path / "k")
    args = argparse.Namespace(mqtt="mqtt://127.0.0.1:1883", job="demo")
    monkeypatch.setenv("GEOSCHED_MQTT_USERNAME", "coordinator")
    monkeypatch.setenv("GEOSCHED_MQTT_PASSWORD", keys.mqtt_password("coordinator"))
    login = urlsplit(mqtt_url(args, keys, "agent-0"))
    assert (login.username, unquote(login.password or "")) == ("agent-0", keys.mqtt_password("agent-0"))
    assert "warning: GEOSCHED_MQTT_USERNAME is 'coordinator', not as 'agent-0' of --keys" in capsys.readouterr().err
    assert urlsplit(mqtt_url(args, keys, "coordinator")).username == "coordinator"  # the same user: no warning
    assert capsys.readouterr().err == ""
    in_url = argparse.Namespace(mqtt=f"mqtt://coordinator:{keys.mqtt_password('coordinator')}@127.0.0.1:1883", job="d")
    assert urlsplit(mqtt_url(in_url, keys, "agent-0")).username == "coordinator"  # written in the URL: as written
    said = capsys.readouterr().err  # but an agent is told (a re-test's was denied without a word)
    assert "warning: the --mqtt URL logs in as 'coordinator', not as 'agent-0' of --keys: a broker with" in said
    own = argparse.Namespace(mqtt="mqtt://geosched:pw@127.0.0.1:1883", job="demo")  # a broker's own users
    assert urlsplit(mqtt_url(own, keys, "coordinator")).username == "geosched" and capsys.readouterr().err == ""
    monkeypatch.delenv("GEOSCHED_MQTT_USERNAME")
    assert urlsplit(mqtt_url(in_url, None, None)).username == "coordinator"  # no keys: the URL's login
