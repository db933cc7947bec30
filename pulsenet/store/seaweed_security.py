"""The on-disk security material of an embedded SeaweedFS (``store/seaweed.py`` runs the server).

Three things, all in the server's data directory, all private (the directory 0700, files 0600,
written atomically):

- ``s3-identities.json``: the static S3 identities (``-s3.config``), one key pair per role, reused
  on the next start on the same directory (:func:`load_identities`);
- ``security.toml``: fresh random JWT signing keys on every start (the volume server then refuses
  reads and writes without a token minted by the master; the filer HTTP API, already off, would
  want one of the S3 gateway's), the admin UI off and no directory metadata without a token
  (:func:`write_security`);
- ``tls/``: a fresh CA and one certificate on every start, for mutual TLS on every gRPC port; the
  CA key is never written.

weed reads ``security.toml`` from its working directory, so the server runs in the data directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path

IDENTITIES_FILE = "s3-identities.json"
SECURITY_FILE = "security.toml"
# JWT sections of security.toml: volume writes/reads (tokens minted by the master) and filer HTTP
# writes/reads (tokens minted by the S3 gateway; belt and braces, as -disableHttp closes that API).
_JWT_SECTIONS = ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")
_JWT_TTL_S = 10
TLS_DIR = "tls"
# Every gRPC server in weed mini, plus "client" (what each component presents when it dials another).
_GRPC_SECTIONS = (
    "master",
    "volume",
    "filer",
    "s3",
    "admin",
    "worker",
    "msg_broker",
    "msg_agent",
    "mq",
    "client",
)


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    """One SeaweedFS S3 identity: a key pair and the actions it may perform."""

    name: str
    access_key: str
    secret_key: str
    actions: tuple[str, ...]

    @classmethod
    def new(cls, name: str, actions: Iterable[str]) -> Identity:
        return cls(name, "PN" + secrets.token_hex(9).upper(), secrets.token_urlsafe(30), tuple(actions))


def private_dir(path: Path) -> None:
    """Create ``path`` (and parents) and make it 0700: it holds keys and every object's bytes."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def write_private(path: Path, text: str) -> None:
    """Atomically replace ``path`` with ``text``, created 0600 (it holds secrets)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load_identities(data_dir: Path, wanted: Mapping[str, tuple[str, ...]]) -> dict[str, Identity]:
    """The identities file in ``data_dir``, with a new key pair for each role of ``wanted`` it lacks
    and every role's actions set to ``wanted``'s (the file is rewritten when anything changed)."""
    path = data_dir / IDENTITIES_FILE
    identities: dict[str, Identity] = {}
    if path.exists():
        for item in json.loads(path.read_text())["identities"]:
            cred = item["credentials"][0]
            identities[item["name"]] = Identity(
                item["name"], cred["accessKey"], cred["secretKey"], tuple(item["actions"])
            )
    changed = False
    for name, actions in wanted.items():
        if name not in identities or identities[name].actions != actions:
            old = identities.get(name)
            identities[name] = (
                dataclasses.replace(old, actions=actions)
                if old is not None
                else Identity.new(name, actions)
            )
            changed = True
    if changed or not path.exists():
        private_dir(data_dir)
        doc = {
            "identities": [
                {
                    "name": i.name,
                    "credentials": [{"accessKey": i.access_key, "secretKey": i.secret_key}],
                    "actions": list(i.actions),
                }
                for i in identities.values()
            ]
        }
        write_private(path, json.dumps(doc, indent=1))
    return identities


def write_security(data_dir: Path) -> None:
    """Write a fresh ``security.toml`` (and the ``tls/`` it names) into ``data_dir``: new JWT keys
    and a new CA on every start, so nothing minted or signed for an earlier run is accepted."""
    write_private(data_dir / SECURITY_FILE, _security_toml(data_dir))


def _security_toml(data_dir: Path) -> str:
    """Fresh random JWT keys and gRPC mTLS material; UIs off, no directory metadata without a token."""
    out = []
    for section in _JWT_SECTIONS:
        out += [
            f"[{section}]",
            f'key = "{secrets.token_urlsafe(32)}"',
            f"expires_after_seconds = {_JWT_TTL_S}",
            "",
        ]
    out += ["[access]", "ui = false", "", "[filer.expose_directory_metadata]", "enabled = false", ""]
    ca, cert, key = _write_tls(data_dir / TLS_DIR)
    out += ["[grpc]", f"ca = {json.dumps(str(ca))}", ""]
    for section in _GRPC_SECTIONS:
        out += [f"[grpc.{section}]", f"cert = {json.dumps(str(cert))}", f"key = {json.dumps(str(key))}", ""]
    return "\n".join(out)


def _write_tls(tls_dir: Path) -> tuple[Path, Path, Path]:
    """A fresh CA and one certificate signed by it, for every gRPC server and client of this weed.

    Every component presents the same certificate: weed checks the chain, not host names, so what
    matters is that only this server (and whoever can read its 0700 directory) holds the key. The CA
    key is never written, so no other certificate can join. EC P-256: all of it takes milliseconds.
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def build(name: str, issuer: str, public: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=3650))
        )

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (
        build("pulsenet-weed-ca", "pulsenet-weed-ca", ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        build("pulsenet-weed", "pulsenet-weed-ca", key.public_key())
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    private_dir(tls_dir)
    paths = tls_dir / "ca.crt", tls_dir / "weed.crt", tls_dir / "weed.key"
    pem = serialization.Encoding.PEM
    write_private(paths[0], ca.public_bytes(pem).decode())
    write_private(paths[1], cert.public_bytes(pem).decode())
    write_private(
        paths[2],
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode(),
    )
    return paths
