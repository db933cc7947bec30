"""What a node tells its operator: ``/healthz``, ``/status`` and ``/metrics`` over HTTP (aiohttp).

One ``NodeState`` is the single source: the daemon updates it as it works, ``/status`` serves it as
JSON and a Prometheus collector reads the same fields at scrape time, so the two views never drift.

Liveness is progress, not a running process: the daemon calls ``state.beat()`` every time its loop
moves (a poll answered, a batch generated, a round closed). ``/healthz`` answers 503 once the last
beat is older than ``stuck_after_s``, so an orchestrator restarts a node whose weight sync hangs
without an error (the failure users report most).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pulsenet.nodes.events import VersionEvent
from pulsenet.store.base import REQUEST_KINDS, ObjectStore

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(slots=True)
class NodeState:
    """Everything ``/status`` shows; the daemon owns it and mutates it in place (one event loop)."""

    role: str
    """"trainer" or "inference"."""
    node_id: str
    version: int | None = None
    """Policy version this node serves (inference) or last published/adopted (trainer)."""
    round: int | None = None
    """PULSELoCo round (trainers)."""
    digest: str | None = None
    """Model digest of ``version``."""
    staleness: int | None = None
    """Trainer: largest ``version - rollout version`` trained on; inference: versions behind the newest."""
    rollouts: dict[str, int] = field(
        default_factory=lambda: {"produced": 0, "consumed": 0, "rejected": 0, "dropped_in_flight": 0, "dropped_queued": 0}
    )
    bytes: dict[str, int] = field(default_factory=lambda: {"pulsesync": 0, "pulseloco": 0, "rollouts": 0})
    """Bytes moved through the store per channel (uploaded plus downloaded)."""
    reward: float | None = None
    """Mean reward of the last batch generated (inference) or trained on (trainer)."""
    errors: int = 0
    last_error: str | None = None
    slowest_consumer: dict[str, Any] | None = None
    """Publisher: the live node furthest behind (id, version, age), which retention keeps a path for."""
    started: float = field(default_factory=time.time)
    last_beat: float = field(default_factory=time.monotonic)

    rejected: dict[str, dict[str, int]] = field(default_factory=dict)
    """Trainer: rollout batches refused (or dropped by a failed step), per inference node and reason
    (the intake's live counters: ``IntakeStats.rejected_by_node``)."""
    rescored: dict[str, Any] = field(default_factory=dict)
    """Trainer: per inference node, the rows it re-scored, the rewards that disagreed with the
    node's column and the rows it dropped (``rl.rescore``): a node whose rewards lie shows at once."""
    loco: Any = None
    """A PULSELoCo trainer's live counters (``loco.progress.LocoStats``: ints and ``{reason: int}``
    dicts): in ``/status``, and ``pulsenet_loco_<field>_total`` in ``/metrics``."""
    replay: Any = None
    """A trainer's replay counters (``rl.replay.ReplayStats``): batches, rows and tokens replayed,
    refusals by reason, unverifiable batches, seconds, the worst margins honest batches showed; in
    ``/status``, and ``pulsenet_replay_<field>`` in ``/metrics``."""
    prompts_dropped: dict[str, int] = field(default_factory=dict)
    """Inference: prompts dropped before generation, per reason (``prompt_too_long``,
    ``context_too_long``: the prompter's live counters, ``rl.prompts.PromptStats.dropped``)."""
    degraded: str | None = None
    """Why the node is degraded though its loop moves (waiting on a peer, a dead channel), or None."""
    last_event: dict[str, Any] | None = None
    """The node's last ``VersionEvent`` (nodes/events.py), as a dict."""
    memory: Any = None
    """What the node holds, by holder, against its budget (a ``nodes.memory.Probe``, called when
    ``/status`` is read: ``nodes.memory.report``); None where the daemon sets none."""

    def beat(self) -> None:
        """The loop made progress."""
        self.last_beat = time.monotonic()

    def record(self, event: VersionEvent) -> None:
        """A version event: what ``/status`` and ``/metrics`` show of versions comes from here."""
        self.version, self.digest = event.version, event.digest
        if event.round is not None:
            self.round = event.round
        if event.reward is not None:
            self.reward = event.reward
        if event.staleness:
            self.staleness = max(event.staleness)
        for channel, n in event.bytes.items():
            if channel in self.bytes:  # bytes moved; the rest (full, diloco, ddp) are comparisons
                self.bytes[channel] += n
        totals = event.totals
        if event.role == "trainer":
            self.rollouts["consumed"] = int(totals.get("rows_accepted", 0))
            self.rollouts["rejected"] = int(totals.get("batches_rejected", 0))
            self.rollouts["dropped_in_flight"] = int(totals.get("stale_in_flight", 0))
            self.rollouts["dropped_queued"] = int(totals.get("stale_queued", 0))
        self.last_event = event.as_dict()
        self.beat()

    def error(self, e: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(e).__name__}: {e}"[:500]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["idle_s"] = round(time.monotonic() - self.last_beat, 3)
        del d["last_beat"]
        d["memory"] = self.memory() if self.memory is not None else None
        return d


class _StateCollector(Collector):
    """Prometheus metrics read from the ``NodeState`` and the node's stores at scrape time."""

    def __init__(self, state: NodeState, stores: Mapping[str, ObjectStore]) -> None:
        self.state, self.stores = state, stores

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s, labels = self.state, ["role", "node"]
        ids = [s.role, s.node_id]

        def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"pulsenet_{name}", doc, labels=labels)
            if value is not None:
                g.add_metric(ids, float(value))
            return g

        yield gauge("policy_version", "Policy version served or published", s.version)
        yield gauge("loco_round", "PULSELoCo round", s.round)
        yield gauge("staleness", "Versions between the policy and the rollouts it trains on", s.staleness)
        yield gauge("reward_mean", "Mean reward of the last batch", s.reward)
        yield gauge("idle_seconds", "Seconds since the loop last made progress", time.monotonic() - s.last_beat)
        if s.memory is not None:
            mem = s.memory()
            yield gauge("memory_peak_rss_bytes", "Peak resident memory of the node's process", mem.get("peak_rss"))
            yield gauge("memory_budget_bytes", "The node's peak memory budget (nodes/memory.py)", mem.get("budget"))
            held = GaugeMetricFamily("pulsenet_memory_held_bytes", "Weight bytes held, by holder", labels=[*labels, "holder"])
            for holder, n in mem["holders"].items():
                held.add_metric([*ids, holder], n)
            yield held
        rollouts = CounterMetricFamily("pulsenet_rollouts", "Rollouts by outcome", labels=[*labels, "outcome"])
        for outcome, n in s.rollouts.items():
            rollouts.add_metric([*ids, outcome], n)
        yield rollouts
        moved = CounterMetricFamily("pulsenet_store_bytes", "Bytes moved through the store", labels=[*labels, "channel"])
        for channel, n in s.bytes.items():
            moved.add_metric([*ids, channel], n)
        yield moved
        errors = CounterMetricFamily("pulsenet_errors", "Errors logged by the node's loop", labels=labels)
        errors.add_metric(ids, s.errors)
        yield errors
        disagree = CounterMetricFamily(
            "pulsenet_reward_disagreements", "Rewards a node claimed that the trainer's own differ from",
            labels=[*labels, "source"],
        )
        for node, stats in s.rescored.items():
            disagree.add_metric([*ids, node], stats.disagreements)
        yield disagree
        if s.loco is not None:
            yield from _counter_metrics(s.loco, "loco_", labels, ids)
        if s.replay is not None:
            yield from _counter_metrics(s.replay, "replay_", labels, ids)
        dropped = CounterMetricFamily(
            "pulsenet_prompts_dropped", "Prompts dropped before generation, by reason", labels=[*labels, "reason"]
        )
        for why, n in s.prompts_dropped.items():
            dropped.add_metric([*ids, why], n)
        yield dropped
        rejected = CounterMetricFamily(
            "pulsenet_rollouts_rejected", "Rollout batches refused, by source node and reason",
            labels=[*labels, "source", "reason"],
        )
        for node, reasons in s.rejected.items():
            for why, n in reasons.items():
                rejected.add_metric([*ids, node, why], n)
        yield rejected
        yield from _store_metrics(self.stores, labels, ids)


def _counter_metrics(counters: Any, prefix: str, labels: list[str], ids: list[str]) -> Iterator[Any]:
    """Every int field of ``counters`` as ``pulsenet_<prefix><field>``; a ``{reason: int}`` field
    with a ``reason`` label; a float (or None) field as a gauge (a duration, a worst value)."""
    for f in fields(counters):
        value = getattr(counters, f.name)
        if value is None or isinstance(value, float):
            gauge = GaugeMetricFamily(f"pulsenet_{prefix}{f.name}", f.name.replace("_", " "), labels=labels)
            if value is not None:
                gauge.add_metric(ids, value)
            yield gauge
            continue
        if isinstance(value, dict):
            family = CounterMetricFamily(f"pulsenet_{prefix}{f.name}", f.name.replace("_", " "), labels=[*labels, "reason"])
            for reason, n in value.items():
                family.add_metric([*ids, reason], n)
        else:
            family = CounterMetricFamily(f"pulsenet_{prefix}{f.name}", f.name.replace("_", " "), labels=labels)
            family.add_metric(ids, value)
        yield family


def _store_metrics(stores: Mapping[str, ObjectStore], labels: list[str], ids: list[str]) -> Iterator[Any]:
    """Requests by the class object stores bill them in, bytes moved, and whether each store answers."""
    requests = CounterMetricFamily(
        "pulsenet_store_requests", "Store requests sent, by kind", labels=[*labels, "store", "kind"]
    )
    moved = CounterMetricFamily(
        "pulsenet_store_transfer_bytes", "Body bytes moved to or from a store", labels=[*labels, "store", "direction"]
    )
    failing = GaugeMetricFamily(
        "pulsenet_store_consecutive_failures", "Failed requests since the store last answered", labels=[*labels, "store"]
    )
    last_ok = GaugeMetricFamily(
        "pulsenet_store_last_ok_timestamp_seconds", "When the store last answered (Unix time)", labels=[*labels, "store"]
    )
    for name, store in stores.items():
        counts, health = store.requests, store.health
        for kind in REQUEST_KINDS:
            requests.add_metric([*ids, name, kind], getattr(counts, kind))
        moved.add_metric([*ids, name, "down"], counts.bytes_down)
        moved.add_metric([*ids, name, "up"], counts.bytes_up)
        failing.add_metric([*ids, name], health.consecutive_failures)
        if health.last_ok is not None:
            last_ok.add_metric([*ids, name], health.last_ok)
    yield from (requests, moved, failing, last_ok)


@dataclass(kw_only=True, slots=True)
class StatusLimits:
    """What clients may hold of a node's status port. Its users are a health probe and a metrics
    scraper; without limits, 1,100 idle connections exhausted the node's file descriptors (its own
    file opens failed and ``/healthz`` timed out)."""

    max_connections: int = 64
    """Open connections at most. Past it, a new connection closes the oldest one not inside a handler
    (idle, or its request head not complete yet); if every one is inside a handler, the new one is
    answered 503 and closed. Either way the node holds at most this many sockets for the port."""
    header_timeout_s: float = 10.0
    """A connection that has not sent a complete request head this long after connecting (or after
    its last response: the keep-alive idle time) is closed. A slow, byte-a-second head is no excuse."""
    handler_timeout_s: float = 10.0
    """A request whose answer takes longer is answered 504."""
    max_line_size: int = 4096
    """Longest request line or header line in bytes; longer is a 400."""
    max_headers: int = 32
    """Most header fields in one request; more is a 400."""

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.header_timeout_s <= 0 or self.handler_timeout_s <= 0:
            raise ValueError("max_connections must be >= 1 and the timeouts > 0")


@dataclass(slots=True)
class ConnectionStats:
    """What the status port's limits did (``StatusServer.connections``)."""

    accepted: int = 0
    evicted: int = 0
    """Idle connections closed to make room for a new one (``max_connections`` reached)."""
    refused: int = 0
    """New connections answered 503 and closed: every open one was inside a handler."""
    header_timeouts: int = 0
    """Connections closed for sending no complete request head within ``header_timeout_s``."""
    open: int = 0


_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _CappedServer(web.Server):
    """aiohttp's low-level server with a cap on open connections (aiohttp has none) and a deadline
    for the first request head.

    ``RequestHandler.connection_made`` reports every new connection here before it reads a byte; a
    connection past the cap frees a slot (the oldest idle one) or is closed at once, so sockets
    never pile up and a fresh probe always gets in. The dispatcher says which connections have sent
    a request (``requested``) and which are inside a handler (``busy``, never evicted). Heads after
    the first are bounded by aiohttp's keep-alive timer (``keepalive_timeout``, armed after each
    response); recent aiohttp also arms it at connect, older did not: the deadline here holds either
    way, and is counted."""

    def __init__(self, handler: Any, *, max_connections: int, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(handler, keepalive_timeout=header_timeout_s, **kwargs)
        self.max_connections, self.header_timeout_s = max_connections, header_timeout_s
        self.open: dict[Any, asyncio.Transport] = {}
        """Open connections, oldest first (dicts keep insertion order)."""
        self.requested: set[Any] = set()
        self.busy: set[Any] = set()
        self.stats = ConnectionStats()
        self._deadlines: dict[Any, asyncio.TimerHandle] = {}

    def connection_made(self, handler: Any, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self.stats.accepted += 1
        if len(self.open) >= self.max_connections:
            victim = next((h for h in self.open if h not in self.busy), None)
            if victim is None:
                self.stats.refused += 1
                transport.write(_BUSY)
                transport.close()  # the 503 is a few bytes into an empty buffer: gone at once
                return
            self.stats.evicted += 1
            self.open.pop(victim).abort()  # idle: nothing in flight to lose; its fd goes now
        self.open[handler] = transport
        self.stats.open = len(self.open)
        loop = asyncio.get_running_loop()
        self._deadlines[handler] = loop.call_later(self.header_timeout_s, self._head_deadline, handler)

    def _head_deadline(self, handler: Any) -> None:
        self._deadlines.pop(handler, None)
        if handler not in self.requested and (transport := self.open.pop(handler, None)) is not None:
            self.stats.header_timeouts += 1
            self.stats.open = len(self.open)
            transport.abort()

    def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self.open.pop(handler, None)
        self.requested.discard(handler)
        self.busy.discard(handler)
        if (deadline := self._deadlines.pop(handler, None)) is not None:
            deadline.cancel()
        self.stats.open = len(self.open)


class StatusServer:
    """``/healthz``, ``/status``, ``/metrics`` for one node, on ``host:port`` (port 0: a free one).

    The default host is 127.0.0.1: the endpoints are unauthenticated, so a node shows them beyond its
    machine only when told to (``status_host``; the compose file binds 0.0.0.0 inside the container
    and publishes the port on the host's 127.0.0.1). ``limits`` bound what clients can hold."""

    def __init__(
        self,
        state: NodeState,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        stuck_after_s: float = 300.0,
        stores: Mapping[str, ObjectStore] | None = None,
        limits: StatusLimits | None = None,
    ) -> None:
        """``stores``: the node's stores by a name of its choosing (``own``, a peer's id): their
        request counters go to ``/metrics``, their health to ``/healthz`` and ``/status``."""
        self.state = state
        self.host, self.port = host, port
        self.stuck_after_s = stuck_after_s
        self.stores = dict(stores or {})
        self.limits = limits or StatusLimits()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StateCollector(state, self.stores))
        self._routes = {"/healthz": self._healthz, "/status": self._status, "/metrics": self._metrics}
        self._server: _CappedServer | None = None
        self._runner: web.ServerRunner | None = None

    @property
    def connections(self) -> ConnectionStats:
        """Connections accepted, evicted, refused and open (zeros before ``start``)."""
        return self._server.stats if self._server is not None else ConnectionStats()

    async def start(self) -> None:
        lim = self.limits
        self._server = _CappedServer(
            self._dispatch,
            max_connections=lim.max_connections,
            header_timeout_s=lim.header_timeout_s,
            handler_cancellation=True,  # a client that hangs up ends its handler
            max_line_size=lim.max_line_size,
            max_field_size=lim.max_line_size,
            max_headers=lim.max_headers,
            lingering_time=0,  # an unread request body is not waited for: the connection closes
            access_log=None,
        )
        self._runner = web.ServerRunner(self._server)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        """Route a request (GET only, no body) to its handler, within ``handler_timeout_s``
        (aiohttp answers the TimeoutError with a 504)."""
        assert self._server is not None
        self._server.requested.add(request.protocol)
        handler = self._routes.get(request.path)
        if handler is None:
            raise web.HTTPNotFound()
        if request.method not in ("GET", "HEAD"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
        if request.body_exists:  # nothing here reads a body: none is accepted (client_max_size 0)
            raise web.HTTPRequestEntityTooLarge(max_size=0, actual_size=request.content_length or 0)
        self._server.busy.add(request.protocol)
        try:
            async with asyncio.timeout(self.limits.handler_timeout_s):
                return await handler(request)
        finally:
            self._server.busy.discard(request.protocol)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> StatusServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def health(self) -> dict[str, Any]:
        """``ok``; ``degraded`` while a store does not answer or the node says it waits on something
        (``NodeState.degraded``); ``stuck`` once the loop made no progress for ``stuck_after_s``."""
        idle = time.monotonic() - self.state.last_beat
        reasons = [f"{name}: {why}" for name, st in self.stores.items() if (why := st.health.degraded())]
        if self.state.degraded:
            reasons.append(self.state.degraded)
        status = "stuck" if idle > self.stuck_after_s else "degraded" if reasons else "ok"
        if status == "stuck":
            reasons.insert(0, f"no progress for {idle:.0f} s (stuck after {self.stuck_after_s:g} s)")
        return {
            "ok": status == "ok",
            "status": status,
            "reasons": reasons,
            "idle_s": round(idle, 3),
            "stuck_after_s": self.stuck_after_s,
        }

    async def _healthz(self, _: web.BaseRequest) -> web.Response:
        body = self.health()
        return web.json_response(body, status=200 if body["ok"] else 503)

    async def _status(self, _: web.BaseRequest) -> web.Response:
        body = self.state.to_json() | {
            "health": self.health(),
            "stores": {n: {"requests": st.requests.as_dict(), "health": st.health.as_dict()} for n, st in self.stores.items()},
            "connections": asdict(self.connections),
        }
        return web.Response(text=json.dumps(body, sort_keys=True, default=str), content_type="application/json")

    async def _metrics(self, _: web.BaseRequest) -> web.Response:
        data = await asyncio.to_thread(generate_latest, self.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE})
