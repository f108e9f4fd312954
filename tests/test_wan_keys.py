"""`geosched keys`: CURVE keypair files the WAN links load."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import zmq.auth

from agents.sockets import CurveClient, CurveServer, load_allowed_keys, load_keypair, load_public_key
from geosched.cli import main
from geosched.errors import ConfigError


def test_keys_writes_a_loadable_keypair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", str(tmp_path), "--name", "eu-0", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    secret, public = tmp_path / "eu-0.key", tmp_path / "eu-0.key.pub"
    assert info["secret_key_file"] == str(secret) and info["public_key_file"] == str(public)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pub, sec = load_keypair(secret)
    assert load_public_key(public) == pub and info["public_key"] == pub.decode() and len(sec) == 40
    assert "secret-key" not in public.read_text()
    assert load_allowed_keys(tmp_path) == {pub}
    server = CurveServer.from_files(secret, tmp_path)
    client = CurveClient.from_files(secret, public)
    assert server.allowed_clients == {pub} and client.server_key == pub


def test_keys_refuses_to_overwrite_and_bad_places(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", str(tmp_path), "--name", "a"]) == 0
    assert main(["keys", str(tmp_path), "--name", "a"]) == 2
    assert "already exists: pick another --name or pass --force" in capsys.readouterr().err
    assert main(["keys", str(tmp_path), "--name", "a", "--force"]) == 0
    assert main(["keys", str(tmp_path / "new" / "folder"), "--name", "a"]) == 0  # made, as --ranks makes its folder
    assert (tmp_path / "new" / "folder" / "a.key").is_file() and (
        tmp_path / "new" / "folder"
    ).stat().st_mode & 0o77 == 0
    assert main(["keys", str(tmp_path / "a.key" / "below"), "--name", "a"]) == 2  # under a file
    assert main(["keys", str(tmp_path), "--name", "../a"]) == 2
    assert main(["keys", str(tmp_path)]) == 2  # neither a job's folder nor a keypair: which?
    err = capsys.readouterr().err
    assert "cannot make it" in err and "'../a': use 1-64 characters" in err and "give --ranks N (or --plan" in err


def test_loading_wrong_key_files_is_a_config_error(tmp_path: Path) -> None:
    main(["keys", str(tmp_path), "--name", "x"])
    with pytest.raises(ConfigError, match=r"holds no secret key: pass the NAME\.key file"):
        load_keypair(tmp_path / "x.key.pub")
    with pytest.raises(ConfigError, match="nope.key is missing: copy it from the job's key folder"):
        load_keypair(tmp_path / "nope.key")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no \*.key.pub files"):
        load_allowed_keys(tmp_path / "empty")
    (tmp_path / "text.key").write_text("# a comment\nnot a certificate\n")
    with pytest.raises(ConfigError, match="text.key'?: no public key in it"):
        load_keypair(tmp_path / "text.key")
    short = (tmp_path / "x.key").read_text().replace('secret-key = "', 'secret-key = "ab')
    (tmp_path / "long.key").write_text(short)
    with pytest.raises(ConfigError, match="holds a malformed key"):
        load_keypair(tmp_path / "long.key")
    public, secret = load_keypair(tmp_path / "x.key")  # read once, parsed as zmq.auth does
    assert (public, secret) == zmq.auth.load_certificate(tmp_path / "x.key")
