"""Generate keys: a whole job's key folder (``--ranks``/``--plan``) or one CURVE keypair (``--name``).

A job's key folder (``--ranks N``, or ``--plan PLAN`` to count the plan's
ranks) holds everything a secure job needs, every file mode 0600 in a 0700
folder: an Ed25519 signing key per identity (coordinator, agent-<r>), a
CURVE keypair per rank, the prefill token and an MQTT password per
identity. ``geosched agent``/``job``/``prefill`` take it with ``--keys DIR``;
give each machine the public files plus its own secrets (docs/security.md).

``--name NAME`` writes a single CURVE keypair: DIR/NAME.key (secret and
public key, mode 0600: keep it on the agent) and DIR/NAME.key.pub (public
key: give it to the peers).

example:
  geosched keys secrets --ranks 3               # a job of 3 agents
  geosched keys secrets --plan plan.yaml --json # as many agents as the plan has ranks
  geosched keys keys --name eu-stage0           # one CURVE keypair (listening side)
  geosched keys keys/clients --name us-stage1   # connecting side; copy its .pub to the listener
"""

from __future__ import annotations

import argparse
import json
import os

from geosched.commands.checks import folder
from geosched.errors import InputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``geosched keys``."""
    parser.add_argument("dir", metavar="DIR", help="folder to write the key files into")
    parser.add_argument(
        "--ranks", type=int, help="write a job's key folder for N agent ranks (made if absent, in a folder that exists)"
    )
    parser.add_argument("--plan", help="write a job's key folder for as many ranks as this plan has")
    parser.add_argument("--name", help="write one CURVE keypair DIR/NAME.key(.pub) (DIR is made, mode 0700, if absent)")
    parser.add_argument("--force", action="store_true", help="overwrite existing key files")
    parser.add_argument("--json", action="store_true", help="print what was written as JSON")


def run(args: argparse.Namespace) -> int:
    """Write the key folder or the keypair and print where it went."""
    if args.ranks is not None or args.plan is not None:
        return _job_folder(args)
    if args.name is None:
        raise InputError(
            "give --ranks N (or --plan PLAN): a job's key folder, every key a secure job needs; or --name NAME: one "
            "CURVE keypair"
        )
    from agents.sockets import load_public_key, write_keypair

    secret_path, public_path = write_keypair(args.dir, args.name, force=args.force)
    public = load_public_key(public_path).decode()
    if args.json:
        print(
            json.dumps({"secret_key_file": str(secret_path), "public_key_file": str(public_path), "public_key": public})
        )
    else:
        print(f"wrote {secret_path} (secret, mode 0600) and {public_path} (public key {public})")
    return 0


WHAT = {
    "signing": "Ed25519 signing keys and their .pub (coordinator, agent-<r>)",
    "curve": "CURVE keypairs of the agents' WAN links and prefill endpoints (agent-<r>.key, .key.pub)",
    "prefill": "prefill token",
    "mqtt": "MQTT passwords (user name = identity)",
    "manifest": "manifest (number of ranks)",
}


def _job_folder(args: argparse.Namespace) -> int:
    from agents.keys import MAX_RANKS, write_job_keys

    if args.name is not None:
        raise InputError("--name writes one CURVE keypair; --ranks/--plan write a job's key folder: pass one of them")
    if args.ranks is not None and args.plan is not None:
        raise InputError("pass either --ranks N or --plan PLAN, not both")
    ranks = args.ranks
    if args.plan is not None:
        from agents.layout import load_plan_file, parse_layout

        ranks = len(parse_layout(load_plan_file(args.plan), args.plan).roles)
    if not 1 <= ranks <= MAX_RANKS:
        raise InputError(f"--ranks: must be between 1 and {MAX_RANKS} (got {ranks})")
    parent = os.path.dirname(os.path.normpath(args.dir)) or "."
    if not os.path.lexists(parent):  # as plan/export/profile -o: no folders made beyond the one asked for
        raise InputError(f"DIR {args.dir}: the folder {parent} does not exist; make it first, or write elsewhere")
    folder(args.dir, "DIR")  # a job's key folder is made once its arguments hold
    written = write_job_keys(args.dir, ranks, force=args.force)
    if args.json:
        print(json.dumps({"dir": args.dir, "ranks": ranks, **{k: [str(p) for p in v] for k, v in written.items()}}))
        return 0
    for kind, paths in written.items():
        names = ", ".join(os.path.relpath(p, args.dir) for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
        print(f"{len(paths):4d} files of {WHAT[kind]}: {names}")  # a key and its .pub are two
    print(f"wrote {sum(map(len, written.values()))} files (mode 0600) for {ranks} ranks into {args.dir} (mode 0700)")
    return 0
