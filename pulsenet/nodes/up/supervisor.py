"""``pulsenet up``'s ``Supervisor``: the processes and the loop. It starts the nodes, restarts
what exits unexpectedly (and the embedded store), reports a network that makes no version, and
stops everything when the run is over.

Every decision is a plain function over plain records in ``nodes/supervisor.py`` (``Restarts``,
``Liveness``, ``holdup``, ``last_error``, ``end_of_run``), tested without processes; this module
holds what those decisions act on. What it does is written to ``state/supervisor.jsonl``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import subprocess
import time
from typing import TYPE_CHECKING, Any, Protocol

from rich.markup import escape

from pulsenet.logs import suppressed
from pulsenet.nodes.events import read_events
from pulsenet.nodes.supervisor import (
    Exit,
    Journal,
    Liveness,
    RunView,
    TrainerView,
    describe_exit,
    end_of_run,
    holdup,
    last_error,
    with_inference,
)
from pulsenet.nodes.up.console import line_key, status_line, status_table
from pulsenet.nodes.up.node import Node, Outcome, node_version, serving_version
from pulsenet.nodes.up.store import EmbeddedStore
from pulsenet.runtime import signal_group, spawn_tied, wait

if TYPE_CHECKING:
    from pulsenet.nodes.config import InferenceConfig, TrainerConfig
    from pulsenet.nodes.up.config import UpConfig
    from pulsenet.store.seaweed import SeaweedServer

log = logging.getLogger(__name__)


class Injector(Protocol):
    """What ``pulsenet chaos`` (pulsenet/chaos) hooks into a run; the launcher calls, in order:

    ``adjust`` on the planned node settings (before they are written: it returns the settings to
    write, new objects, and leaves the planned ones as they are), ``endpoint`` per node (the store
    URL it is given: a link the injector can throttle or cut), ``start`` before any node starts,
    ``run`` beside the supervisor's loop (cancelled when the run ends; an exception fails the run),
    and ``after`` once every node has stopped while the store still runs.

    An injector acts on the run only through the ``Supervisor``'s ``kill`` and its ``store``
    (``nodes/up/store.py``: ``kill``, ``pause``, ``resume``, ``pid``, ``admin_config``)."""

    def adjust(
        self, trainers: list[TrainerConfig], inference: list[InferenceConfig]
    ) -> tuple[list[TrainerConfig], list[InferenceConfig]]: ...

    def endpoint(self, node: str, url: str) -> str: ...

    async def start(self, sup: Supervisor) -> None: ...

    async def run(self, sup: Supervisor) -> None: ...

    async def after(self, sup: Supervisor) -> None: ...


class Supervisor:
    """Starts the nodes, restarts what exits unexpectedly (and the embedded store), reports a network
    that makes no version, ends the run when ``end_of_run`` says so, and stops everything.

    The decisions are ``nodes/supervisor.py``'s; this class holds the processes and the loop. What
    it does is written to ``journal`` (``state/supervisor.jsonl``) as it happens."""

    def __init__(
        self,
        c: UpConfig,
        nodes: list[Node],
        console: Any,
        *,
        server: SeaweedServer | None = None,
        journal: Journal | None = None,
        injector: Injector | None = None,
        round_deadline_s: float = 300.0,
    ) -> None:
        """``server``: the embedded ``SeaweedServer`` to watch and restart (None: an external endpoint)."""
        self.c, self.nodes, self.console = c, nodes, console
        self.injector = injector
        self.journal = journal or Journal(None)
        self.round_deadline_s = round_deadline_s
        self.policy = c.supervise
        self.store = EmbeddedStore(server, self.policy, self.journal, self.say)
        """The embedded store (or none: an external endpoint), restarted when it exits."""
        self.stop = asyncio.Event()
        self.reason = ""
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
            with suppressed(log, "up: teardown: the store restart in flight"):
                await self.store.settle()
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
        return Outcome(code, self.reason, self.nodes, events, time.perf_counter() - t0, self.store.restarts.count)

    def _interrupt(self, sig: signal.Signals) -> None:
        self.reason = f"stopped by {signal.Signals(sig).name}"
        self.stop.set()

    async def _watch(self, http: Any, chaos: asyncio.Task[None] | None) -> int:
        """Poll until ``end_of_run`` says the run is over (the trainers done and the inference nodes
        serving their last version, or a failure, a stop, the timeout); returns the exit code."""
        from rich.live import Live

        c = self.c
        deadline = time.monotonic() + c.timeout_s
        serve_deadline: float | None = None
        trainers = [n for n in self.nodes if n.role == "trainer"]
        live = Live(self._table(), console=self.console, refresh_per_second=2, transient=False) if c.live else None
        last_line = None
        with live if live is not None else contextlib.nullcontext():
            while True:
                await asyncio.gather(*(self._poll(http, n) for n in self.nodes if n.running))
                now = time.monotonic()
                for n in self.nodes:
                    n.tail.read()
                failure = self.store.watch(now) or self._handle_exits(now)
                if not failure:  # a crash loop ends the run before anything is started again
                    self._start_due(now)
                    self._liveness()
                    self._progress(now)
                    self._tick.set()
                    self._tick = asyncio.Event()
                    if live is not None:
                        live.update(self._table())
                    elif (key := line_key(self.version, self.holdup, self.nodes)) != last_line:
                        last_line = key
                        self.console.print(status_line(self.nodes, self.holdup), soft_wrap=True)
                    if self.final is None and all(n.done for n in trainers) and not self.stop.is_set():
                        self.final = max((node_version(n) for n in trainers), default=-1)
                        serve_deadline = now + c.serve_timeout_s
                        self.say(f"trainers done at v{self.final}; waiting for the inference nodes to serve it")
                end = end_of_run(self._view(failure, chaos, serve_deadline, deadline), now)
                if end is not None:
                    self.reason = end.reason
                    return end.code
                await wait(self.stop, c.poll_s)

    def _view(self, failure: str, chaos: asyncio.Task[None] | None, serve_deadline: float | None, deadline: float) -> RunView:
        """This poll as ``end_of_run`` reads it."""
        error = ""
        if chaos is not None and chaos.done() and not chaos.cancelled() and (e := chaos.exception()) is not None:
            error = f"{type(e).__name__}: {e}"
        return RunView(
            failure=failure,
            stopped=self.stop.is_set(),
            stop_reason=self.reason,
            injector_error=error,
            final=self.final,
            serving=tuple((n.name, serving_version(n)) for n in self.nodes if n.role == "inference"),
            serve_deadline=serve_deadline,
            serve_timeout_s=self.c.serve_timeout_s,
            deadline=deadline,
            timeout_s=self.c.timeout_s,
            holdup=self.holdup,
        )

    def _table(self) -> Any:
        """The live table, fitted to the console's width."""
        return status_table(self.nodes, self.network_state(), self.console.width)

    async def ticked(self, timeout: float | None = None) -> None:
        """Return after the supervisor's next poll (what waiters on progress or restarts use)."""
        async with asyncio.timeout(timeout):
            await self._tick.wait()

    def say(self, msg: str) -> None:
        """Log ``msg`` and print it under the table."""
        log.info("%s", msg)
        # escaped: msg quotes nodes' errors, text a peer can choose ("[/x]" would raise MarkupError)
        self.console.print(f"[bold]pulsenet up[/]: {escape(msg)}", soft_wrap=True)

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

    # --- what an injector may do (pulsenet chaos) ---------------------------------------------

    def kill(self, name: str) -> int:
        """SIGKILL the current life of node ``name`` (its process group); returns its pid. The
        supervisor then sees an unexpected exit and restarts it as it would any other
        (ValueError: no such node, or it is not running)."""
        n = next((n for n in self.nodes if n.name == name), None)
        if n is None or n.proc is None or not n.running:
            raise ValueError(f"up: no running node {name!r} to kill")
        signal_group(n.proc, signal.SIGKILL)
        return n.proc.pid

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
        self.holdup = with_inference(holdup(self.trainer_views(), self.store.state()), self.inference_views())
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
        if self.store.embedded:
            restarts = self.store.restarts.count
            line += f"; store {self.store.state() or 'ok'}" + (f", {restarts} restart(s)" if restarts else "")
        return line

