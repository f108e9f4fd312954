"""Send one prompt to an agent's prefill endpoint; print the first token, timings, optionally decode on.

The agent runs the prefill inside its training bubbles and returns the first
token, its top-k logits and the KV cache; ``--decode N`` continues greedy
decoding locally from that cache (needs the same weights: --weights; --config only for a
file that records no model, or with --seed for the seeded demo model):

  geosched prefill --endpoint tcp://10.0.0.5:5600 --keys secrets --rank 2 "Hello"   # token + CURVE to rank 2
  geosched prefill --endpoint tcp://10.0.0.5:5600 --token-file prefill.token --server-key agent-2.key.pub "Hi"
  geosched prefill --endpoint tcp://127.0.0.1:5600 --token-file prefill.token "The quick brown fox"  # --insecure agent
  geosched prefill --endpoint https://127.0.0.1:8443 --keys runs/demo/secrets "Hello"   # HTTPS: token + its CA
  geosched prefill --endpoint https://agent:8443 --ca-file ca.crt --token-file prefill.token "Hello"
  geosched prefill --endpoint tcp://127.0.0.1:5600 --decode 20 \\
      --weights gpt.safetensors --json "Once upon a time"
  geosched prefill --local --weights model.safetensors --decode 20 "Hello"   # the file records its model

An ``http(s)://`` endpoint (the agent's ``prefill-http/r<RANK>`` URL) is
asked over its OpenAI-style front end (``POST /v1/prefill``), with the same
answer; HTTPS verifies the agent's certificate against ``--ca-file`` (with
``--keys DIR``: DIR/tls-ca.crt when present, as ``geosched launch`` writes
it; else the system's CAs).

``--local`` runs the same prefill in this process, no agent and no network, on
--weights (a file from ``geosched export``, or a checkpoint folder), and prints
what the agent's answer prints: a quick check of an exported file.

Exit code 1 when the agent answers rejected, expired or error (the reason is printed), or refuses this
client's CURVE key (the token is not the job's: at once, not after --timeout).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from geosched.commands.checks import above, at_least, at_most, fits_host_memory
from geosched.errors import InputError

if TYPE_CHECKING:
    from agents.prefill.protocol import PrefillResponse
    from agents.sockets import CurveClient
    from geosched.model import StageModule


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``geosched prefill``."""
    parser.add_argument("prompt", help="prompt text (one token per UTF-8 byte)")
    parser.add_argument(
        "--endpoint", help="the agent's prefill endpoint, tcp://HOST:PORT, or its HTTP front end, https://HOST:PORT"
    )
    parser.add_argument(
        "--ca-file",
        metavar="FILE",
        help="https: trust the agent's certificate if this CA signed it (default with --keys DIR: DIR/tls-ca.crt)",
    )
    parser.add_argument(
        "--local",
        action="store_true",
        help="no agent: prefill in this process on --weights (a file or checkpoint folder: the model it records)",
    )
    parser.add_argument("--token", help="shared secret, when the agent requires one (prefer --token-file)")
    parser.add_argument("--token-file", help="read the shared secret from this file (mode 0600)")
    parser.add_argument(
        "--keys",
        metavar="DIR",
        help="the job's key folder: its prefill token, and CURVE to the agent of --rank (its agent-<R>.key.pub)",
    )
    parser.add_argument("--rank", type=int, help="with --keys and tcp://: the rank whose agent serves --endpoint")
    parser.add_argument("--curve-key", help=argparse.SUPPRESS)  # refused: agents admit only the token's key
    parser.add_argument(
        "--server-key",
        metavar="FILE",
        help="tcp:// without --keys: CURVE to the agent with this public key (agent-<R>.key.pub), with the token",
    )
    parser.add_argument("--deadline-ms", type=float, help="answer within this many ms (else the agent rejects)")
    parser.add_argument("--priority", type=int, default=0, help="0-9, higher first (default 0)")
    parser.add_argument("--top-k", type=int, default=5, help="logits to return (1-16, default 5)")
    parser.add_argument("--decode", type=int, default=0, metavar="N", help="greedy-decode N tokens locally")
    parser.add_argument(
        "--weights", help="the served model's weights file or checkpoint folder (for --decode and --local)"
    )
    parser.add_argument(
        "--config", help="config whose job.model is the served model's shape (default: the one --weights records)"
    )
    parser.add_argument("--seed", type=int, help="without --weights: the seeded demo model (config's job.seed)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the answer (default 30)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")


def _load_local_model(args: argparse.Namespace) -> tuple[StageModule, int | None]:
    from agents.checkpoint.export import nonfinite_count, recorded_model, served_weights
    from agents.prefill.model import frozen, load_inference_model
    from geosched.config import load_config
    from geosched.weights import ModelRecord

    if args.weights is None and (args.config is None or args.seed is None):
        raise InputError(
            f"{'--local' if args.local else '--decode'} needs the served model locally: pass --weights (a file "
            "from 'geosched export' or a checkpoint folder), or --config and --seed for the seeded demo model"
        )
    if args.config is not None:
        job = load_config(args.config).job
        record = ModelRecord.of(job.model, job.seed, job.precision)
    else:
        record = recorded_model(args.weights)
    what = f"the model of {args.config or args.weights}"
    fits_host_memory(record.shape, 4, what, "serve it from an agent on a larger host (--endpoint)")
    if args.weights is None:
        return load_inference_model(record.shape, None, seed=args.seed), None
    model, step = served_weights(args.weights, record)
    assert model is not None  # a weights source without following gives a model or raises
    if nonfinite := nonfinite_count(model.parameters()):  # served as given, but worth a word, as export says
        print(
            f"geosched prefill: warning: {nonfinite:,} of the weights of {args.weights} are NaN or inf: the "
            "training diverged by that step; serve an earlier checkpoint's",
            file=sys.stderr,
        )
    return frozen(model), step


def _curve_of(args: argparse.Namespace, token: str | None) -> tuple[str | None, CurveClient | None]:
    """The token and CURVE settings of a tcp:// endpoint: from ``--keys DIR --rank R`` (the token from DIR unless
    given) or ``--server-key FILE`` with the token; the client key is the one the token stands for, the only one
    an agent admits (:func:`agents.sockets.token_keypair`)."""
    from agents.keys import load_job_keys
    from agents.sockets import CurveClient, load_public_key, token_keypair

    if args.keys is None and args.rank is not None:
        raise InputError("--rank goes with --keys DIR (the rank whose CURVE key the agent's endpoint uses)")
    if args.keys is not None and args.server_key is not None:
        raise InputError("pass either --keys DIR --rank R or --server-key FILE (the agent's public key), not both")
    if args.keys is not None:
        if args.rank is None:
            raise InputError("--keys needs --rank R: the rank of the agent serving --endpoint (its CURVE key)")
        keys = load_job_keys(args.keys)
        token = token or keys.prefill_token()
        server_key = keys.curve_public(args.rank)
    elif args.server_key is not None:
        if token is None:
            raise InputError("--server-key needs the job's prefill token (--token-file FILE): its CURVE key")
        server_key = load_public_key(args.server_key)
    else:
        return token, None
    return token, CurveClient(*token_keypair(token), server_key)


def run(args: argparse.Namespace) -> int:
    """Send the prompt, print the answer; 0 when ok, 1 otherwise."""
    from agents.prefill.client import PrefillClient, check_scheme, prefill_locally

    at_least(args, "decode", 0, colon=False)
    at_least(args, "priority", 0)
    at_most(args, "priority", 9)
    at_least(args, "top_k", 1)
    at_most(args, "top_k", 16)
    above(args, "deadline_ms", 0, "omit it for the agent's default")
    above(args, "timeout", 0, "seconds, e.g. 30")
    at_most(args, "timeout", 86_400, "a day")
    at_least(args, "seed", 0, "as a config's job.seed")
    at_most(args, "seed", 2**63 - 1, "as a config's job.seed")
    if not args.prompt:
        raise InputError("the prompt is empty; pass some text")
    args.prompt = os.fsencode(args.prompt)  # the bytes as given, UTF-8 or not: one token each
    if args.local:
        if args.endpoint is not None:
            raise InputError("pass either --endpoint (an agent) or --local (this process), not both")
        model, step = _load_local_model(args)
        answer = prefill_locally(model, args.prompt, args.top_k)
        answer.weights_step = step
        return _report(args, answer, model if args.decode else None, step)
    if args.endpoint is None:
        raise InputError("pass --endpoint tcp://HOST:PORT (an agent's prefill endpoint), or --local --weights FILE")
    if args.curve_key is not None:
        raise InputError(
            "--curve-key: an agent admits only the CURVE key the job's prefill token stands for, no key of one's "
            "own; pass the token (--token-file FILE, or --keys DIR --rank R) and, without DIR, --server-key FILE"
        )
    served, step = _load_local_model(args) if args.decode else (None, None)
    token = args.token
    if args.token_file is not None:
        from geosched.commands.agent import read_token_file

        token = read_token_file(args.token_file, "--token-file")
    if args.endpoint.startswith(("http://", "https://")):
        result = _over_http(args, token)
        return _report(args, result, served, step)
    if args.ca_file is not None:
        raise InputError("--ca-file goes with an https:// endpoint (tcp:// endpoints use CURVE)")
    check_scheme(args.endpoint)  # before the flags that go with it: a wrong scheme is the first thing to say
    token, curve = _curve_of(args, token)
    with PrefillClient(args.endpoint, token=token, curve_client=curve, timeout_s=args.timeout) as client:
        result = client.prefill(
            args.prompt,
            deadline_s=None if args.deadline_ms is None else args.deadline_ms / 1e3,
            priority=args.priority,
            top_k=args.top_k,
            return_kv=bool(args.decode),
        )
    return _report(args, result, served, step)


def _over_http(args: argparse.Namespace, token: str | None) -> PrefillResponse:
    """The prompt sent to an agent's HTTP front end (``POST /v1/prefill``), TLS checked against the CA."""
    import os

    from agents.prefill.http_client import prefill_over_http, split_url
    from agents.tls.context import client_context
    from agents.tls.selfsigned import CA_CERT

    if args.server_key is not None or args.rank is not None:
        raise InputError("--server-key and --rank go with a tcp:// endpoint (HTTPS uses TLS)")
    scheme = split_url(args.endpoint)[0]
    ca_file = args.ca_file
    if args.keys is not None:
        from agents.keys import load_job_keys

        token = token or load_job_keys(args.keys).prefill_token()
        rehearsal_ca = os.path.join(args.keys, CA_CERT)
        ca_file = ca_file or (rehearsal_ca if os.path.exists(rehearsal_ca) else None)
    context = None
    if scheme == "https":
        context = client_context(ca_file)
    elif token is not None:  # sent as a header: anyone on the path could use it (no token: nothing to steal)
        sys.stderr.write("geosched prefill: WARNING plain HTTP: the token and the prompt cross the network in clear\n")
    return prefill_over_http(
        args.endpoint,
        args.prompt,
        token=token,
        context=context,
        deadline_s=None if args.deadline_ms is None else args.deadline_ms / 1e3,
        priority=args.priority,
        top_k=args.top_k,
        timeout_s=args.timeout,
    )


def _weights_of(step: int | None) -> str:
    return "weights of no checkpoint step" if step is None else f"the weights of checkpoint step {step}"


def _report(
    args: argparse.Namespace, result: PrefillResponse, model: StageModule | None, step: int | None = None
) -> int:
    """Print the answer (text, or one JSON object), decoding ``--decode N`` tokens on with ``model`` (of checkpoint
    ``step``: refused when the answer says other weights computed the cache); 0 when ok."""
    from agents.prefill.client import continue_greedy

    if model is not None and result.status == "ok" and result.weights_step != step:
        given = f"--weights {args.weights}" if args.weights is not None else f"--seed {args.seed}"
        fix = (
            f"the same step's weights (geosched export CKPT --step {result.weights_step})"
            if result.weights_step is not None
            else "the weights it serves (its seeded weights: --config and --seed; or its --prefill-weights file)"
        )
        raise InputError(
            f"the endpoint computed this cache with {_weights_of(result.weights_step)}, and --decode would continue "
            f"it with {_weights_of(step)} ({given}); pass {fix}"
        )

    out: dict[str, object] = {"id": result.id, "status": result.status}
    if result.status != "ok":
        out["reason"] = result.reason
    else:
        out.update(
            weights_step=result.weights_step,
            prompt_tokens=result.prompt_tokens,
            first_token=result.first_token,
            topk_ids=result.topk_ids,
            topk_logits=result.topk_logits,
            **result.timings,
        )
        if model is not None:
            tokens = continue_greedy(model, result, args.decode)
            out["decoded_tokens"] = tokens
            out["decoded_text"] = bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
    if args.json:
        print(json.dumps(out))
    elif result.status != "ok":
        sys.stderr.write(f"geosched prefill: {result.status}: {result.reason}\n")
    else:
        first = result.first_token
        assert first is not None  # an "ok" response carries its first token
        print(
            f"first token {first} ({bytes([first % 256])!r}), "
            f"{result.prompt_tokens} prompt tokens, ttft {result.timings['ttft_ms']:.1f} ms "
            f"(queued {result.timings['queued_ms']:.1f} ms, computed {result.timings['compute_ms']:.1f} ms "
            f"in {int(result.timings['chunks'])} chunks, {result.timings['bubble_share']:.0%} inside bubbles)"
        )
        if "decoded_text" in out:
            print(f"decoded: {out['decoded_text']!r}")
    return 0 if result.status == "ok" else 1
