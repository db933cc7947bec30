"""``pulsenet trainer`` and ``pulsenet inference`` as separate processes against the real embedded
SeaweedFS: one bucket and one write identity per site (t0, i0, i1), settings from the shipped
``configs/*.toml`` plus the site's environment, exactly as docs/deploy.md tells an operator.

Checked: ``/healthz``, ``/status``, ``/metrics`` over HTTP while the nodes run; a SIGKILLed trainer
and inference node restarted with the same command rejoin (the trainer continues its version
numbering, every version an inference node served carries the digest the trainer signed, final
digests agree); SIGTERM exits 0 and leaves no manifest naming a missing or short payload.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pulsenet.nodes.events import EVENTS_FILE, read_events
from pulsenet.rollouts.layout import RolloutLayout
from pulsenet.rollouts.manifest import batch_manifest_from
from pulsenet.signing import generate_keypair, trusted_keys, verify_document
from pulsenet.store import S3Store
from pulsenet.store.seaweed import SeaweedServer
from pulsenet.sync.layout import Layout
from pulsenet.sync.manifest import verify_manifest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
SITES = ("t0", "i0", "i1")
RUN = "proc"
WARMUP = 30
"""Tiny model warm-up steps: enough for rewards that vary within a group (so versions differ)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One ``weed mini`` with a bucket and a write identity per site: ``writer-t0`` writes only
    ``pulsenet-t0`` and reads the others."""
    with SeaweedServer(tmp_path_factory.mktemp("seaweed-nodes"), sites=SITES) as s:
        s.create_buckets(*(s.bucket(x) for x in SITES))
        yield s


class Network:
    """Keys, per-site environments and the node processes of one test (its own key prefix)."""

    def __init__(self, server: SeaweedServer, tmp: Path, *, steps: int, inference: tuple[str, ...] = ("i0", "i1")):
        self.server, self.tmp, self.steps, self.inference = server, tmp, steps, inference
        self.prefix = f"t-{uuid.uuid4().hex[:8]}"
        (tmp / "keys").mkdir()
        for site in SITES:
            generate_keypair(tmp / "keys" / f"{site}.key")
        self.ports = {site: _free_port() for site in SITES}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.starts: dict[str, int] = dict.fromkeys(SITES, 0)

    def url(self, site: str) -> str:
        return f"s3://{self.server.bucket(site)}/{self.prefix}"

    def env(self, site: str) -> dict[str, str]:
        """What a site's operator exports: its own credentials, then what differs from the config file."""
        ident = self.server.identities[self.server.writer(site)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PULSENET_", "AWS_"))}
        env |= {
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",  # three processes on a shared CPU: no thread oversubscription
            "AWS_ENDPOINT_URL": self.server.endpoint_url,
            "AWS_ACCESS_KEY_ID": ident.access_key,
            "AWS_SECRET_ACCESS_KEY": ident.secret_key,
            "AWS_REGION": self.server.region,
            "PULSENET_ID": site,
            "PULSENET_RUN": RUN,
            "PULSENET_STORE": self.url(site),
            "PULSENET_KEY": f"keys/{site}.key",
            "PULSENET_STATE_DIR": f"state/{site}",
            "PULSENET_STATUS_PORT": str(self.ports[site]),
        }
        if site.startswith("t"):
            env |= {
                "PULSENET_INFERENCE": ",".join(f"{i}={self.url(i)}" for i in self.inference),
                "PULSENET_TRUST_INFERENCE": ",".join(f"{i}=keys/{i}.key.pub" for i in self.inference),
                "PULSENET_STEPS": str(self.steps),
                "PULSENET_WARMUP_STEPS": str(WARMUP),
                "PULSENET_PUBLISH__ANCHOR_EVERY": "4",
                "PULSENET_PUBLISH__KEEP_ANCHORS": "8",  # nothing deleted here: the test reads every manifest
                "PULSENET_CONSUMER_POLL_S": "1",
                "PULSENET_LOCO_STORE": "",  # a lone trainer: the shipped config is t0 of a PULSELoCo pair
            }
        else:
            env |= {
                "PULSENET_POLICY": self.url("t0"),
                "PULSENET_TRUST": "keys/t0.key.pub",
                "PULSENET_SUBSCRIBE__INTERVAL_S": "0.3",
                "PULSENET_BATCHES_PER_VERSION": "1",
                "PULSENET_STATUS_EVERY_S": "1",
            }
        return env

    def command(self, site: str) -> list[str]:
        role = "trainer" if site.startswith("t") else "inference"
        return [sys.executable, "-m", "pulsenet", "-v", "--log-format", "json", role, "--config", str(CONFIGS / f"{role}.toml")]

    def start(self, site: str) -> None:
        self.starts[site] += 1
        log = open(self.log_path(site), "ab")  # noqa: SIM115 (the child owns it; appended across restarts)
        self.procs[site] = subprocess.Popen(
            self.command(site), cwd=self.tmp, env=self.env(site), stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    def log_path(self, site: str) -> Path:
        return self.tmp / f"{site}.log"

    def logs(self, site: str) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path(site).read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def tail(self, site: str, n: int = 30) -> str:
        return "\n".join(self.log_path(site).read_text(errors="replace").splitlines()[-n:])

    def http(self, site: str, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[site]}{path}", timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def status(self, site: str) -> dict[str, Any] | None:
        try:
            code, body = self.http(site, "/status")
        except OSError:
            return None  # not listening yet
        return json.loads(body) if code == 200 else None

    def wait_for(self, what: str, cond: Any, timeout: float) -> Any:
        """``cond()``'s first true value. Fails when a node exits with an error, or after ``timeout``
        s in which no node wrote a log line or an event: a loaded machine's slow run keeps moving
        and is waited for, a stalled one fails as fast as on a quiet one (the test's timeout bounds all)."""
        deadline = time.monotonic() + timeout
        seen = self._activity()
        while True:
            value = cond()
            if value:
                return value
            for site, p in self.procs.items():
                if p.poll() not in (None, 0):
                    raise AssertionError(f"{site} exited {p.returncode} waiting for {what}:\n{self.tail(site)}")
            if (now := self._activity()) != seen:
                seen, deadline = now, time.monotonic() + timeout
            if time.monotonic() > deadline:
                break
            time.sleep(0.3)
        raise AssertionError(
            f"no progress for {timeout:g} s waiting for {what}:\n" + "\n".join(f"--- {s}\n{self.tail(s, 15)}" for s in self.procs)
        )

    def _activity(self) -> tuple[int, ...]:
        """How much every node has written so far (logs and version events)."""
        paths = [self.log_path(s) for s in SITES] + [self.tmp / "state" / s / EVENTS_FILE for s in SITES]
        return tuple(p.stat().st_size if p.exists() else 0 for p in paths)

    def version(self, site: str) -> int:
        s = self.status(site)
        return -1 if s is None or s["version"] is None else s["version"]

    def signal(self, site: str, sig: signal.Signals, timeout: float = 60) -> int:
        p = self.procs[site]
        p.send_signal(sig)
        return p.wait(timeout)

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)

    def served(self, site: str) -> list[tuple[int, str]]:
        """(version, digest) of every version ``site`` served, from its version events."""
        events = read_events(self.tmp / "state" / site / "events.jsonl")
        return [(e.version, e.digest) for e in events if e.kind == "served"]

    def store(self, site: str) -> S3Store:
        return S3Store(self.server.bucket(site), self.prefix, self.server.config("admin"))

    async def published(self) -> dict[int, Any]:
        """Every manifest in the trainer's channel, verified with its public key: version -> Manifest."""
        trusted = trusted_keys([self.tmp / "keys" / "t0.key.pub"])
        async with self.store("t0") as store:
            layout = Layout(channel="policy", run=RUN, store_url=store.url)
            out = {}
            infos = {i.key: i.size for i in await store.list("")}
            for key in sorted(k for k in infos if k.startswith(layout.manifests)):
                m = verify_manifest(await store.get(key), trusted, context=layout.context)
                assert key == layout.manifest(m.version)
                for _, ref in m.roles():  # nothing half-written: every payload a manifest names is whole
                    assert infos.get(ref.key) == ref.size, f"v{m.version}: {ref.key} missing or not {ref.size} B"
                out[m.version] = m
            return out

    async def rollout_manifests(self, site: str) -> int:
        """Verify every rollout manifest in ``site``'s bucket names a payload of the right size."""
        trusted = trusted_keys([self.tmp / "keys" / f"{site}.key.pub"])
        layout = RolloutLayout()
        n = 0
        async with self.store(site) as store:
            infos = {i.key: i.size for i in await store.list("")}
            ctx = layout.context(RUN, store.url, site)
            for key in (k for k in infos if k.startswith(layout.manifests)):
                signed = verify_document(await store.get(key), trusted, context=ctx)
                m = batch_manifest_from(signed, layout=layout, name=layout.parse_manifest(key))
                assert infos.get(m.payload.key) == m.payload.size, f"{key}: payload missing or short"
                n += 1
        return n


@pytest.fixture
def network(server: SeaweedServer, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Network]:
    steps = getattr(request, "param", 12)
    net = Network(server, tmp_path, steps=steps)
    yield net
    net.kill_all()


def _check_http(net: Network, site: str) -> dict[str, Any]:
    code, body = net.http(site, "/healthz")
    assert code == 200 and json.loads(body)["ok"] is True, body
    status = net.status(site)
    assert status is not None
    role = "trainer" if site.startswith("t") else "inference"
    assert (status["role"], status["node_id"]) == (role, site)
    assert status["version"] is not None and len(status["digest"]) == 64 and status["errors"] == 0, status
    assert status["rollouts"]["rejected"] == 0, status  # no batch failed verification
    code, body = net.http(site, "/metrics")
    text = body.decode()
    assert code == 200
    assert f'pulsenet_policy_version{{node="{site}",role="{role}"}}' in text
    assert f'pulsenet_store_bytes_total{{channel="pulsesync",node="{site}",role="{role}"}}' in text
    return status


async def test_nodes_serve_status_survive_sigkill_and_agree(network: Network) -> None:
    net = network
    for site in SITES:
        net.start(site)
    # All three serve their status while they run: the trainer has published a few versions and
    # both inference nodes serve one of them.
    net.wait_for("trainer at v3", lambda: net.version("t0") >= 3, 150)
    net.wait_for("inference nodes serving", lambda: all(net.version(i) >= 1 for i in ("i0", "i1")), 60)
    t_status = _check_http(net, "t0")
    # The trainer reads the inference nodes' signed status objects: /status names the slowest.
    slowest = net.wait_for("slowest consumer", lambda: (net.status("t0") or {}).get("slowest_consumer"), 30)
    assert slowest["id"] in ("i0", "i1") and slowest["version"] <= net.version("t0") and slowest["kept"]
    assert t_status["rollouts"]["consumed"] > 0 and t_status["bytes"]["rollouts"] > 0
    for i in ("i0", "i1"):
        s = _check_http(net, i)
        assert s["rollouts"]["produced"] > 0 and s["bytes"]["pulsesync"] > 0

    # SIGKILL the trainer and one inference node mid-run; restart both with the same command.
    before = net.version("t0")
    assert before < net.steps, "the run ended before the kill: raise steps"
    assert net.signal("t0", signal.SIGKILL) == -signal.SIGKILL
    assert net.signal("i0", signal.SIGKILL) == -signal.SIGKILL
    net.start("t0")
    net.start("i0")
    net.wait_for("restarted trainer at its old version", lambda: net.version("t0") >= before, 90)
    resumed = [int(m.group(1)) for r in net.logs("t0") if (m := re.match(r"t0: at v(\d+)", r.get("msg", "")))]
    assert len(resumed) == 2 and resumed[1] >= before, resumed

    # SIGTERM mid-run (the trainer and the other inference node): exit 0, nothing half-written,
    # and the same command resumes them.
    net.wait_for("a version after the restart", lambda: net.version("t0") > before, 90)
    mid = net.version("t0")
    assert net.status("t0")["rollouts"]["rejected"] == 0
    assert mid < net.steps, "the run ended before SIGTERM: raise steps"
    assert net.signal("t0", signal.SIGTERM) == 0, net.tail("t0")
    assert net.signal("i1", signal.SIGTERM) == 0, net.tail("i1")
    assert max(await net.published()) >= mid  # checks every manifest's payloads exist, whole
    assert await net.rollout_manifests("i1") > 0
    net.start("t0")
    net.start("i1")

    # The trainer finishes its steps and exits 0; both inference nodes reach its last version.
    assert net.procs["t0"].wait(150) == 0, net.tail("t0")
    net.wait_for("inference at the last version", lambda: all(net.version(i) == net.steps for i in ("i0", "i1")), 60)
    finals = {i: net.status(i) for i in ("i0", "i1")}
    for i in ("i0", "i1"):  # SIGTERM: a clean exit
        assert net.signal(i, signal.SIGTERM) == 0, net.tail(i)

    await _check_agreement(net, finals, net.steps)


async def _check_agreement(net: Network, finals: dict[str, dict[str, Any]], last: int, first: int | None = 0) -> None:
    """After the run: one unbroken chain v<first>..v<last> (``first`` None: from wherever retention
    left it), every served version still in the store verified, final digests equal, every manifest
    (policy and rollouts) naming whole payloads."""
    published = await net.published()
    first = min(published) if first is None else first
    # Version numbering continued across restarts: each version once, one unbroken chain.
    assert sorted(published) == list(range(first, last + 1))
    for v in range(first + 1, last + 1):
        m = published[v]
        if m.base_version is not None:
            assert published[m.base_version].model_digest == m.base_digest
    assert len({m.model_digest for m in published.values()}) > (last - first) // 2, "versions barely changed"
    # Every version any inference node served is one the trainer signed, with its digest.
    for i in ("i0", "i1"):
        served = net.served(i)
        assert served, net.tail(i)
        kept = [(v, d) for v, d in served if v >= first]
        assert kept, f"{i} served nothing still in the store"
        for v, d in kept:
            assert published[v].model_digest == d, f"{i} served v{v} with digest {d[:12]}"
        assert finals[i]["digest"] == published[last].model_digest
    assert await net.rollout_manifests("i0") > 0 and await net.rollout_manifests("i1") > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_soak_repeated_kills(server: SeaweedServer, tmp_path: Path) -> None:
    """Longer: PULSENET_SOAK_KILLS times (default 8), once the trainer has moved two versions, SIGKILL
    a random node (trainer or inference) and restart it with the same command; then SIGTERM the
    trainer and run the same agreement checks on everything it published."""
    import random

    kills = int(os.environ.get("PULSENET_SOAK_KILLS", "8"))
    net = Network(server, tmp_path, steps=100_000)
    rng = random.Random(0)
    try:
        for site in SITES:
            net.start(site)
        net.wait_for("trainer at v2", lambda: net.version("t0") >= 2, 150)
        for _ in range(kills):
            target = net.version("t0") + 2
            net.wait_for(f"trainer at v{target}", lambda t=target: net.version("t0") >= t, 150)
            site = rng.choice(SITES)
            assert net.signal(site, signal.SIGKILL) == -signal.SIGKILL
            net.start(site)
            net.wait_for(f"{site} back", lambda s=site: net.version(s) >= 0, 120)
        assert net.signal("t0", signal.SIGTERM) == 0, net.tail("t0")
        last = max(await net.published())
        net.wait_for("inference at the last version", lambda: all(net.version(i) == last for i in ("i0", "i1")), 90)
        finals = {i: net.status(i) for i in ("i0", "i1")}
        for i in ("i0", "i1"):
            assert net.signal(i, signal.SIGTERM) == 0, net.tail(i)
        await _check_agreement(net, finals, last, first=None)
    finally:
        net.kill_all()
