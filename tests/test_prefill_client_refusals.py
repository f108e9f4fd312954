"""`geosched prefill` against a keyed prefill endpoint (a real PrefillService with a job's key folder, as
``geosched agent --keys`` runs it): what a hostile tester's trial saw wait its whole --timeout now fails at
once, in one line: a wrong token (its CURVE key is refused), a plain client against CURVE, a malformed
tcp:// endpoint, a key of one's own (--curve-key)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefill_helpers import idle_worker

from agents.keys import load_job_keys, write_job_keys
from agents.prefill.client import PrefillClient
from agents.prefill.service import PrefillService
from agents.sockets import CurveClient, token_keypair
from geosched.cli import main
from geosched.errors import InputError, LinkError
from geosched.model import ModelShape, build_model

SHAPE = ModelShape(layers=1, hidden=16, heads=2, seq_len=32)
LONG = "600"  # --timeout: an answer that waited for it would say "no prefill response ... within 600 s"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, PrefillService]]:
    """A key folder and a service with its token and rank 0's CURVE keypair (only the token's key admitted)."""
    folder = tmp_path_factory.mktemp("keys") / "secrets"
    write_job_keys(folder, 2)
    keys = load_job_keys(folder)
    model = build_model(SHAPE, seed=1).eval()
    with PrefillService(model, auth_token=keys.prefill_token(), curve_server=keys.prefill_server(0)) as service:
        with idle_worker(service):
            yield folder, service


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["prefill", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_wrong_token_is_refused_at_once_naming_the_token(keyed, capsys, tmp_path) -> None:
    folder, service = keyed
    ep = service.endpoint
    code, _, err = _run(
        capsys, "--endpoint", ep, "--keys", str(folder), "--rank", "0", "--token", "wrong", "--timeout", LONG, "hi"
    )
    assert code == 1 and "no prefill response" not in err, err
    assert "refused this client's CURVE key: the token is not the job's prefill token" in err
    assert len(err.strip().splitlines()) == 1
    wrong = tmp_path / "wrong.token"
    wrong.write_text("w" * 32)
    wrong.chmod(0o600)
    pub = str(folder / "agent-0.key.pub")
    code, _, err = _run(
        capsys, "--endpoint", ep, "--token-file", str(wrong), "--server-key", pub, "--timeout", LONG, "hi"
    )
    assert code == 1 and "refused this client's CURVE key" in err, err
    assert service.metrics()["curve_refused"] >= 2
    # the right token with the agent's public key alone (no key folder): served
    code, out, err = _run(
        capsys, "--endpoint", ep, "--token-file", str(folder / "prefill.token"), "--server-key", pub, "--json", "hi"
    )
    assert code == 0 and json.loads(out)["status"] == "ok", err


def test_a_plain_client_against_curve_is_told_at_once(keyed) -> None:
    folder, service = keyed
    keys = load_job_keys(folder)
    token = keys.prefill_token()
    with PrefillClient(service.endpoint, token=token, timeout_s=600) as client:
        with pytest.raises(LinkError, match="speaks CURVE only .*pass --keys DIR --rank R"):
            client.prefill("hi")
    curve = CurveClient(*token_keypair(token), keys.curve_public(0))
    with PrefillClient(service.endpoint, token=token, curve_client=curve, timeout_s=60) as client:
        assert client.prefill("hi").status == "ok"


def test_a_key_of_ones_own_is_refused_in_one_line(keyed, capsys) -> None:
    folder, service = keyed
    received = service.metrics()["received"]
    argv = ["--endpoint", service.endpoint, "--token-file", str(folder / "prefill.token"), "--timeout", LONG]
    keys = ["--curve-key", str(folder / "agent-1.key"), "--server-key", str(folder / "agent-0.key.pub")]
    code, _, err = _run(capsys, *argv, *keys, "hi")
    assert code == 2 and "--curve-key: an agent admits only the CURVE key the job's prefill token stands for" in err
    code, _, err = _run(capsys, *argv, "--keys", str(folder), "--rank", "0", "--server-key", keys[3], "hi")
    assert code == 2 and "either --keys DIR --rank R or --server-key FILE" in err
    code, _, err = _run(capsys, "--endpoint", service.endpoint, "--server-key", keys[3], "hi")
    assert code == 2 and "--server-key needs the job's prefill token" in err
    assert service.metrics()["received"] == received


@pytest.mark.parametrize(
    "endpoint, needle",
    [
        ("tcp://[::1:5", "'tcp://[::1:5': an IPv6 host goes in brackets, then :PORT"),
        ("tcp://[::1", "'tcp://[::1': an IPv6 host goes in brackets, then :PORT"),  # it said host '[:' (a re-test)
        ("tcp://127.0.0.1:999999", "port 999999 is out of range (1-65535)"),
        ("tcp://127.0.0.1:0", "port 0 is out of range (1-65535)"),
        ("tcp://::1:5600", "an IPv6 host goes in brackets, then :PORT, as in tcp://[::1]:5600"),
        ("tcp://127.0.0.1", "names no HOST:PORT"),
        ("tcp://[::1]", "'tcp://[::1]' names no HOST:PORT"),  # it said 'port 1] is not a number' (a trial)
        ("tcp://127.0.0.1:http", "port http is not a number"),
        # these waited the whole --timeout (a trial): no host of that name, and the any-address
        ("tcp://nonexistent.invalid:5555", "cannot resolve host 'nonexistent.invalid'"),
        ("tcp://0.0.0.0:5555", "0.0.0.0 is the any-address, which a client cannot connect to"),
        ("tcp://[::]:5555", ":: is the any-address, which a client cannot connect to"),
        ("tcp://*:5555", "* is the any-address, which a client cannot connect to"),
        ("tcp://[::0]:5555", "::0 is the any-address, which a client cannot connect to"),  # a re-test
        ("tcp://0:5555", "0 is the any-address, which a client cannot connect to"),
        ("tcp://224.0.0.1:5555", "224.0.0.1 is a multicast or broadcast address"),
    ],
)
def test_a_malformed_endpoint_is_refused_before_anything_is_sent(capsys, endpoint: str, needle: str) -> None:
    code, _, err = _run(capsys, "--endpoint", endpoint, "--token", "t" * 24, "--timeout", "5", "hi")
    assert code == 2 and needle in err and "no prefill response" not in err, err
    with pytest.raises(InputError, match=re.escape(needle)):
        PrefillClient(endpoint)
