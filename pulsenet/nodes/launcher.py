"""``pulsenet up``: a whole network on one machine, every node its own process.

What it does, in order:

1. a work directory (``--workdir``): signing keys (kept across runs), the tiny warm-up cache (kept),
   and this run's ``state/``, ``config/``, ``logs/`` and ``s3/`` (wiped at the start of each run);
2. the store: an embedded SeaweedFS with one bucket per site and one identity per site that may
   write only its own bucket (``writer-<site>``; with several trainers, also their shared PULSELoCo
   bucket), or ``--s3-endpoint`` with the credentials of the
   environment (AWS_*) and buckets ``<bucket-prefix><site>``; every run uses its own prefix;
3. N trainers and K inference nodes (2 and 2 by default), planned by ``nodes/plan.py`` (the model's
   preset under this command's settings), each ``python -m pulsenet --log-format json -v <role>
   --config <workdir>/config/<node>.toml`` with its site's credentials in AWS_*, its own status port
   and its log in ``<workdir>/logs/<node>.log``. Children are tied to this process
   (``runtime.spawn_tied``: PR_SET_PDEATHSIG), so none outlives it, even if it is SIGKILLed;
4. a live table polling each node's ``/status`` and ``/healthz``;
5. when the trainers have published ``--rounds`` versions (and exited), the inference nodes get
   SIGTERM once they serve the final version (or after ``serve_timeout_s``); Ctrl-C or SIGTERM
   stops every node the same way at any time (SIGTERM, wait, SIGKILL fallback);
6. the end summary and, with ``--report DIR``, ``summary.json`` and PNG plots (``nodes/report.py``).

Where the per-round history comes from: the nodes' own version events (``nodes/events.py``), one
JSON line per version in ``<workdir>/state/<node>/events.jsonl``: a trainer's ``published``, an
inference node's ``served`` and ``stopped``. They survive the process (a trainer exits after its
last version, before a poller could be sure to see it) and hold every version, where ``/status``
holds only the latest; ``nodes/summary.py`` turns them into the report. No log text is parsed,
except a crashed node's last error for the failure reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pulsenet.errors import ConfigError, PulsenetError
from pulsenet.nodes.events import EVENTS_FILE, VersionEvent, read_events
from pulsenet.nodes.plan import NetworkSettings, Site, inference_ids, plan_network, trainer_ids
from pulsenet.nodes.summary import efficiency, requests, summarize
from pulsenet.runtime import signal_group, spawn_tied

log = logging.getLogger(__name__)
MARKER = ".pulsenet-up"
"""Marks a work directory as ``pulsenet up``'s own: only then does a run wipe directories in it."""
LOCO_SITE = "loco"
"""The bucket the trainers of a PULSELoCo run share (each writes only its own keys in it)."""
RUN_DIRS = ("state", "config", "logs", "s3")
"""What belongs to one run and is wiped when the next starts (keys/ and cache/ are kept)."""


@dataclass(kw_only=True)
class UpConfig(NetworkSettings):
    """A local network on one machine. Settings: the [up] table of --config FILE, then PULSENET_<FIELD>, then --field."""

    workdir: Path = Path(".pulsenet-up")
    """Keys and the warm-up cache (kept), this run's node states, configs, logs and store (wiped per run)."""
    s3_endpoint: str = ""
    """An S3 endpoint to use instead of the embedded SeaweedFS (credentials from AWS_*; the
    buckets <bucket-prefix><site> are created if missing)."""
    bucket_prefix: str = "pulsenet-"
    """Bucket names are this plus the site (t0, i0, ...)."""
    report: Path | None = None
    """Write summary.json and reward.png, bytes.png, sparsity.png here."""
    live: bool = True
    """Show the live table (off: one line per change of the trainer's version)."""
    poll_s: float = 0.5
    """Interval of /status polls (display, end detection)."""
    timeout_s: float = 1800.0
    """Give up (and stop every node) if the trainers have not finished by then."""
    serve_timeout_s: float = 120.0
    """After the trainers finish, how long inference nodes get to serve the final version."""
    stop_grace_s: float = 30.0
    """After SIGTERM, how long a node gets to exit before SIGKILL."""


@dataclass
class Node:
    """One child process of the network."""

    name: str
    role: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    events_path: Path
    status_url: str
    proc: subprocess.Popen[bytes] | None = None
    status: dict[str, Any] = field(default_factory=dict)
    health: str = "starting"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


@dataclass
class Outcome:
    """What a run ended with: its exit code, the nodes, and the history read from their logs."""

    code: int
    reason: str
    nodes: list[Node]
    events: dict[str, list[VersionEvent]]
    wall_s: float


# --- the run ------------------------------------------------------------------------------------


def run_up(c: UpConfig) -> int:
    """``pulsenet up``: the whole run, from a fresh store to the summary; returns the exit code."""
    _check(c)
    from rich.console import Console

    out, err = Console(), Console(stderr=True)
    workdir = c.workdir.absolute()
    _fresh_run_dirs(workdir)
    sites = [f"t{k}" for k in range(c.trainers)] + [f"i{k}" for k in range(c.inference)]
    _ensure_keys(workdir / "keys", sites)
    run_id = f"up-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"
    if c.model == "tiny":
        _warm_up_once(workdir / "cache", c.seed, err)
    with _store(c, workdir, sites) as creds:
        nodes = _plan(c, workdir, run_id, creds)
        err.print(
            f"[bold]pulsenet up[/]: {c.trainers} trainer(s), {c.inference} inference node(s), {c.model}, "
            f"{c.rounds} rounds, run {run_id}; logs in {workdir / 'logs'}"
        )
        outcome = asyncio.run(_Supervisor(c, nodes, err).run())
    summary = summarize_up(c, outcome)
    if outcome.code not in (0, 130) and not summary["rounds"]:
        out.print(f"[bold red]pulsenet up failed[/]: {outcome.reason} (logs in {workdir / 'logs'})")
        return outcome.code
    print_summary(out, c, outcome, summary)
    if c.report is not None:
        from pulsenet.nodes.report import write_report

        write_report(c.report, rounds=summary["rounds"], nodes=summary["nodes"], extra=summary["extra"], evals=summary["eval"])
        out.print(f"report: {c.report.absolute()}/summary.json, reward.png, bytes.png, sparsity.png")
    return outcome.code


def _warm_up_once(cache: Path, seed: int, console: Any) -> None:
    """Warm the tiny model up here, once, into the cache every trainer loads it from.

    Trainers warming it up at the same time oversubscribe a small machine's cores (measured: two
    250-step warm-ups with 2 torch threads each on 2 cores took 50 s each, one alone 3.5 s), and
    one cached copy is one genesis for all of them."""
    from pulsenet.nodes.common import initial_model
    from pulsenet.nodes.trainer import TrainerConfig

    t0 = time.perf_counter()
    initial_model("tiny", cache, seed=seed, warmup_steps=TrainerConfig().warmup_steps)
    console.print(f"tiny model warmed up ({time.perf_counter() - t0:.1f} s, cached in {cache})")


def _check(c: UpConfig) -> None:
    if c.trainers < 1 or c.inference < 1 or c.rounds < 1:
        raise ConfigError("pulsenet up: --trainers, --inference and --rounds must be >= 1")
    from pulsenet.rl.models import resolve_model

    resolve_model(c.model)  # a model that is not there stops here, with how to get it
    if c.max_staleness < 0:
        raise ConfigError("pulsenet up: --max-staleness must be >= 0")


def _fresh_run_dirs(workdir: Path) -> None:
    """Wipe the last run's directories, in a work directory ``pulsenet up`` made (marked) only."""
    marker = workdir / MARKER
    if workdir.is_dir() and any(workdir.iterdir()) and not marker.exists():
        raise ConfigError(
            f"pulsenet up: {workdir} is not empty and was not made by pulsenet up (no {MARKER}): "
            "pick a new or empty --workdir (each run wipes its state/, config/, logs/ and s3/)"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    marker.write_text("a pulsenet up work directory: keys/ and cache/ are kept, the rest is wiped per run\n")
    for name in RUN_DIRS:
        shutil.rmtree(workdir / name, ignore_errors=True)
    for name in (*RUN_DIRS, "cache"):
        (workdir / name).mkdir(exist_ok=True)


def _ensure_keys(keys: Path, sites: list[str]) -> None:
    from pulsenet.signing import generate_keypair

    keys.mkdir(parents=True, exist_ok=True)
    for site in sites:
        if not (keys / f"{site}.key").exists() or not (keys / f"{site}.key.pub").exists():
            generate_keypair(keys / f"{site}.key")


@dataclass(frozen=True)
class _Creds:
    """Per-site AWS_* variables and bucket names for one store."""

    env: dict[str, dict[str, str]]
    buckets: dict[str, str]


@contextlib.contextmanager
def _store(c: UpConfig, workdir: Path, sites: list[str]) -> Iterator[_Creds]:
    trainers = [s for s in sites if s.startswith("t")]
    shared = {LOCO_SITE: trainers} if len(trainers) > 1 else {}
    buckets = {s: f"{c.bucket_prefix}{s}" for s in (*sites, *shared)}
    if c.s3_endpoint:
        env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        env["AWS_ENDPOINT_URL"] = c.s3_endpoint
        if not env.get("AWS_ACCESS_KEY_ID") or not env.get("AWS_SECRET_ACCESS_KEY"):
            raise ConfigError("pulsenet up --s3-endpoint: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        _create_buckets(env, list(buckets.values()))
        yield _Creds({s: env for s in sites}, buckets)
        return
    from pulsenet.store.seaweed import SeaweedServer

    with SeaweedServer(workdir / "s3", sites=sites, shared=shared, bucket_prefix=c.bucket_prefix) as server:
        server.create_buckets()
        env = {}
        for s in sites:
            cfg = server.config(server.writer(s))  # writes only this site's bucket, reads all
            env[s] = {
                "AWS_ENDPOINT_URL": cfg.endpoint_url or "",
                "AWS_ACCESS_KEY_ID": cfg.access_key_id or "",
                "AWS_SECRET_ACCESS_KEY": cfg.secret_access_key or "",
                "AWS_REGION": cfg.region or "",
            }
        yield _Creds(env, buckets)


def _create_buckets(env: dict[str, str], names: list[str]) -> None:
    import boto3
    import botocore.exceptions as bex

    client = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
    )
    for name in names:
        try:
            client.create_bucket(Bucket=name)
        except bex.ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise PulsenetError(f"cannot create bucket {name!r} on {env['AWS_ENDPOINT_URL']}: {e}") from e


def _plan(c: UpConfig, workdir: Path, run_id: str, creds: _Creds) -> list[Node]:
    """Each node's config file (``nodes/plan.py``), command, environment, status port and log."""
    from pulsenet.settings import to_toml_table

    keys = workdir / "keys"
    ids = trainer_ids(c) + inference_ids(c)
    sites = {
        s: Site(f"s3://{creds.buckets[s]}/{run_id}", keys / f"{s}.key", workdir / "state" / s) for s in ids
    }
    loco = f"s3://{creds.buckets[LOCO_SITE]}/{run_id}" if c.trainers > 1 else ""  # every trainer may write it
    trainers, inference = plan_network(
        c, run=run_id, sites=sites, public_keys=keys, loco_store=loco, cache_dir=workdir / "cache"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PULSENET_"))}
    nodes = []
    for role, configs in (("trainer", trainers), ("inference", inference)):
        for nc in configs:
            nc.status_port = _free_port()
            nodes.append(_node(workdir, nc.id, role, {role: to_toml_table(nc)}, base | creds.env[nc.id], nc.status_port))
    return nodes


def _node(workdir: Path, name: str, role: str, table: dict[str, Any], env: dict[str, str], port: int) -> Node:
    path = workdir / "config" / f"{name}.toml"
    path.write_text(_toml(table))
    tomllib.loads(path.read_text())  # what we wrote must read back
    cmd = [sys.executable, "-m", "pulsenet", "--log-format", "json", "-v", role, "--config", str(path)]
    events = workdir / "state" / name / EVENTS_FILE
    return Node(name, role, cmd, env, workdir / "logs" / f"{name}.log", events, f"http://127.0.0.1:{port}")


def _toml(data: dict[str, Any], prefix: str = "") -> str:
    """A small TOML writer for the node tables (strings, numbers, booleans, lists, nested tables)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for k, v in data.items():
        if isinstance(v, dict):
            lines += ["", f"[{prefix}{k}]", _toml(v, f"{prefix}{k}.")]
    return "\n".join(lines).strip("\n") + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))  # a JSON string is a valid TOML basic string


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- supervision ------------------------------------------------------------------------------


class _Supervisor:
    """Starts the nodes, polls them, decides when the run is over, and stops them."""

    def __init__(self, c: UpConfig, nodes: list[Node], console: Any) -> None:
        self.c, self.nodes, self.console = c, nodes, console
        self.stop = asyncio.Event()
        self.reason = ""

    async def run(self) -> Outcome:
        import aiohttp

        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._interrupt, sig)
        code = 1
        try:
            for n in self.nodes:
                n.log_path.parent.mkdir(parents=True, exist_ok=True)
                with open(n.log_path, "ab") as logf:  # the child holds its own descriptor
                    n.proc = spawn_tied(
                        n.cmd, n.name, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=n.env
                    )
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
                code = await self._watch(http)
        finally:
            await asyncio.to_thread(self._stop_all, [n for n in self.nodes if n.returncode is None])
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        events = {n.name: read_events(n.events_path) for n in self.nodes}
        return Outcome(code, self.reason, self.nodes, events, time.perf_counter() - t0)

    def _interrupt(self, sig: signal.Signals) -> None:
        self.reason = f"stopped by {signal.Signals(sig).name}"
        self.stop.set()

    async def _watch(self, http: Any) -> int:
        """Poll until the trainers are done and the inference nodes serve their last version."""
        from rich.live import Live

        c = self.c
        deadline = time.monotonic() + c.timeout_s
        serve_deadline: float | None = None
        final: int | None = None
        trainers = [n for n in self.nodes if n.role == "trainer"]
        inference = [n for n in self.nodes if n.role == "inference"]
        live = Live(self.table(), console=self.console, refresh_per_second=2, transient=False) if c.live else None
        last_version = None
        with live if live is not None else contextlib.nullcontext():
            while True:
                await asyncio.gather(*(self._poll(http, n) for n in self.nodes))
                if live is not None:
                    live.update(self.table())
                else:
                    v = max((_version(n) for n in trainers), default=-1)
                    if v != last_version:
                        last_version = v
                        self.console.print(self.line())
                if self.stop.is_set():
                    return 130
                failed = [n for n in self.nodes if n.returncode not in (None, 0)]
                failed += [n for n in inference if n.returncode == 0]
                if failed:
                    self.reason = "; ".join(f"{n.name} exited with code {n.returncode}: {last_error(n.log_path)}" for n in failed)
                    return 1
                if final is None and all(n.returncode == 0 for n in trainers):
                    final = max((e.version for t in trainers for e in read_events(t.events_path) if e.kind == "published"), default=None)
                    if final is None or final < c.rounds:
                        self.reason = f"trainers exited at v{final}, before v{c.rounds}"
                        return 1
                    serve_deadline = time.monotonic() + c.serve_timeout_s
                if final is not None:
                    if all(_version(n) >= final for n in inference):
                        self.reason = f"done: every node at v{final}"
                        return 0
                    if serve_deadline is not None and time.monotonic() > serve_deadline:
                        behind = [n.name for n in inference if _version(n) < final]
                        self.reason = f"{', '.join(behind)} did not serve v{final} within {c.serve_timeout_s:g} s"
                        return 1
                if time.monotonic() > deadline:
                    self.reason = f"timed out after {c.timeout_s:g} s"
                    return 1
                try:
                    async with asyncio.timeout(c.poll_s):
                        await self.stop.wait()
                except TimeoutError:
                    pass

    async def _poll(self, http: Any, n: Node) -> None:
        import aiohttp

        rc = n.returncode
        if rc is not None:
            if n.health in ("done", f"exit {rc}"):
                return
            n.health = "done" if rc == 0 else f"exit {rc}"
            # Its last word is in its events: a trainer exits right after its last version.
            last = [e for e in read_events(n.events_path) if e.kind in ("published", "stopped")]
            if last:
                n.status = n.status | {"version": last[-1].version, "digest": last[-1].digest}
            return
        try:
            async with http.get(f"{n.status_url}/status") as r:
                n.status = await r.json()
            async with http.get(f"{n.status_url}/healthz") as r:
                n.health = "ok" if r.status == 200 else "stuck"
        except (aiohttp.ClientError, TimeoutError, ValueError):
            n.health = "starting" if not n.status else "no answer"

    def _stop_all(self, nodes: list[Node]) -> None:
        """SIGTERM every node, wait up to ``stop_grace_s``, SIGKILL what is left (blocking)."""
        for n in nodes:
            assert n.proc is not None
            signal_group(n.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.c.stop_grace_s
        for n in nodes:
            assert n.proc is not None
            try:
                n.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: SIGKILL", n.name, self.c.stop_grace_s)
                signal_group(n.proc, signal.SIGKILL)
                n.proc.wait()

    def table(self) -> Any:
        from rich.table import Table

        t = Table(title="pulsenet up", expand=False)
        for col in ("node", "health", "version", "reward", "staleness", "rollouts", "pulsesync B", "pulseloco B", "rollout B", "errors"):
            t.add_column(col, justify="right")
        for n in self.nodes:
            s = n.status
            b = s.get("bytes", {})
            r = s.get("rollouts", {})
            t.add_row(
                n.name,
                n.health,
                _fmt(s.get("version")),
                _fmt(s.get("reward"), "{:.3f}"),
                _fmt(s.get("staleness")),
                _fmt(r.get("consumed") if n.role == "trainer" else r.get("produced")),
                _fmt(b.get("pulsesync"), "{:,}"),
                _fmt(b.get("pulseloco"), "{:,}"),
                _fmt(b.get("rollouts"), "{:,}"),
                _fmt(s.get("errors")),
            )
        return t

    def line(self) -> str:
        return "  ".join(
            f"{n.name}: v{_fmt(n.status.get('version'))} r={_fmt(n.status.get('reward'), '{:.3f}')} {n.health}"
            for n in self.nodes
        )


def _version(n: Node) -> int:
    v = n.status.get("version")
    return -1 if v is None else int(v)


def _fmt(v: Any, spec: str = "{}") -> str:
    return "-" if v is None else spec.format(v)


def last_error(path: Path) -> str:
    """The node's last error line (a ``pulsenet: error`` line or an ERROR record), else its last line."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    for line in reversed(lines):
        if line.startswith("pulsenet: error"):
            return line
        if line.startswith("{") and '"level": "ERROR"' in line:
            with contextlib.suppress(ValueError):
                return json.loads(line).get("msg", line)
    return lines[-1][:300] if lines else "(empty log)"


# --- the summary ------------------------------------------------------------------------------


def summarize_up(c: UpConfig, o: Outcome) -> dict[str, Any]:
    """Rounds, nodes and checks from the nodes' version events (``nodes/summary.py``), plus the run."""
    roles = {n.name: n.role for n in o.nodes}
    s = summarize(o.events, roles, max_staleness=c.max_staleness)
    for n in o.nodes:
        s["nodes"][n.name]["pid"] = n.pid
    s["efficiency"], s["requests"] = efficiency(o.events, roles), requests(o.events, roles)
    s["extra"] = {
        "efficiency": s["efficiency"],
        "requests": s["requests"],
        "run": {
            "model": c.model,
            "rounds": c.rounds,
            "trainers": c.trainers,
            "inference": c.inference,
            "max_staleness": c.max_staleness,
            "wall_s": round(o.wall_s, 1),
            "exit": o.code,
            "reason": o.reason,
        },
        "checks": s["checks"],
        "nodes_detail": s["nodes"],
    }
    return s


def print_summary(out: Any, c: UpConfig, o: Outcome, s: dict[str, Any]) -> None:
    from rich.table import Table

    rounds = s["rounds"]
    out.print(f"\n[bold]pulsenet up[/]: {o.reason or 'stopped'} after {o.wall_s:.0f} s")
    if rounds:
        curve = " ".join(f"{r['reward']:.2f}" if r["reward"] is not None else "-" for r in rounds)
        out.print(f"reward per round: {curve}")
        rewards = [r["reward"] for r in rounds if r["reward"] is not None]
        if len(rewards) >= 10:
            n = len(rewards) // 10
            first, last = sum(rewards[:n]) / n, sum(rewards[-n:]) / n
            out.print(f"reward, first tenth -> last tenth of the rounds: {first:.3f} -> {last:.3f}")
        sp = [r["sparsity"] for r in rounds if r["sparsity"] is not None]
        if sp:
            out.print(f"sparsity (BF16 weights unchanged per version): mean {sum(sp) / len(sp):.4f}, min {min(sp):.4f}")
        total = {ch: sum(r["bytes"][ch] for r in rounds) for ch in rounds[0]["bytes"]}
        out.print(
            f"PULSESync: {total['pulsesync']:,} B to {c.inference} inference node(s) vs {total['full_sync']:,} B "
            f"of full checkpoints ({_ratio(total['full_sync'], total['pulsesync'])})"
        )
        if c.trainers == 1:
            out.print("PULSELoCo: n.a. (one trainer: no rounds between trainers, 0 B; DiLoCo and DDP 0 B too)")
        elif not total["pulseloco"]:
            out.print("PULSELoCo: not reported (the trainers' logs carry no loco_bytes per round)")
        else:
            out.print(
                f"PULSELoCo: {total['pulseloco']:,} B vs DiLoCo {total['diloco']:,} B "
                f"({_ratio(total['diloco'], total['pulseloco'])}) and DDP {total['ddp']:,} B "
                f"({_ratio(total['ddp'], total['pulseloco'])})"
            )
        out.print(f"rollouts: {total['rollouts']:,} B")
        if s["eval"]:
            out.print("greedy eval on held-out problems: " + " ".join(f"v{e['version']} {e['reward']:.3f}" for e in s["eval"]))
        e = s["efficiency"]
        out.print(
            f"efficiency: {_pct(e['trained_fraction'])} of generated rollouts trained on, "
            f"{_pct(e['dropped_fraction'])} dropped stale, mean staleness {_fmt(e['staleness_mean'], '{:.2f}')}; "
            f"engines busy {_pct(e['engine_busy'])}, trainers busy {_pct(e['trainer_busy'])}; "
            f"update latency p95 {_fmt(e['update_latency_s']['p95'], '{:.2f}')} s of a "
            f"{_fmt(e['round_s'], '{:.1f}')} s round"
        )
    t = Table(title="verified versions and digests")
    for col in ("node", "role", "version", "digest", "checks"):
        t.add_column(col)
    for name, d in s["nodes"].items():
        ok = ""
        if d["role"] == "inference":
            ok = "served verified" if d["served_verified"] else "UNVERIFIED" if d["served"] else "served nothing"
            if d["weights_digest"] is None:
                ok += ", own weights not rehashed"
            else:
                ok += ", own weights match" if d["weights_digest"] == d["digest"] else ", OWN WEIGHTS DIFFER"
        t.add_row(name, d["role"], _fmt(d["version"]), (d["digest"] or "-")[:16] + "…", ok)
    out.print(t)
    checks = s["checks"]
    out.print("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.1f}x smaller" if b else "n.a."
