"""Generate a CURVE keypair for encrypting and authenticating WAN links.

Writes DIR/NAME.key (secret and public key, mode 0600: keep it on the agent)
and DIR/NAME.key.pub (public key: give it to the peers). A listening agent
admits the connecting agents whose NAME.key.pub files are in its
allowed-clients directory; a connecting agent needs the listener's
NAME.key.pub.

example:
  mkdir -p keys/clients
  geosched keys keys --name eu-stage0          # listening side
  geosched keys keys/clients --name us-stage1  # connecting side; copy its .pub to the listener
  geosched keys keys --name eu-stage0 --json   # print the paths and public key as JSON
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``geosched keys``."""
    parser.add_argument("dir", metavar="DIR", help="directory to write the key files into (must exist)")
    parser.add_argument("--name", default="agent", help="base name of the files (default: agent)")
    parser.add_argument("--force", action="store_true", help="overwrite existing key files")
    parser.add_argument("--json", action="store_true", help="print paths and public key as JSON")


def run(args: argparse.Namespace) -> int:
    """Write the keypair and print where it went."""
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
