"""The seeded fault schedule of ``pulsenet chaos``, injected into a running ``pulsenet up`` network.

``Chaos`` is the launcher's ``Injector`` (nodes/up/supervisor.py): the network is the launcher's own, run
by its ``Supervisor`` (restarts, store restarts, stuck reports); this module only adds faults and
watches. Faults are drawn from ``chaos_seed`` (which kinds, which nodes, when within a version) and
injected one at a time, each once the network is whole again and has made ``settle_versions`` more
versions since the last fault's recovery:

- ``kill-trainer``, ``kill-inference``, ``kill-node`` (any node): SIGKILL of the node's process at a
  seeded point within a version interval (the median of the last few), so kills land at random
  phases of a round (waiting for rollouts, the GRPO steps, the exchange, a publish, an apply). The
  point is a time, not an instrumented phase: each record says how far into the version it was;
- ``kill-store``: SIGKILL of the embedded SeaweedFS (the supervisor restarts it on the same
  directory, ports and keys);
- ``stall-store``: SIGSTOP of the store for ``stall_s``, then SIGCONT: every connection hangs;
- ``cut-link``, ``throttle-link``: one node's link to the store (``chaos/link.py``: a relay in the
  launcher between that node and the store) stops moving bytes, or is paced to
  ``throttle_mbps``, for ``link_s``.

Besides the faults, ``hostile`` makes inference nodes cheat (nodes/hostile.py, one behaviour each:
``--hostile i1=best-of-n``); the audit then checks that the trainers refused their batches (by replay or at intake).

After each fault the schedule waits for the recovery: every node running and past the version the
network had when the fault hit (trainers published a newer one, inference nodes serve one in their
current life), or at the run's final version. The time from the fault's end to that moment is its
recovery time. A sampler reads each node's (and the store's) RSS and open descriptors from
``/proc`` every ``sample_s``. After the run, with every node stopped and the store still up, the
store is listed for the checker (``chaos/check.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pulsenet.chaos.link import LinkProxy
from pulsenet.errors import ConfigError
from pulsenet.nodes.hostile import HostileConfig
from pulsenet.nodes.up import UpConfig
from pulsenet.nodes.up.node import Node, node_version, serving_version
from pulsenet.nodes.up.supervisor import Supervisor

if TYPE_CHECKING:
    from pulsenet.nodes.config import InferenceConfig, TrainerConfig

log = logging.getLogger(__name__)

KINDS = ("kill-trainer", "kill-inference", "kill-node", "kill-store", "stall-store", "cut-link", "throttle-link")
STORE_KINDS = ("kill-store", "stall-store")
LINK_KINDS = ("cut-link", "throttle-link")


@dataclass(kw_only=True)
class ChaosConfig(UpConfig):
    """A local network under a seeded fault schedule, then an audit of its records. Settings: the
    [chaos] table of --config FILE, then PULSENET_<FIELD>, then --field (every ``pulsenet up``
    setting too)."""

    chaos_seed: int = 1
    """Seeds the schedule: which faults, which nodes, when within a version."""
    faults: list[str] = field(default_factory=list)
    """Faults in this order (kill-trainer, kill-inference, kill-node, kill-store, stall-store,
    cut-link, throttle-link); empty: `count` faults drawn from `kinds`."""
    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    """Kinds a drawn schedule picks from."""
    count: int = 6
    """Faults in a drawn schedule."""
    stall_s: float = 20.0
    """How long a stall-store keeps the store stopped (SIGSTOP)."""
    link_s: float = 30.0
    """How long a cut-link or throttle-link lasts."""
    throttle_mbps: float = 0.2
    """A throttled link's speed each way."""
    settle_versions: int = 1
    """Versions the network makes after recovering from a fault before the next one."""
    recover_timeout_s: float = 600.0
    """A fault the network has not recovered from within this fails the verdict (the schedule then goes on)."""
    end_margin: int = 2
    """No fault is injected once the network is this close to its last version (it must finish whole)."""
    sample_s: float = 5.0
    """Interval of the /proc samples (RSS, open descriptors) of every node and the store."""
    out: Path = Path("chaos.json")
    """The verdict and every figure, as JSON."""
    anchor_every: int = 10
    """The trainers' PULSESync anchor interval in a chaos run, so retention (keep_anchors) bounds each
    policy channel (0: the plan's, one anchor per run)."""
    retain_rounds: int = 20
    """PULSELoCo round objects each trainer keeps (0: all), so retention bounds the shared bucket."""
    rss_slope_mb_per_min: float = 4.0
    """A node life of at least resource_min_life_s whose RSS grows faster than this fails the verdict."""
    fd_growth: int = 16
    """... or whose open descriptors grow by more than this from start to end."""
    resource_min_life_s: float = 600.0
    """Lives shorter than this are reported, not judged (start-up and warm-up dominate them)."""
    hostile: list[str] = field(default_factory=list)
    """Inference nodes that cheat, as NODE=BEHAVIOUR (nodes/hostile.py: chosen, best-of-n,
    scaled-logprobs, wrong-temperature, stale, perturbed, copy, withhold; issue 38's better-half,
    aliases, copies, cut-groups, prefix-cut, repeat, reward-one; knobs as ``stale:lag=3``), e.g.
    ``--hostile i1=best-of-n``. The audit's ``hostile`` check: the trainers refused each one's
    batches (by replay, or at intake for a lie), and no honest node's."""

    def __post_init__(self) -> None:
        bad = sorted({*self.faults, *self.kinds} - set(KINDS))
        if bad:
            raise ConfigError(f"chaos: unknown fault kinds {bad}; known: {', '.join(KINDS)}")
        if not self.faults and (self.count < 0 or not self.kinds):
            raise ConfigError("chaos: give --faults, or --count >= 0 and --kinds")
        if self.stall_s < 0 or self.link_s < 0 or not self.throttle_mbps > 0 or self.sample_s <= 0:
            raise ConfigError("chaos: stall_s, link_s >= 0, throttle_mbps > 0 and sample_s > 0")
        hostile_nodes(self)


def hostile_nodes(c: ChaosConfig) -> dict[str, HostileConfig]:
    """``c.hostile`` by node (ConfigError: not NODE=BEHAVIOUR, a node not in the network, or no honest
    inference node left to feed the trainers)."""
    out = {}
    nodes = [f"i{k}" for k in range(c.inference)]
    for item in c.hostile:
        node, eq, spec = item.partition("=")
        if not eq or node not in nodes:
            raise ConfigError(f"chaos: --hostile {item!r} is not NODE=BEHAVIOUR with NODE one of {nodes}")
        out[node] = HostileConfig.parse(spec)
    if out and len(out) == len(nodes):
        raise ConfigError("chaos: every inference node is hostile: leave one honest, or the trainers get nothing to train on")
    return out


@dataclass(slots=True)
class Fault:
    """One planned fault."""

    kind: str
    target: str
    """The node, or ``store``."""
    frac: float
    """Where within a version interval it lands (0..1)."""
    duration_s: float = 0.0
    mbps: float | None = None


def plan_faults(c: ChaosConfig, trainers: list[str], inference: list[str]) -> list[Fault]:
    """The schedule: ``c.faults`` in order, or ``c.count`` kinds drawn from ``c.kinds``; targets and
    timing drawn from ``c.chaos_seed`` (the same seed and network give the same schedule)."""
    rng = random.Random(c.chaos_seed)
    kinds = list(c.faults) or [rng.choice(c.kinds) for _ in range(c.count)]
    out = []
    for kind in kinds:
        frac = rng.random()
        if kind in STORE_KINDS:
            out.append(Fault(kind, "store", frac, c.stall_s if kind == "stall-store" else 0.0))
            continue
        pool = trainers if kind == "kill-trainer" else inference if kind == "kill-inference" else trainers + inference
        target = rng.choice(pool)
        if kind in LINK_KINDS:
            out.append(Fault(kind, target, frac, c.link_s, c.throttle_mbps if kind == "throttle-link" else None))
        else:
            out.append(Fault(kind, target, frac))
    return out


@dataclass
class Sample:
    """One /proc reading of one process."""

    t: float
    """Seconds since the run started."""
    node: str
    pid: int
    rss_mb: float
    fds: int


class Chaos:
    """The launcher's ``Injector``: the schedule, the links, the sampler, and the store listing after."""

    def __init__(self, c: ChaosConfig) -> None:
        self.c = c
        trainers = [f"t{k}" for k in range(c.trainers)]
        inference = [f"i{k}" for k in range(c.inference)]
        self.schedule = plan_faults(c, trainers, inference)
        self.links: dict[str, LinkProxy] = {}
        self.records: list[dict[str, Any]] = []
        """One per planned fault: what was injected when, the version then, its recovery."""
        self.samples: list[Sample] = []
        self.listing: dict[str, list[tuple[str, int]]] = {}
        """Store URL -> (key relative to it, size) of every object left after the run."""
        self.stores: dict[str, str] = {}
        """Node (and ``loco``) -> its store URL, from the planned settings."""
        self.t0 = time.monotonic()
        self._paused = False
        if c.s3_endpoint and any(f.kind in STORE_KINDS for f in self.schedule):
            raise ConfigError("chaos: store faults need the embedded store (no --s3-endpoint)")

    # --- the launcher's hooks -------------------------------------------------------------------

    def adjust(
        self, trainers: list[TrainerConfig], inference: list[InferenceConfig]
    ) -> tuple[list[TrainerConfig], list[InferenceConfig]]:
        """The settings to write: retention on, so the audit can hold the store to it, and the
        hostile behaviours; shallow copies (``dataclasses.replace``: the planned settings' own fields
        are never assigned, nested tables they did not change are shared). Remembers every
        node's store."""
        new_t = []
        for t in trainers:
            changes: dict[str, Any] = {}
            if self.c.anchor_every:
                changes["publish"] = replace(t.publish, anchor_every=self.c.anchor_every)
            if self.c.retain_rounds and t.loco_store:
                changes["loco"] = replace(t.loco, retain_rounds=self.c.retain_rounds)
            new_t.append(replace(t, **changes) if changes else t)
            self.stores[t.id] = t.store
            if t.loco_store:
                self.stores["loco"] = t.loco_store
        hostile_nodes(self.c)  # checked at config time; the raw spec is the node's setting
        hostile = dict(item.split("=", 1) for item in self.c.hostile)
        new_i = []
        for i in inference:
            self.stores[i.id] = i.store
            new_i.append(replace(i, hostile=hostile[i.id]) if i.id in hostile else i)
        return new_t, new_i

    def endpoint(self, node: str, url: str) -> str:
        """A relay for each node a link fault targets; the others talk to the store directly."""
        if not any(f.kind in LINK_KINDS and f.target == node for f in self.schedule):
            return url
        self.links[node] = LinkProxy(url)
        return self.links[node].url

    async def start(self, sup: Supervisor) -> None:
        self.t0 = time.monotonic()
        for link in self.links.values():
            await link.start()

    async def run(self, sup: Supervisor) -> None:
        sampler = asyncio.create_task(self._sample(sup))
        try:
            since = 0  # the first fault once versions come at their pace (v1)
            for k, fault in enumerate(self.schedule):
                record = {"index": k, **asdict(fault), "injected": False}
                self.records.append(record)
                settled = since + self.c.settle_versions
                ready = await self._until(
                    sup, lambda s=settled: _whole(sup) and sup.version >= s, self.c.recover_timeout_s
                )
                if self._near_end(sup):
                    record["skipped"] = f"the network is within {self.c.end_margin} versions of its end"
                    continue
                if not ready:
                    record["skipped"] = "the network was not whole again in time"
                    continue
                await asyncio.sleep(fault.frac * _interval(sup))
                await self._inject(sup, fault, record)
                if not record["injected"]:  # the target went away on its own meanwhile
                    sup.journal.write("fault_skipped", index=k, fault=fault.kind, why=record["skipped"])
                    continue
                sup.journal.write("fault", **{("fault" if k == "kind" else k): v for k, v in record.items()})
                sup.say(f"chaos: {fault.kind} {fault.target} at v{record['version']}")
                at, restarted = int(record["version"]), self._restarted(sup, fault)
                recovered = await self._until(
                    sup, lambda v=at, r=restarted: r() and _past(sup, v), self.c.recover_timeout_s
                )
                if recovered:
                    record["recovered_at_s"] = self._now()
                    record["recovery_s"] = round(record["recovered_at_s"] - record["end_s"], 2)
                    sup.journal.write("recovered", index=k, fault=fault.kind, recovery_s=record["recovery_s"])
                    sup.say(f"chaos: recovered from {fault.kind} {fault.target} in {record['recovery_s']:.1f} s")
                else:
                    record["recovery_s"] = None
                    sup.journal.write("not_recovered", index=k, fault=fault.kind)
                since = sup.version
            sup.say("chaos: schedule done")
            await asyncio.Event().wait()  # keep sampling until the run ends (cancelled then)
        finally:
            self._undo(sup)
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler

    async def after(self, sup: Supervisor) -> None:
        """Every node has stopped, the store still runs: list what the run left in it."""
        for link in self.links.values():
            await link.close()
        self._undo(sup)
        if sup.store.exited():
            return  # it died at the very end: nothing to list (the audit says so)
        self.listing = await asyncio.to_thread(self._list, sup)

    # --- faults --------------------------------------------------------------------------------

    def _restarted(self, sup: Supervisor, f: Fault) -> Any:
        """For a kill: a test that the supervisor has noticed it and started a new life (of the node,
        or of the store) since; other faults end no process."""
        if f.kind == "kill-store":
            before = sup.store.restarts.count
            return lambda: sup.store.restarts.count > before
        if f.kind.startswith("kill-"):
            node = _node(sup, f.target)
            lives = len(node.pids)
            return lambda: len(node.pids) > lives
        return lambda: True

    async def _inject(self, sup: Supervisor, f: Fault, record: dict[str, Any]) -> None:
        for n in sup.nodes:  # the network's version as of now, not as of the last poll
            n.tail.read()
        now_v = max((node_version(n) for n in sup.nodes if n.role == "trainer"), default=-1)
        record |= {"injected": True, "version": max(sup.version, now_v), "at_s": self._now()}
        if f.kind.startswith("kill-") and f.target != "store":
            node = _node(sup, f.target)
            if not await self._until(sup, lambda: node.running, self.c.recover_timeout_s):
                raise RuntimeError(f"chaos: {node.name} did not come back to be killed")
            last = node.tail.last()
            record["into_version_s"] = round(time.time() - last.at, 2) if last is not None else None
            record["pid"] = sup.kill(node.name)
        elif f.kind == "kill-store":
            if sup.store.pid() is None:  # it went down on its own since the network was whole
                record |= {"injected": False, "skipped": "the store was already down"}
                return
            record["pid"] = await sup.store.kill()
        elif f.kind == "stall-store":
            sup.store.pause()
            self._paused = True
            try:
                await asyncio.sleep(f.duration_s)
            finally:
                sup.store.resume()
                self._paused = False
        elif f.kind in LINK_KINDS:
            link = self.links[f.target]
            if f.kind == "cut-link":
                link.cut()
            else:
                assert f.mbps is not None
                link.throttle(f.mbps)
            try:
                await asyncio.sleep(f.duration_s)
            finally:
                link.restore()
        record["end_s"] = self._now()

    def _undo(self, sup: Supervisor) -> None:
        """Whatever a cancelled fault left behind: a paused store, a cut or slow link."""
        if self._paused:
            sup.store.resume()
            self._paused = False
        for link in self.links.values():
            link.restore()

    def _near_end(self, sup: Supervisor) -> bool:
        return sup.final is not None or sup.version >= self.c.rounds - self.c.end_margin

    async def _until(self, sup: Supervisor, cond: Any, timeout: float) -> bool:
        """Wait (poll by poll) until ``cond()``; False once ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                return False
            with contextlib.suppress(TimeoutError):
                await sup.ticked(timeout=max(1.0, 4 * sup.c.poll_s))
        return True

    def _now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    # --- measurements --------------------------------------------------------------------------

    async def _sample(self, sup: Supervisor) -> None:
        while True:
            procs: list[tuple[str, int]] = [(n.name, n.proc.pid) for n in sup.nodes if n.running and n.proc is not None]
            if (store_pid := sup.store.pid()) is not None:
                procs.append(("store", store_pid))
            procs.append(("up", os.getpid()))
            t = self._now()
            for name, pid in procs:
                got = proc_sample(pid)
                if got is not None:
                    self.samples.append(Sample(t, name, pid, *got))
            await asyncio.sleep(self.c.sample_s)

    def _list(self, sup: Supervisor) -> dict[str, list[tuple[str, int]]]:
        """Every object under each store URL of the run (admin credentials of the embedded store,
        or the environment's for --s3-endpoint)."""
        import boto3

        if (cfg := sup.store.admin_config()) is not None:
            client = boto3.client(
                "s3",
                endpoint_url=cfg.endpoint_url,
                aws_access_key_id=cfg.access_key_id,
                aws_secret_access_key=cfg.secret_access_key,
                region_name=cfg.region,
            )
        else:
            client = boto3.client("s3", endpoint_url=self.c.s3_endpoint)
        out: dict[str, list[tuple[str, int]]] = {}
        for url in sorted(set(self.stores.values())):
            bucket, _, prefix = url.removeprefix("s3://").partition("/")
            keys = []
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/" if prefix else ""):
                for o in page.get("Contents", []):
                    keys.append((o["Key"][len(prefix) + 1 :] if prefix else o["Key"], int(o["Size"])))
            out[url] = keys
        return out


def proc_sample(pid: int) -> tuple[float, int] | None:
    """(RSS in MB, open file descriptors) of a live process from /proc; None once it is gone or exiting."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)
    if rss is None:  # a zombie, exiting: no memory to speak of, and not the life's figure
        return None
    return rss / 1024, fds


def _node(sup: Supervisor, name: str) -> Node:
    return next(n for n in sup.nodes if n.name == name)


def _whole(sup: Supervisor) -> bool:
    """Every node is running (or a trainer done) and answers, and the store serves."""
    nodes = all(n.done or (n.running and n.answered) for n in sup.nodes)
    return nodes and not sup.store.state()


def _past(sup: Supervisor, version: int) -> bool:
    """Every node has moved past ``version`` (or reached the run's final version) in its current
    life: a trainer published a newer version since it (re)started, an inference node serves one."""
    target = version + 1 if sup.final is None else min(version + 1, sup.final)
    for n in sup.nodes:
        if n.role == "trainer":
            if not n.done and (not n.running or _life_published(n) < target):
                return False
        elif serving_version(n) < target:
            return False
    return _whole(sup)


def _life_published(n: Node) -> int:
    """The newest version a trainer published in its current life (-1: none yet)."""
    return max((e.version for e in n.tail.events[n.life_from :] if e.kind == "published"), default=-1)


def _interval(sup: Supervisor) -> float:
    """Median seconds between the network's last few versions (5 s before there are any)."""
    times = [t for _, t in sup.versions[-6:]]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.median(gaps) if gaps else 5.0
