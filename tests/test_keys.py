"""A job's key folder: `geosched keys DIR --ranks N`, load_job_keys, and the verbs that take `--keys DIR`."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zmq

from agents.keys import load_job_keys, write_job_keys
from agents.sockets import CurveServer, load_keypair, load_public_key
from geosched.cli import main
from geosched.errors import ConfigError, InputError

ROOT = Path(__file__).resolve().parent.parent


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_key_folder_holds_every_identity_with_mode_0600(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "secrets"
    assert main(["keys", str(folder), "--ranks", "3", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ranks"] == 3
    names = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    identities = ["coordinator", "agent-0", "agent-1", "agent-2"]
    expected = {"job-keys.json", "prefill.token"}
    expected |= {f"{i}.sign" for i in identities} | {f"{i}.sign.pub" for i in identities}
    expected |= {f"agent-{r}.key" for r in range(3)} | {f"agent-{r}.key.pub" for r in range(3)}
    expected |= {f"mqtt/{i}.password" for i in identities}
    assert names == expected
    assert {str(p) for kind in ("signing", "curve", "prefill", "mqtt", "manifest") for p in info[kind]} == {
        str(folder / n) for n in expected
    }
    assert _mode(folder) == 0o700 and _mode(folder / "mqtt") == 0o700
    assert all(_mode(folder / n) == 0o600 for n in names), {n: oct(_mode(folder / n)) for n in names}

    keys = load_job_keys(folder)
    assert keys.ranks == 3
    message = keys.signing_key("agent-1").sign(b"status")
    assert keys.agent_keys[1].verify(message) == b"status"
    assert keys.coordinator_key.verify(keys.signing_key("coordinator").sign(b"plan")) == b"plan"
    assert len({bytes(k) for k in keys.verify_keys.values()}) == 4  # one key per identity
    public, secret = keys.curve_keypair(2)
    assert (public, secret) == load_keypair(folder / "agent-2.key")
    assert keys.curve_public(2) == load_public_key(folder / "agent-2.key.pub") == public
    assert len({keys.curve_public(r) for r in range(3)}) == 3
    assert len(keys.prefill_token()) >= 43  # 32 random bytes, urlsafe base64
    users = keys.mqtt_users()
    assert set(users) == set(identities) and len(set(users.values())) == 4
    assert all(len(pw) >= 32 for pw in users.values())
    identity, signing, coordinator, agents = keys.control_fields("agent-2")
    assert identity == "agent-2" and signing == keys.signing_key("agent-2")
    assert coordinator == keys.coordinator_key and agents == keys.agent_keys


def test_keys_text_output_is_one_line_per_file_class(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", str(tmp_path / "k"), "--ranks", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and lines[-1].startswith("wrote 15 files (mode 0600) for 2 ranks")
    assert any("prefill token" in line for line in lines) and any("MQTT passwords" in line for line in lines)
    # each file by its path in the folder (a trial's listed coordinator.password, which is under mqtt/)
    named = [name for line in lines[:-1] for name in line.split(": ")[-1].split(", ") if name != "..."]
    assert "mqtt/coordinator.password" in named and all((tmp_path / "k" / name).is_file() for name in named), named


def test_keys_refuses_a_folder_under_a_missing_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As plan/export/profile -o: a mistyped parent is one line, exit 2, not a chain of folders made (a trial's
    `keys /nonexistent/k --ranks 2` made /nonexistent)."""
    from agent_helpers import tiny_plan

    for argv in (["--ranks", "2"], ["--plan", str(tiny_plan(tmp_path))]):
        assert main(["keys", str(tmp_path / "missing" / "k"), *argv]) == 2
        err = capsys.readouterr().err
        assert f"the folder {tmp_path / 'missing'} does not exist; make it first" in err and err.count("\n") == 1
        assert not (tmp_path / "missing").exists()


def test_keys_refuses_to_overwrite_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "k"
    assert main(["keys", str(folder), "--ranks", "2"]) == 0
    token = (folder / "prefill.token").read_text()
    capsys.readouterr()
    assert main(["keys", str(folder), "--ranks", "2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "already exists" in err and "--force" in err
    assert (folder / "prefill.token").read_text() == token  # nothing written
    assert main(["keys", str(folder), "--ranks", "2", "--force"]) == 0
    assert (folder / "prefill.token").read_text() != token


def test_two_writers_of_one_key_folder_never_mix_their_keys(tmp_path: Path) -> None:
    """A writer holds the folder locked: a second at once is refused in one line (a trial's two concurrent
    `geosched keys` both exited 0 and left a secret key beside the other's public key)."""
    import fcntl

    folder = tmp_path / "k"
    folder.mkdir()
    held = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # another writer, part-way through
        with pytest.raises(InputError, match="another 'geosched keys' is writing into it"):
            write_job_keys(folder, 2, force=True)
    finally:
        os.close(held)
    assert list(folder.iterdir()) == []
    cmd = [sys.executable, "-m", "geosched.cli", "keys", "--ranks", "8"]
    for n in range(4):  # really at once: one writes a whole folder, the other is refused
        target = tmp_path / f"race{n}"
        pair = [subprocess.Popen([*cmd, str(target)], stderr=subprocess.PIPE, text=True) for _ in range(2)]
        codes = sorted(p.wait(60) for p in pair)
        assert codes == [0, 2], codes  # never both: the later one finds the lock, or the files of the first
        keys = load_job_keys(target)
        for rank in range(8):
            public, secret = load_keypair(target / f"agent-{rank}.key")
            assert zmq.curve_public(secret) == public == load_public_key(target / f"agent-{rank}.key.pub")
        assert all(keys.signing_keys[who].verify_key == keys.verify_keys[who] for who in keys.signing_keys)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--ranks", "0"], "--ranks: must be between 1 and 8192 (got 0)"),
        (["--ranks", "2", "--name", "x"], "--name writes one CURVE keypair"),
        (["--ranks", "2", "--plan", "p.yaml"], "either --ranks N or --plan PLAN"),
    ],
)
def test_keys_bad_flags_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    assert main(["keys", str(tmp_path / "k"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err, err
    assert not (tmp_path / "k").exists()  # refused before the folder is made


def test_keys_never_go_into_a_folder_of_other_files_nor_an_empty_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its mode becomes 0700: a shared folder (mode 1777, like /tmp) once lost its sticky bit and got 10 secret
    files among its own; '' wrote them into the current folder."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "theirs.txt").write_text("x")
    assert main(["keys", str(shared), "--ranks", "1"]) == 2
    assert "holds other files" in capsys.readouterr().err
    assert (shared.stat().st_mode & 0o7777) == 0o1777 and [p.name for p in shared.iterdir()] == ["theirs.txt"]
    monkeypatch.chdir(tmp_path)
    assert main(["keys", "", "--ranks", "2"]) == 2
    assert "an empty name" in capsys.readouterr().err and sorted(p.name for p in tmp_path.iterdir()) == ["shared"]


def test_keys_from_a_plan_count_its_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agent_helpers import tiny_plan

    plan = tiny_plan(tmp_path, dp=2)  # 2 stages x 2 replicas
    assert main(["keys", str(tmp_path / "k"), "--plan", str(plan), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"] == 4
    assert load_job_keys(tmp_path / "k").ranks == 4


def test_single_curve_keypair_form_still_works(tmp_path: Path) -> None:
    assert main(["keys", str(tmp_path), "--name", "eu-0"]) == 0
    assert CurveServer.from_files(tmp_path / "eu-0.key").public_key == load_public_key(tmp_path / "eu-0.key.pub")


def _break_missing_manifest(folder: Path) -> str:
    (folder / "job-keys.json").unlink()
    return "job-keys.json is missing"


def _break_missing_public(folder: Path) -> str:
    (folder / "agent-1.sign.pub").unlink()
    return "agent-1.sign.pub is missing"


def _break_missing_curve_public(folder: Path) -> str:
    (folder / "agent-0.key.pub").unlink()
    return "agent-0.key.pub is missing"


def _break_readable_secret(folder: Path) -> str:
    os.chmod(folder / "agent-0.sign", 0o640)
    return "agent-0.sign is readable by others (mode 0640): run chmod 600"


def _break_readable_password(folder: Path) -> str:
    os.chmod(folder / "mqtt" / "coordinator.password", 0o604)
    return "coordinator.password is readable by others (mode 0604)"


def _break_mismatched_key(folder: Path) -> str:
    shutil.copy(folder / "agent-0.sign", folder / "agent-1.sign")
    return "agent-1.sign does not match"


def _break_manifest(folder: Path) -> str:
    (folder / "job-keys.json").write_text("{" * 100)
    return "is not a geosched key manifest"


def _break_manifest_nesting(folder: Path) -> str:
    (folder / "job-keys.json").write_text("[" * 4000)  # json's decoder recurses per bracket (within the 4 KiB bound)
    return "is not a geosched key manifest"


def _break_public_into_a_device(folder: Path) -> str:
    (folder / "coordinator.sign.pub").unlink()
    (folder / "coordinator.sign.pub").symlink_to("/dev/zero")  # read whole, it filled memory (a trial)
    return "coordinator.sign.pub: cannot read the key file (a character device, not a regular file)"


def _break_secret_into_a_fifo(folder: Path) -> str:
    (folder / "agent-0.sign").unlink()
    os.mkfifo(folder / "agent-0.sign", 0o600)  # read, it blocked forever
    return "agent-0.sign: cannot read the key file (a FIFO, not a regular file)"


def _break_curve_key_into_a_device(folder: Path) -> str:
    (folder / "agent-1.key.pub").unlink()
    (folder / "agent-1.key.pub").symlink_to("/dev/zero")  # zmq reads it line by line: one endless line
    return "agent-1.key.pub: cannot read the key file (a character device, not a regular file)"


def _break_huge_public(folder: Path) -> str:
    (folder / "coordinator.sign.pub").write_bytes(b"A" * 100_000)
    return "coordinator.sign.pub: larger than 4096 bytes, not a key file"


def _break_malformed_key(folder: Path) -> str:
    (folder / "coordinator.sign.pub").write_text("not base64 at all\n")
    return "coordinator.sign.pub holds a malformed key"


@pytest.mark.parametrize(
    "damage",
    [
        _break_missing_manifest,
        _break_missing_public,
        _break_missing_curve_public,
        _break_readable_secret,
        _break_readable_password,
        _break_mismatched_key,
        _break_manifest,
        _break_manifest_nesting,
        _break_malformed_key,
        _break_public_into_a_device,
        _break_secret_into_a_fifo,
        _break_curve_key_into_a_device,
        _break_huge_public,
    ],
)
def test_load_errors_name_the_file_in_one_line(tmp_path: Path, damage) -> None:
    folder = tmp_path / "k"
    write_job_keys(folder, 2)
    fragment = damage(folder)
    with pytest.raises(ConfigError) as info:
        load_job_keys(folder)
    text = str(info.value)
    assert "\n" not in text and fragment in text, text


def test_missing_folder_and_absent_secrets(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist: make one with 'geosched keys"):
        load_job_keys(tmp_path / "nowhere")
    (tmp_path / "token").write_text("x")  # a file of the folder given for it: not 'make one' (it would overwrite)
    with pytest.raises(ConfigError, match="is a file, not a key folder: give the folder that holds job-keys.json"):
        load_job_keys(tmp_path / "token")
    folder = tmp_path / "k"
    write_job_keys(folder, 2)
    for name in ("agent-1.sign", "agent-1.key", "prefill.token", "mqtt/agent-1.password"):
        (folder / name).unlink()
    keys = load_job_keys(folder)  # a machine holds only its own secrets: that loads
    assert keys.signing_key("agent-0") is not None and keys.curve_keypair(0)
    for ask, missing in (
        (lambda: keys.signing_key("agent-1"), "agent-1.sign is missing"),
        (lambda: keys.curve_keypair(1), "agent-1.key is missing"),
        (keys.prefill_token, "prefill.token is missing"),
        (lambda: keys.mqtt_password("agent-1"), "agent-1.password is missing"),
    ):
        with pytest.raises(ConfigError, match=missing):
            ask()
    assert keys.curve_public(1) == load_public_key(folder / "agent-1.key.pub")
    with pytest.raises(InputError, match="rank 5 is not in the key folder"):
        keys.curve_public(5)
    with pytest.raises(InputError, match="identity 'agent-9' is not in the key folder"):
        keys.signing_key("agent-9")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "geosched.cli", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_a_token_or_ca_file_that_is_no_file_is_named_as_such(tmp_path: Path) -> None:
    """A trial: a FIFO as --token-file hung; /dev/zero was 'readable by others: chmod 600 /dev/zero' and as
    --ca-file 'does not exist'."""
    os.mkfifo(tmp_path / "fifo", 0o600)
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    base = ["prefill", "--endpoint", "https://127.0.0.1:9", "hi"]
    for flags, said in (
        (["--token-file", str(tmp_path / "fifo")], "--token-file: {}: cannot read (a FIFO, not a regular file)"),
        (["--token-file", "/dev/zero"], "--token-file: {}: cannot read (a character device, not a regular file)"),
        (["--token-file", str(token), "--ca-file", "/dev/zero"], "--ca-file: '{}' is a character device, not a file"),
    ):
        done = _cli(*base, *flags)
        named = str(tmp_path / "fifo") if "fifo" in flags[1] else "/dev/zero"
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert said.format(named) in done.stderr, done.stderr


def test_agent_with_keys_refuses_a_missing_or_unsafe_file_in_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "k"
    write_job_keys(folder, 2)
    (folder / "agent-1.key").unlink()
    # an unreachable broker: the check must come before any connection attempt
    base = ["agent", "--mqtt", "mqtt://127.0.0.1:9", "--rank"]
    done = _cli(*base, "1", "--keys", str(folder))
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "agent-1.key is missing" in done.stderr
    done = _cli(*base, "4", "--keys", str(folder))
    assert done.returncode == 2 and "rank 4 is not in the key folder" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    os.chmod(folder / "prefill.token", 0o644)
    done = _cli(*base, "0", "--keys", str(folder), "--prefill-bind", "tcp://127.0.0.1:0")
    assert done.returncode == 2 and "prefill.token is readable by others" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    token = tmp_path / "token"
    token.write_text("x" * 40)
    os.chmod(token, 0o644)
    done = _cli(*base, "0", "--prefill-bind", "tcp://127.0.0.1:0", "--prefill-token-file", str(token))
    assert done.returncode == 2 and "--prefill-token-file" in done.stderr and "chmod 600" in done.stderr
    done = _cli("job", "stop", "--mqtt", "mqtt://127.0.0.1:9", "--keys", str(tmp_path / "none"))
    assert done.returncode == 2 and "does not exist: make one with 'geosched keys" in done.stderr


@pytest.fixture(scope="module")
def secured_prefill(tmp_path_factory: pytest.TempPathFactory):
    """A prefill service with the folder's token and rank 0's CURVE keypair, as ``geosched agent --keys`` runs it."""
    from agents.prefill.model import load_inference_model
    from agents.prefill.service import PrefillService
    from geosched.config import load_config

    folder = tmp_path_factory.mktemp("keys") / "k"
    write_job_keys(folder, 2)
    keys = load_job_keys(folder)
    model = load_inference_model(load_config(ROOT / "configs/demo-3dc.yaml").job.model, None, seed=0)
    with PrefillService(model, auth_token=keys.prefill_token(), curve_server=keys.prefill_server(0)) as service:
        stop = threading.Event()
        worker = threading.Thread(target=service.serve_idle, args=(stop.is_set,), daemon=True)
        worker.start()
        yield folder, service
        stop.set()
        worker.join(10)


def test_prefill_with_keys_sends_the_token_over_curve(secured_prefill, capsys) -> None:
    folder, service = secured_prefill
    argv = ["prefill", "--endpoint", service.endpoint, "--json", "--timeout", "20"]
    assert main([*argv, "--keys", str(folder), "--rank", "0", "hello"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "ok"
    assert main([*argv, "--token-file", str(folder / "prefill.token"), "--keys", str(folder), "--rank", "0", "hi"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "ok"
    # the agent's public key and a client key of one's own (an attacker's trial: then a multipart message
    # that never ends, buffered whole by libzmq): refused at the CURVE handshake, only the token's key connects
    from agents.keys import load_job_keys as reload
    from agents.prefill.client import PrefillClient
    from agents.sockets import CurveClient
    from geosched.errors import LinkError

    server_pub = folder / "agent-0.key.pub"
    client = folder.parent / "client"
    client.mkdir(exist_ok=True)
    main(["keys", str(client), "--name", "c", "--force"])
    capsys.readouterr()
    own = CurveClient.from_files(client / "c.key", server_pub)
    with PrefillClient(service.endpoint, token=reload(folder).prefill_token(), curve_client=own) as stranger:
        with pytest.raises(LinkError, match="refused this client's CURVE key"):
            stranger.prefill("hello", timeout_s=600)
    assert service.metrics()["received"] == 2 and service.metrics()["curve_refused"] >= 1  # the token's key: 2
    assert reload(folder).prefill_token()  # the folder is untouched
    assert main([*argv, "--keys", str(folder), "hello"]) == 2
    assert "--keys needs --rank R" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["ü", "n" * 300, "a b", ".hidden", "x\nkey"])
def test_a_keypair_name_that_cannot_name_its_files_is_refused_and_nothing_written(tmp_path: Path, name: str) -> None:
    assert main(["keys", str(tmp_path), "--name", name]) == 2
    assert list(tmp_path.iterdir()) == []
