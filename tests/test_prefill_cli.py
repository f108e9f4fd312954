"""`geosched prefill` against a live service: first token, local decoding from the returned cache, bad input."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from agents.prefill.model import inference_memory_bytes, load_inference_model, save_inference_weights
from agents.prefill.service import PrefillService
from geosched.cli import main
from geosched.config import load_config
from geosched.errors import InputError
from geosched.model import build_model, greedy_generate, total_params

CONFIG = "configs/demo-3dc.yaml"


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """The demo config's model with non-default weights (seed 99), saved as safetensors."""
    path = tmp_path_factory.mktemp("weights") / "gpt.safetensors"
    save_inference_weights(build_model(load_config(CONFIG).job.model, seed=99), path)
    return path


@pytest.fixture(scope="module")
def endpoint(weights):
    model = load_inference_model(load_config(CONFIG).job.model, weights)
    with PrefillService(model, auth_token="tok") as service:
        stop = threading.Event()
        worker = threading.Thread(target=service.serve_idle, args=(stop.is_set,), daemon=True)
        worker.start()
        yield service.endpoint
        stop.set()
        worker.join(10)


def test_cli_prefills_and_decodes_like_the_local_model(endpoint, weights):
    prompt = "Once upon a time"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "geosched.cli",
            "prefill",
            "--endpoint",
            endpoint,
            "--token",
            "tok",
            "--decode",
            "8",
            "--weights",
            str(weights),
            "--config",
            CONFIG,
            "--json",
            prompt,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    model = build_model(load_config(CONFIG).job.model, seed=99)
    expected = greedy_generate(model, torch.tensor([list(prompt.encode())]), 8)[0, len(prompt) :].tolist()
    assert out["status"] == "ok" and out["prompt_tokens"] == len(prompt)
    assert out["first_token"] == expected[0] and out["decoded_tokens"] == expected


def test_cli_reports_bad_input_in_one_line(endpoint, capsys):
    assert main(["prefill", "--endpoint", endpoint, "--decode", "4", "hi"]) == 2
    assert "--decode needs the served model locally" in capsys.readouterr().err
    assert main(["prefill", "--endpoint", "localhost:1", "hi"]) == 2
    assert "tcp://HOST:PORT" in capsys.readouterr().err
    assert main(["prefill", "--endpoint", "ftp://x:1", "--keys", "secrets", "hi"]) == 2  # the scheme, not --rank
    assert "--endpoint must look like tcp://HOST:PORT" in capsys.readouterr().err
    assert main(["prefill", "--endpoint", "https://127.0.0.1:9/v1/prefill/", "hi"]) == 2  # the route: not a base URL
    assert "give the front end's URL without its route" in capsys.readouterr().err
    assert main(["prefill", "--endpoint", endpoint, "--token", "wrong", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unauthenticated" in err
    assert main(["prefill", "--endpoint", endpoint, "--token", "tok", "--json", "x" * 100]) == 1
    assert "exceeds the prefill service's limit of 64" in json.loads(capsys.readouterr().out)["reason"]


def test_plain_http_warns_only_when_a_token_would_cross_in_clear(capsys):
    """A trial's `prefill --endpoint http://...` without a token warned that the token crossed in clear."""
    import socket

    with socket.socket() as s:  # a free port nobody listens on: the command fails (exit 1) after its warning
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    warning = "WARNING plain HTTP: the token and the prompt cross the network in clear"
    assert main(["prefill", "--endpoint", url, "hi"]) == 1
    err = capsys.readouterr().err
    assert warning not in err and "no answer from the prefill HTTP front end" in err and err.count("\n") == 1, err
    assert main(["prefill", "--endpoint", url, "--token", "t" * 24, "hi"]) == 1
    assert warning in capsys.readouterr().err


def test_weights_that_do_not_fit_the_shape_are_refused(weights, tmp_path):
    shape = load_config(CONFIG).job.model
    other = type(shape)(layers=2, hidden=32, heads=4, seq_len=64)
    with pytest.raises(InputError, match="do not fit the model shape"):
        load_inference_model(other, weights)
    with pytest.raises(InputError, match="does not exist"):
        load_inference_model(shape, tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(InputError, match="cannot read weights"):
        load_inference_model(shape, tmp_path / "junk.safetensors")
    with pytest.raises(InputError, match="is not a regular file"):
        load_inference_model(shape, "/dev/zero")
    from safetensors.torch import load_file, save_file

    future = tmp_path / "future.safetensors"
    save_file(load_file(weights), future, metadata={"format": "geosched-weights/9", "model": "{}"})
    with pytest.raises(InputError, match="format 'geosched-weights/9', which this geosched does not read"):
        load_inference_model(shape, future)
    memory = inference_memory_bytes(shape, max_tokens=64, max_kv_bytes=1 << 20)
    assert memory > total_params(shape) * 4 + (1 << 20)


def test_a_small_file_naming_a_large_model_is_refused_from_its_header(tmp_path):
    """An attacker's trial: 260 bytes recording a model of 1.6 GB (one tensor 'x' inside) made prefill --local build
    the whole model before it saw the names (24 s and 1.6 GB; a larger one ran out of memory, a traceback). The
    names and shapes are now checked against a model on torch's meta device, which holds no memory."""
    from safetensors.torch import save_file

    shape = type(load_config(CONFIG).job.model)(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=50000)
    small = tmp_path / "small.safetensors"
    save_file({"x": torch.zeros(1)}, small)
    with pytest.raises(InputError, match=r"do not fit the model shape: missing \['blocks.0.attn.proj.bias'"):
        load_inference_model(shape, small)  # 175B-class: 700 GB in fp32, were it built


def test_a_prompt_that_is_not_utf8_is_its_bytes(endpoint, weights, capsys):
    """A byte-level model takes any bytes: argv's undecodable ones (Python's surrogate escapes) are sent as
    they were typed, locally and to an agent, instead of a UnicodeEncodeError traceback."""
    raw = b"caf\xe9 \xff\xfe"
    prompt = raw.decode("utf-8", "surrogateescape")  # what sys.argv holds for those bytes
    answers = []
    for where in (
        ["--local", "--weights", str(weights), "--config", CONFIG],
        ["--endpoint", endpoint, "--token", "tok"],
    ):
        assert main(["prefill", *where, "--json", prompt]) == 0
        answers.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    model = build_model(load_config(CONFIG).job.model, seed=99)
    expected = greedy_generate(model, torch.tensor([list(raw)]), 1)[0, -1].item()
    assert [(a["prompt_tokens"], a["first_token"]) for a in answers] == [(len(raw), expected)] * 2


def test_decoding_with_other_weights_than_the_endpoints_is_refused(weights, tmp_path, capsys):
    """An agent following its checkpoints served step 220 while --decode continued the cache with a step-100
    file, silently mixing weights. Each answer now names the step of its weights (ZeroMQ header, /v1/prefill
    metadata, a completion's system_fingerprint); --decode refuses other weights, and takes the same step's."""
    from safetensors.torch import load_file

    from agents.prefill.swap import SwappablePrefillService
    from geosched.weights import ModelRecord, save_safetensors, weights_metadata

    job = load_config(CONFIG).job
    record = ModelRecord.of(job.model, job.seed, job.precision)
    files = {}
    for step in (100, 220):  # the same tensors: only the recorded step differs
        files[step] = tmp_path / f"step{step}.safetensors"
        save_safetensors(load_file(weights), str(files[step]), weights_metadata(record, step=step))
    model = load_inference_model(job.model, weights)
    with _decoding_from(
        SwappablePrefillService(model, served="checkpoint step 220", step=220, auth_token="tok")
    ) as argv:
        assert main([*argv, "--weights", str(files[100]), "hi"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "weights of checkpoint step 220" in err, err
        assert "with the weights of checkpoint step 100" in err and "--step 220" in err, err
        assert main([*argv, "--seed", str(job.seed), "hi"]) == 2  # the seeded weights: no step either
        err = capsys.readouterr().err.strip()
        assert "with weights of no checkpoint step (--seed" in err and "--step 220" in err, err
        assert main([*argv, "--weights", str(files[220]), "--json", "hi"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["weights_step"] == 220 and len(out["decoded_tokens"]) == 2
    # an agent serving its seeded weights (no step): a checkpoint's file would continue the cache silently
    with _decoding_from(SwappablePrefillService(model, served="the seeded initial weights", auth_token="tok")) as argv:
        assert main([*argv, "--weights", str(files[100]), "hi"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "with weights of no checkpoint step, and --decode" in err, err
        assert "its seeded weights: --config and --seed" in err, err


@contextlib.contextmanager
def _decoding_from(service: Any) -> Iterator[list[str]]:
    """Serve ``service`` idle in a thread; yield ``geosched prefill`` arguments decoding 2 tokens from it."""
    with service:
        stop = threading.Event()
        worker = threading.Thread(target=service.serve_idle, args=(stop.is_set,), daemon=True)
        worker.start()
        try:
            yield ["prefill", "--endpoint", service.endpoint, "--token", "tok", "--decode", "2", "--config", CONFIG]
        finally:
            stop.set()
            worker.join(10)


def test_local_prefill_on_weights_that_are_not_finite_says_so(weights, tmp_path, capsys):
    """export warned of NaN weights (a diverged training), prefill --local served them without a word."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name][0] = float("nan")
    broken = tmp_path / "nan.safetensors"
    save_file(tensors, broken)
    assert main(["prefill", "--local", "--weights", str(broken), "--config", CONFIG, "hi"]) == 0
    err = capsys.readouterr().err
    assert "geosched prefill: warning: " in err and f"of the weights of {broken} are NaN or inf" in err, err
