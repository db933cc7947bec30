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
4. the ``Supervisor``: a live table polling each node's ``/status`` (its health and reasons in it);
   a node that exits unexpectedly is started again with the same command, config and credentials
   after an exponential backoff, and so is the embedded store (same directory, ports and keys); a
   node whose own ``/healthz`` says stuck is restarted; a network that makes no new version within
   the round deadline is reported STUCK with the trainer that holds it up. The run fails only on a
   crash loop (``--supervise.max-restarts`` restarts within ``--supervise.window-s``), naming the
   node, how often it exited and its last error (``nodes/supervisor.py`` holds these decisions;
   ``state/supervisor.jsonl`` records each of them);
5. when the trainers have published ``--rounds`` versions (and exited), the inference nodes get
   SIGTERM once they serve the final version (or after ``serve_timeout_s``); Ctrl-C or SIGTERM
   stops every node the same way at any time (SIGTERM, wait, SIGKILL fallback);
6. the end summary (restarts per node included) and, with ``--report DIR``, ``summary.json`` and
   PNG plots (``nodes/report.py``).

Where the per-round history comes from: the nodes' own version events (``nodes/events.py``), one
JSON line per version in ``<workdir>/state/<node>/events.jsonl``: a trainer's ``published``, an
inference node's ``served`` and ``stopped``. They survive the process (a trainer exits after its
last version, before a poller could be sure to see it) and hold every version, where ``/status``
holds only the latest; ``nodes/summary.py`` turns them into the report. No log text is parsed,
except an exited node's last error (``supervisor.last_error``: an ERROR record, a typed
``pulsenet: error``, a traceback; never merely its last line) for the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import re
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
from typing import Any, Protocol

from pulsenet.errors import ConfigError, PulsenetError
from pulsenet.logs import suppressed
from pulsenet.nodes.events import EVENTS_FILE, VersionEvent, read_events
from pulsenet.nodes.plan import NetworkSettings, Site, inference_ids, plan_network, trainer_ids
from pulsenet.nodes.summary import efficiency, requests, summarize
from pulsenet.nodes.supervisor import (
    JOURNAL_FILE,
    EventTail,
    Exit,
    Journal,
    Liveness,
    Restarts,
    SuperviseConfig,
    TrainerView,
    describe_exit,
    holdup,
    last_error,
    with_inference,
)
from pulsenet.runtime import signal_group, spawn_tied

log = logging.getLogger(__name__)
MARKER = ".pulsenet-up"
"""Marks a work directory as ``pulsenet up``'s own: only then does a run wipe directories in it."""
LOCO_SITE = "loco"
"""The bucket the trainers of a PULSELoCo run share (each writes only its own keys in it)."""
RUN_DIRS = ("state", "config", "logs", "s3")
"""What belongs to one run and is wiped when the next starts (keys/ and cache/ are kept)."""
LONE_ROUND_DEADLINE_S = 300.0
"""The default round deadline of a lone trainer (a version per GRPO step)."""


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
    """Show the live table (off: one line per new version, or change of a node's health or restarts)."""
    poll_s: float = 0.5
    """Interval of /status polls (display, end detection)."""
    timeout_s: float = 1800.0
    """Give up (and stop every node) if the trainers have not finished by then."""
    serve_timeout_s: float = 120.0
    """After the trainers finish, how long inference nodes get to serve the final version."""
    stop_grace_s: float = 30.0
    """After SIGTERM, how long a node gets to exit before SIGKILL."""
    supervise: SuperviseConfig = field(default_factory=SuperviseConfig)
    """Restarts (backoff, crash loop), the round deadline of a stuck network, liveness restarts."""


@dataclass
class Node:
    """One node of the network: its command (the same for every life) and its current process."""

    name: str
    role: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    events_path: Path
    status_url: str
    proc: subprocess.Popen[bytes] | None = None
    """The current life's process; None between an exit and its restart, and once done."""
    status: dict[str, Any] = field(default_factory=dict)
    """Its last /status answer."""
    health: str = "starting"
    """Its /healthz status (``ok``, ``degraded``, ``stuck``), ``starting``, ``no answer``, ``down: ...``, ``done``."""
    reasons: list[str] = field(default_factory=list)
    """Its /healthz reasons."""
    restarts: Restarts = field(default_factory=Restarts)
    pids: list[int] = field(default_factory=list)
    """The process id of every life."""
    log_offset: int = 0
    """Where the current life's output starts in its log (its last error is looked for after it)."""
    life_from: int = 0
    """Index of the current life's first event in ``tail.events``."""
    answered: bool = False
    """The current life has answered /status."""
    done: bool = False
    """A trainer that exited after its last version."""
    stopping: str = ""
    """Why the supervisor is stopping the current life (stuck, or not answering), "" otherwise."""
    liveness: Liveness = field(default_factory=lambda: Liveness(time.monotonic()))
    """The current life's health probes (``supervisor.Liveness``)."""
    unresponsive: str = ""
    """Why the current life must be restarted for not answering its probes, "" while it answers."""
    tail: EventTail = field(init=False)
    """Its ``events.jsonl``, read as it grows: every version it published or served, in every life."""

    def __post_init__(self) -> None:
        self.tail = EventTail(self.events_path)

    @property
    def pid(self) -> int | None:
        return self.pids[-1] if self.pids else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Outcome:
    """What a run ended with: its exit code, the nodes, and the history read from their events."""

    code: int
    reason: str
    nodes: list[Node]
    events: dict[str, list[VersionEvent]]
    wall_s: float
    store_restarts: int = 0


# --- the run ------------------------------------------------------------------------------------


def run_up(config: UpConfig) -> int:
    """``pulsenet up``: the whole run, from a fresh store to the summary; returns the exit code."""
    from rich.console import Console

    out = Console()
    outcome, summary = run_network(config)
    report_outcome(out, config, outcome, summary)
    return outcome.code


def run_network(config: UpConfig, injector: Injector | None = None) -> tuple[Outcome, dict[str, Any]]:
    """Fresh run directories, keys, the store, the nodes under the ``Supervisor`` until the run is
    over, then the summary (``summarize_up``). ``injector``: ``pulsenet chaos``'s faults."""
    _check(config)
    from rich.console import Console

    err = Console(stderr=True)
    workdir = config.workdir.absolute()
    _fresh_run_dirs(workdir)
    sites = [f"t{k}" for k in range(config.trainers)] + [f"i{k}" for k in range(config.inference)]
    _ensure_keys(workdir / "keys", sites)
    run_id = f"up-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"
    if config.model == "tiny":
        _warm_up_once(workdir / "cache", config.seed, err)
    with _store(config, workdir, sites) as (creds, server):
        nodes = _plan(config, workdir, run_id, creds, injector)
        deadline = config.supervise.round_deadline_s or _round_deadline(workdir, config)
        err.print(
            f"[bold]pulsenet up[/]: {config.trainers} trainer(s), {config.inference} inference node(s), {config.model}, "
            f"{config.rounds} rounds, run {run_id}; logs in {workdir / 'logs'}; round deadline {deadline:g} s"
        )
        journal = Journal(workdir / "state" / JOURNAL_FILE)
        journal.write("start", run=run_id, nodes=[n.name for n in nodes], round_deadline_s=deadline)
        sup = Supervisor(config, nodes, err, server=server, journal=journal, injector=injector, round_deadline_s=deadline)
        outcome = asyncio.run(sup.run())
    return outcome, summarize_up(config, outcome)


def report_outcome(out: Any, config: UpConfig, outcome: Outcome, summary: dict[str, Any]) -> None:
    """The end of ``pulsenet up``'s output: the failure, or the summary (and the report files)."""
    if outcome.code not in (0, 130) and not summary["rounds"]:
        out.print(f"[bold red]pulsenet up failed[/]: {outcome.reason} (logs in {config.workdir.absolute() / 'logs'})")
        return
    print_summary(out, config, outcome, summary)
    if config.report is not None:
        from pulsenet.nodes.report import write_report

        write_report(config.report, rounds=summary["rounds"], nodes=summary["nodes"], extra=summary["extra"], evals=summary["eval"])
        out.print(f"report: {config.report.absolute()}/summary.json, reward.png, bytes.png, sparsity.png")


def _round_deadline(workdir: Path, c: UpConfig) -> float:
    """The default round deadline: twice the trainers' PULSELoCo ``deadline_s`` (from t0's config as
    written), or ``LONE_ROUND_DEADLINE_S`` for a lone trainer."""
    if c.trainers < 2:
        return LONE_ROUND_DEADLINE_S
    table = tomllib.loads((workdir / "config" / "t0.toml").read_text())["trainer"]
    return 2.0 * float(table.get("loco", {}).get("deadline_s", LONE_ROUND_DEADLINE_S / 2))


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
def _store(c: UpConfig, workdir: Path, sites: list[str]) -> Iterator[tuple[_Creds, Any]]:
    """The store's credentials per site, and the embedded ``SeaweedServer`` (None with ``--s3-endpoint``)."""
    trainers = [s for s in sites if s.startswith("t")]
    shared = {LOCO_SITE: trainers} if len(trainers) > 1 else {}
    buckets = {s: f"{c.bucket_prefix}{s}" for s in (*sites, *shared)}
    if c.s3_endpoint:
        env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        env["AWS_ENDPOINT_URL"] = c.s3_endpoint
        if not env.get("AWS_ACCESS_KEY_ID") or not env.get("AWS_SECRET_ACCESS_KEY"):
            raise ConfigError("pulsenet up --s3-endpoint: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        _create_buckets(env, list(buckets.values()))
        yield _Creds({s: env for s in sites}, buckets), None
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
        yield _Creds(env, buckets), server


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


def _plan(c: UpConfig, workdir: Path, run_id: str, creds: _Creds, injector: Injector | None = None) -> list[Node]:
    """Each node's config file (``nodes/plan.py``), command, environment, status port and log.
    ``injector``: may adjust the planned settings and give each node its own store endpoint."""
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
    if injector is not None:
        injector.adjust(trainers, inference)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PULSENET_"))}
    nodes = []
    for role, configs in (("trainer", trainers), ("inference", inference)):
        for nc in configs:
            nc.status_port = _free_port()
            env = base | creds.env[nc.id]
            if injector is not None and env.get("AWS_ENDPOINT_URL"):
                env["AWS_ENDPOINT_URL"] = injector.endpoint(nc.id, env["AWS_ENDPOINT_URL"])
            nodes.append(_node(workdir, nc.id, role, {role: to_toml_table(nc)}, env, nc.status_port))
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


class Injector(Protocol):
    """What ``pulsenet chaos`` (pulsenet/chaos) hooks into a run; the launcher calls, in order:

    ``adjust`` on the planned node settings (before they are written), ``endpoint`` per node (the
    store URL it is given: a link the injector can throttle or cut), ``start`` before any node
    starts, ``run`` beside the supervisor's loop (cancelled when the run ends; an exception fails
    the run), and ``after`` once every node has stopped while the store still runs."""

    def adjust(self, trainers: list[Any], inference: list[Any]) -> None: ...

    def endpoint(self, node: str, url: str) -> str: ...

    async def start(self, sup: Supervisor) -> None: ...

    async def run(self, sup: Supervisor) -> None: ...

    async def after(self, sup: Supervisor) -> None: ...


class Supervisor:
    """Starts the nodes, restarts what exits unexpectedly (and the embedded store), reports a network
    that makes no version, decides when the run is over, and stops everything.

    The decisions are ``nodes/supervisor.py``'s; this class holds the processes and the loop. What
    it does is written to ``journal`` (``state/supervisor.jsonl``) as it happens."""

    def __init__(
        self,
        c: UpConfig,
        nodes: list[Node],
        console: Any,
        *,
        server: Any = None,
        journal: Journal | None = None,
        injector: Injector | None = None,
        round_deadline_s: float = 300.0,
    ) -> None:
        """``server``: the embedded ``SeaweedServer`` to watch and restart (None: an external endpoint)."""
        self.c, self.nodes, self.console = c, nodes, console
        self.server, self.injector = server, injector
        self.journal = journal or Journal(None)
        self.round_deadline_s = round_deadline_s
        self.policy = c.supervise
        self.stop = asyncio.Event()
        self.reason = ""
        self.store_restarts = Restarts()
        self.version = -1
        """The newest version any trainer published (their events)."""
        self.version_at: float | None = None
        """When ``version`` last rose; None until every trainer has answered once (start-up,
        warm-up and loading are not a stuck network: the round deadline counts from then)."""
        self.versions: list[tuple[int, float]] = []
        """(version, monotonic time) each time ``version`` rose: progress, for waiters and rates."""
        self.stuck_since: float | None = None
        self.holdup = ""
        """While the network is stuck: which trainer holds it up, and why."""
        self.final: int | None = None
        self._rng = random.Random()
        self._store_task: asyncio.Task[None] | None = None
        self._store_failure = ""
        self._tick = asyncio.Event()
        self._stoppers: set[asyncio.Task[None]] = set()

    # --- the run ------------------------------------------------------------------------------

    async def run(self) -> Outcome:
        import aiohttp

        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._interrupt, sig)
        code = 1
        chaos: asyncio.Task[None] | None = None
        try:
            if self.injector is not None:
                await self.injector.start(self)
            for n in self.nodes:
                self._spawn(n)
            if self.injector is not None:
                chaos = asyncio.create_task(self.injector.run(self), name="injector")
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
                code = await self._watch(http, chaos)
        finally:
            if chaos is not None:
                chaos.cancel()
                with contextlib.suppress(asyncio.CancelledError), suppressed(log, "up: teardown: the chaos injector"):
                    await chaos
            if self._store_task is not None:  # a store restart in flight finishes (bounded by its start-up timeout)
                with suppressed(log, "up: teardown: the store restart in flight"):
                    await self._store_task
            await asyncio.to_thread(self._stop_all, [n for n in self.nodes if n.running])
            for task in list(self._stoppers):
                with suppressed(log, "up: teardown: a node stop in flight"):
                    await task
            if self.injector is not None:
                try:
                    await self.injector.after(self)
                except Exception as e:  # the run's outcome stands; what the injector missed is logged
                    log.error("chaos: after the run: %s: %s", type(e).__name__, e)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        events = {n.name: read_events(n.events_path) for n in self.nodes}
        self.journal.write("end", code=code, reason=self.reason)
        return Outcome(code, self.reason, self.nodes, events, time.perf_counter() - t0, self.store_restarts.count)

    def _interrupt(self, sig: signal.Signals) -> None:
        self.reason = f"stopped by {signal.Signals(sig).name}"
        self.stop.set()

    async def _watch(self, http: Any, chaos: asyncio.Task[None] | None) -> int:
        """Poll until the trainers are done and the inference nodes serve their last version."""
        from rich.live import Live

        c = self.c
        deadline = time.monotonic() + c.timeout_s
        serve_deadline: float | None = None
        trainers = [n for n in self.nodes if n.role == "trainer"]
        inference = [n for n in self.nodes if n.role == "inference"]
        live = Live(self.table(), console=self.console, refresh_per_second=2, transient=False) if c.live else None
        last_line = None
        with live if live is not None else contextlib.nullcontext():
            while True:
                await asyncio.gather(*(self._poll(http, n) for n in self.nodes if n.running))
                now = time.monotonic()
                for n in self.nodes:
                    n.tail.read()
                failure = self._watch_store(now) or self._handle_exits(now)
                if failure:
                    self.reason = failure
                    return 1
                self._start_due(now)
                self._liveness()
                self._progress(now)
                self._tick.set()
                self._tick = asyncio.Event()
                if live is not None:
                    live.update(self.table())
                elif (key := self._line_key()) != last_line:
                    last_line = key
                    self.console.print(self.line(), soft_wrap=True)
                if self.stop.is_set():
                    return 130
                if chaos is not None and chaos.done() and not chaos.cancelled() and chaos.exception() is not None:
                    e = chaos.exception()
                    self.reason = f"chaos failed: {type(e).__name__}: {e}"
                    return 1
                if self.final is None and all(n.done for n in trainers):
                    self.final = max((node_version(n) for n in trainers), default=-1)
                    serve_deadline = now + c.serve_timeout_s
                    self.say(f"trainers done at v{self.final}; waiting for the inference nodes to serve it")
                if self.final is not None:
                    if all(serving_version(n) >= self.final for n in inference):
                        self.reason = f"done: every node at v{self.final}"
                        return 0
                    if serve_deadline is not None and now > serve_deadline:
                        behind = [n.name for n in inference if serving_version(n) < self.final]
                        self.reason = f"{', '.join(behind)} did not serve v{self.final} within {c.serve_timeout_s:g} s"
                        return 1
                if now > deadline:
                    self.reason = f"timed out after {c.timeout_s:g} s" + (f"; stuck: {self.holdup}" if self.holdup else "")
                    return 1
                try:
                    async with asyncio.timeout(c.poll_s):
                        await self.stop.wait()
                except TimeoutError:
                    pass

    async def ticked(self, timeout: float | None = None) -> None:
        """Return after the supervisor's next poll (what waiters on progress or restarts use)."""
        async with asyncio.timeout(timeout):
            await self._tick.wait()

    def say(self, msg: str) -> None:
        """Log ``msg`` and print it under the table."""
        log.info("%s", msg)
        self.console.print(f"[bold]pulsenet up[/]: {msg}", soft_wrap=True)

    # --- processes ----------------------------------------------------------------------------

    def _spawn(self, n: Node) -> None:
        n.log_path.parent.mkdir(parents=True, exist_ok=True)
        n.tail.read()
        n.life_from = len(n.tail.events)  # this life's events start here
        with open(n.log_path, "ab") as logf:  # the child holds its own descriptor
            n.log_offset = logf.tell()  # this life's errors start here
            n.proc = spawn_tied(n.cmd, n.name, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=n.env)
        n.pids.append(n.proc.pid)
        n.health, n.reasons, n.answered, n.stopping = "starting", [], False, ""
        n.liveness, n.unresponsive = Liveness(time.monotonic()), ""

    def _handle_exits(self, now: float) -> str:
        """Exited nodes: a trainer past its last version is done; any other exit is unexpected and
        restarted after a backoff. Returns the failure reason of a crash loop, else ""."""
        for n in self.nodes:
            if n.proc is None or (rc := n.proc.poll()) is None:
                continue
            n.proc = None
            if n.role == "trainer" and rc == 0 and not n.stopping and node_version(n) >= self.c.rounds:
                n.done, n.health = True, "done"
                self.journal.write("done", node=n.name, version=node_version(n))
                continue
            why = n.stopping or describe_exit(rc)
            error = last_error(n.log_path, n.log_offset) or str(n.status.get("last_error") or "")
            delay = n.restarts.exited(Exit(time.time(), rc, why, error), now, self.policy, self._rng)
            n.health = f"down: {why}"
            self.journal.write("exit", node=n.name, code=rc, why=why, error=error, version=node_version(n), restart_in_s=delay)
            if delay is None:
                reason = n.restarts.crash_loop(n.name, self.policy)
                self.journal.write("crash_loop", node=n.name, reason=reason)
                return reason
            self.say(f"{n.name} {why} (last error: {error or 'none logged'}); restart in {delay:.1f} s")
        return ""

    def _start_due(self, now: float) -> None:
        for n in self.nodes:
            if n.proc is None and not n.done and n.restarts.due is not None and now >= n.restarts.due:
                self._spawn(n)
                n.restarts.restarted(now)
                assert n.proc is not None
                self.journal.write("restart", node=n.name, count=n.restarts.count, pid=n.proc.pid)

    def _liveness(self) -> None:
        """A node whose own /healthz says stuck, or that leaves its probes unanswered
        (``Liveness``), is stopped (SIGTERM, then SIGKILL) and restarted."""
        for n in self.nodes:
            if not n.running or n.stopping:
                continue
            if n.unresponsive:
                n.stopping = f"stopped as unresponsive ({n.unresponsive})"
                self.journal.write("unresponsive_node", node=n.name, why=n.unresponsive)
                self.say(f"{n.name}: {n.unresponsive}; restarting it")
            elif self.policy.restart_stuck and n.health == "stuck":
                n.stopping = f"stopped as stuck ({'; '.join(n.reasons) or 'no progress'})"
                self.journal.write("stuck_node", node=n.name, reasons=n.reasons)
                self.say(f"{n.name} reports stuck: {'; '.join(n.reasons)}; restarting it")
            else:
                continue
            task = asyncio.create_task(asyncio.to_thread(self._stop_all, [n]))
            self._stoppers.add(task)
            task.add_done_callback(self._stoppers.discard)

    async def _poll(self, http: Any, n: Node) -> None:
        import aiohttp

        try:
            async with http.get(f"{n.status_url}/status") as r:
                status = await r.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            n.health = "no answer" if n.answered else "starting"
            n.unresponsive = n.liveness.probed(False, time.monotonic(), self.policy) or n.unresponsive
            return
        n.liveness.probed(True, time.monotonic(), self.policy)
        n.status, n.answered = status, True
        health = status.get("health") or {}
        n.health, n.reasons = str(health.get("status", "ok")), [str(x) for x in health.get("reasons", ())]

    def _stop_all(self, nodes: list[Node]) -> None:
        """SIGTERM every node, wait up to ``stop_grace_s``, SIGKILL what is left (blocking)."""
        procs = [(n, n.proc) for n in nodes if n.proc is not None]
        for _, proc in procs:
            signal_group(proc, signal.SIGCONT)  # a paused node must run to act on SIGTERM
            signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.c.stop_grace_s
        for n, proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: SIGKILL", n.name, self.c.stop_grace_s)
                signal_group(proc, signal.SIGKILL)
                proc.wait()

    # --- the store ----------------------------------------------------------------------------

    def _watch_store(self, now: float) -> str:
        """Restart the embedded store on the same directory, ports and keys when it has exited."""
        s = self.server
        if s is None or self._store_task is not None or s.running:
            return ""
        r = self.store_restarts
        if r.due is None:
            code = s.exit_code
            why = self._store_failure or (describe_exit(code) if code is not None else "not running")
            self._store_failure = ""
            delay = r.exited(Exit(time.time(), code, why, _weed_error(s)), now, self.policy, self._rng)
            self.journal.write("store_exit", code=code, why=why, restart_in_s=delay)
            if delay is None:
                reason = r.crash_loop("the store", self.policy)
                self.journal.write("crash_loop", node="store", reason=reason)
                return reason
            self.say(f"the store {why}; restart in {delay:.1f} s")
        elif now >= r.due:
            self._store_task = asyncio.create_task(self._restart_store())
        return ""

    async def _restart_store(self) -> None:
        from pulsenet.errors import PulsenetError

        t0 = time.monotonic()
        try:
            await asyncio.to_thread(self.server.restart)
        except PulsenetError as e:  # did not come up: counted as one more exit, retried after a backoff
            self.store_restarts.restarted(time.monotonic())
            self._store_failure = f"restart failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            log.error("store restart failed: %s", e)
        else:
            self.store_restarts.restarted(time.monotonic())
            self.journal.write("store_restart", count=self.store_restarts.count, took_s=round(time.monotonic() - t0, 2))
            self.say(f"the store is back (restart {self.store_restarts.count}, {time.monotonic() - t0:.1f} s)")
        finally:
            self._store_task = None

    def store_state(self) -> str:
        """Why the store does not serve ("" while it does, or when it is an external endpoint)."""
        s = self.server
        if s is None or (s.running and self._store_task is None):
            return ""
        if self._store_task is not None:
            return "restarting"
        last = self.store_restarts.exits[-1].why if self.store_restarts.exits else "down"
        return f"down ({last})"

    # --- progress -----------------------------------------------------------------------------

    def _progress(self, now: float) -> None:
        """Track the newest version; past the round deadline without one, the network is stuck."""
        v = max((node_version(n) for n in self.nodes if n.role == "trainer"), default=-1)
        if v > self.version:
            self.version, self.version_at = v, now
            self.versions.append((v, now))
            if self.stuck_since is not None:
                self.journal.write("unstuck", version=v, stuck_s=round(now - self.stuck_since, 1))
                self.say(f"the network moves again: v{v} after {now - self.stuck_since:.0f} s")
            self.stuck_since, self.holdup = None, ""
            return
        if self.version_at is None:
            if all(n.answered or n.done for n in self.nodes if n.role == "trainer"):
                self.version_at = now
            return
        if self.final is not None or now - self.version_at <= self.round_deadline_s:
            return
        self.holdup = with_inference(holdup(self.trainer_views(), self.store_state()), self.inference_views())
        if self.stuck_since is None:
            self.stuck_since = self.version_at
            self.journal.write("stuck", version=self.version, idle_s=round(now - self.version_at, 1), holdup=self.holdup)
            self.say(f"STUCK: no version for {now - self.version_at:.0f} s (at v{self.version}): {self.holdup}")

    def inference_views(self) -> list[tuple[str, str, list[str]]]:
        """(name, /healthz status, reasons) of every running inference node (``with_inference``)."""
        return [(n.name, n.health, n.reasons) for n in self.nodes if n.role == "inference" and n.running]

    def trainer_views(self) -> list[TrainerView]:
        views = []
        for n in self.nodes:
            if n.role != "trainer":
                continue
            state = "done" if n.done else "running" if n.running else "restarting"
            idle = n.status.get("idle_s")
            views.append(
                TrainerView(
                    n.name,
                    state,
                    n.health,
                    node_version(n) if node_version(n) >= 0 else None,
                    round=n.status.get("round"),
                    reasons=tuple(n.reasons),
                    idle_s=float(idle) if idle is not None else None,
                    exit=n.restarts.exits[-1].why if n.restarts.exits else "",
                )
            )
        return views

    def network_state(self) -> str:
        """One line: the network's version and age, or STUCK and who holds it up; the store."""
        if self.version_at is None:
            return "network starting"
        age = time.monotonic() - self.version_at
        if self.holdup:
            line = f"[bold red]STUCK[/] at v{self.version} for {age:.0f} s: {self.holdup}"
        else:
            line = f"network at v{self.version}, last version {age:.0f} s ago"
        store = self.store_state()
        if self.server is not None:
            line += f"; store {store or 'ok'}" + (f", {self.store_restarts.count} restart(s)" if self.store_restarts.count else "")
        return line

    # --- display ------------------------------------------------------------------------------

    def table(self) -> Any:
        from rich.table import Table

        t = Table(title="pulsenet up", caption=self.network_state(), expand=False)
        cols = ("node", "health", "restarts", "version", "reward", "staleness", "rollouts", "pulsesync B", "pulseloco B", "rollout B", "errors")
        for col in cols:
            t.add_column(col, justify="right")
        for n in self.nodes:
            s = n.status
            b = s.get("bytes", {})
            r = s.get("rollouts", {})
            v = node_version(n)
            t.add_row(
                n.name,
                n.health,
                str(n.restarts.count),
                _fmt(v if v >= 0 else None),
                _fmt(s.get("reward"), "{:.3f}"),
                _fmt(s.get("staleness")),
                _fmt(r.get("consumed") if n.role == "trainer" else r.get("produced")),
                _fmt(b.get("pulsesync"), "{:,}"),
                _fmt(b.get("pulseloco"), "{:,}"),
                _fmt(b.get("rollouts"), "{:,}"),
                _fmt(s.get("errors")),
            )
        return t

    def _line_key(self) -> tuple[Any, ...]:
        """What a new line is printed for without the live table: versions, health, restarts, stuck."""
        holdup = re.sub(r"\d+", "#", self.holdup)  # its idle seconds tick: a new line only when its words change
        return (self.version, holdup, *((n.health, n.restarts.count) for n in self.nodes))

    def line(self) -> str:
        nodes = "  ".join(
            f"{n.name}: v{_fmt(node_version(n) if node_version(n) >= 0 else None)} r={_fmt(n.status.get('reward'), '{:.3f}')} {n.health}"
            + (f" ({n.restarts.count} restarts)" if n.restarts.count else "")
            for n in self.nodes
        )
        return nodes + ("  STUCK: " + self.holdup if self.holdup else "")


def _weed_error(server: Any) -> str:
    """The store's last error line (its log's E/F records), "" if none."""
    lines = [x for x in server.log_tail(50).splitlines() if x[:1] in ("E", "F") and x[1:5].isdigit()]
    return lines[-1][:300] if lines else ""


def node_version(n: Node) -> int:
    """The version a node last published (trainer) or swapped in (inference), from its events; -1: none yet."""
    e = n.tail.last("published") if n.role == "trainer" else n.tail.last("served", "stopped")
    return -1 if e is None else e.version


def serving_version(n: Node) -> int:
    """The version a running node's current life serves (its events since it started); -1: none, or down."""
    if not n.running:
        return -1
    return max((e.version for e in n.tail.events[n.life_from :] if e.kind == "served"), default=-1)


def _fmt(v: Any, spec: str = "{}") -> str:
    return "-" if v is None else spec.format(v)


# --- the summary ------------------------------------------------------------------------------


def summarize_up(config: UpConfig, outcome: Outcome) -> dict[str, Any]:
    """Rounds, nodes and checks from the nodes' version events (``nodes/summary.py``), plus the run."""
    roles = {n.name: n.role for n in outcome.nodes}
    summary = summarize(outcome.events, roles, max_staleness=config.max_staleness)
    for n in outcome.nodes:
        summary["nodes"][n.name] |= {
            "pid": n.pid,
            "pids": list(n.pids),
            "restarts": n.restarts.count,
            "exits": [dataclasses.asdict(e) for e in n.restarts.exits],
        }
    summary["efficiency"], summary["requests"] = efficiency(outcome.events, roles), requests(outcome.events, roles)
    summary["extra"] = {
        "efficiency": summary["efficiency"],
        "requests": summary["requests"],
        "run": {
            "model": config.model,
            "rounds": config.rounds,
            "trainers": config.trainers,
            "inference": config.inference,
            "max_staleness": config.max_staleness,
            "wall_s": round(outcome.wall_s, 1),
            "exit": outcome.code,
            "reason": outcome.reason,
        },
        "checks": summary["checks"],
        "nodes_detail": summary["nodes"],
        "restarts": {n.name: n.restarts.count for n in outcome.nodes} | {"store": outcome.store_restarts},
    }
    return summary


def print_summary(out: Any, config: UpConfig, outcome: Outcome, summary: dict[str, Any]) -> None:
    from rich.table import Table

    rounds = summary["rounds"]
    out.print(f"\n[bold]pulsenet up[/]: {outcome.reason or 'stopped'} after {outcome.wall_s:.0f} s")
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
            f"PULSESync: {total['pulsesync']:,} B to {config.inference} inference node(s) vs {total['full_sync']:,} B "
            f"of full checkpoints ({_ratio(total['full_sync'], total['pulsesync'])})"
        )
        if config.trainers == 1:
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
        if summary["eval"]:
            out.print("greedy eval on held-out problems: " + " ".join(f"v{e['version']} {e['reward']:.3f}" for e in summary["eval"]))
        e = summary["efficiency"]
        out.print(
            f"efficiency: {_pct(e['trained_fraction'])} of generated rollouts trained on, "
            f"{_pct(e['dropped_fraction'])} dropped stale, mean staleness {_fmt(e['staleness_mean'], '{:.2f}')}; "
            f"engines busy {_pct(e['engine_busy'])}, trainers busy {_pct(e['trainer_busy'])}; "
            f"update latency p95 {_fmt(e['update_latency_s']['p95'], '{:.2f}')} s of a "
            f"{_fmt(e['round_s'], '{:.1f}')} s round"
        )
    t = Table(title="verified versions and digests")
    for col in ("node", "role", "restarts", "version", "digest", "checks"):
        t.add_column(col)
    for name, d in summary["nodes"].items():
        ok = ""
        if d["role"] == "inference":
            ok = "served verified" if d["served_verified"] else "UNVERIFIED" if d["served"] else "served nothing"
            if d["weights_digest"] is None:
                ok += ", own weights not rehashed"
            else:
                ok += ", own weights match" if d["weights_digest"] == d["digest"] else ", OWN WEIGHTS DIFFER"
        t.add_row(name, d["role"], str(d.get("restarts", 0)), _fmt(d["version"]), (d["digest"] or "-")[:16] + "…", ok)
    out.print(t)
    if outcome.store_restarts:
        out.print(f"store restarts: {outcome.store_restarts}")
    checks = summary["checks"]
    out.print("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.1f}x smaller" if b else "n.a."
