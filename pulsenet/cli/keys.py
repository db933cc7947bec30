"""``pulsenet keygen``: an Ed25519 key pair for signing manifests."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keygen", help="write an Ed25519 private key to KEYFILE and its public key to KEYFILE.pub")
    p.add_argument("--out", type=Path, required=True, metavar="KEYFILE")
    p.set_defaults(func=_keygen)


def _keygen(args: argparse.Namespace) -> int:
    from pulsenet.signing import generate_keypair

    kid = generate_keypair(args.out)
    print(f"private key: {args.out}\npublic key:  {args.out}.pub\nkey id:      {kid}")
    return 0
