"""``pulsenet up``'s embedded store, as the supervisor keeps it: restarted on the same directory,
ports and keys when it exits (with the nodes' backoff and crash-loop rule, ``Restarts``), its state
in one word for the live table, and what an injector (``pulsenet chaos``) may do to it.

An external endpoint (``--endpoint``) is nobody's to restart: every method is then a no-op or says
there is nothing to act on."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pulsenet.errors import PulsenetError, StoreError
from pulsenet.nodes.supervisor import Exit, Journal, Restarts, SuperviseConfig, describe_exit

if TYPE_CHECKING:
    from pulsenet.store.s3 import S3Config
    from pulsenet.store.seaweed import SeaweedServer

log = logging.getLogger(__name__)


class EmbeddedStore:
    """The ``SeaweedServer`` a run started (None: an external endpoint) and its restarts."""

    def __init__(
        self, server: SeaweedServer | None, policy: SuperviseConfig, journal: Journal, say: Callable[[str], None]
    ) -> None:
        self._server, self.policy, self.journal, self.say = server, policy, journal, say
        self.restarts = Restarts()
        self._rng = random.Random()
        self._restart_task: asyncio.Task[None] | None = None
        self._failure = ""
        """Why the last restart failed, for the exit it then counts as."""

    @property
    def embedded(self) -> bool:
        return self._server is not None

    # --- kept alive ---------------------------------------------------------------------------

    def watch(self, now: float) -> str:
        """Restart the store when it has exited, after the policy's backoff; a reason to end the
        run when it crash-loops, else ""."""
        s = self._server
        if s is None or self._restart_task is not None or s.running:
            return ""
        r = self.restarts
        if r.due is None:
            code = s.exit_code
            why = self._failure or (describe_exit(code) if code is not None else "not running")
            self._failure = ""
            delay = r.exited(Exit(time.time(), code, why, _weed_error(s)), now, self.policy, self._rng)
            self.journal.write("store_exit", code=code, why=why, restart_in_s=delay)
            if delay is None:
                reason = r.crash_loop("the store", self.policy)
                self.journal.write("crash_loop", node="store", reason=reason)
                return reason
            self.say(f"the store {why}; restart in {delay:.1f} s")
        elif now >= r.due:
            self._restart_task = asyncio.create_task(self._restart(s))
        return ""

    async def _restart(self, server: SeaweedServer) -> None:
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(server.restart)
        except PulsenetError as e:  # did not come up: counted as one more exit, retried after a backoff
            self.restarts.restarted(time.monotonic())
            self._failure = f"restart failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            log.error("store restart failed: %s", e)
        else:
            self.restarts.restarted(time.monotonic())
            self.journal.write("store_restart", count=self.restarts.count, took_s=round(time.monotonic() - t0, 2))
            self.say(f"the store is back (restart {self.restarts.count}, {time.monotonic() - t0:.1f} s)")
        finally:
            self._restart_task = None

    async def settle(self) -> None:
        """Let a restart in flight finish (bounded by the server's start-up timeout): at teardown."""
        if self._restart_task is not None:
            await self._restart_task

    def state(self) -> str:
        """Why the store does not serve ("" while it does, or when it is an external endpoint)."""
        s = self._server
        if s is None or (s.running and self._restart_task is None):
            return ""
        if self._restart_task is not None:
            return "restarting"
        return f"down ({self.restarts.exits[-1].why if self.restarts.exits else 'down'})"

    # --- what an injector may do (pulsenet chaos) ---------------------------------------------

    def pid(self) -> int | None:
        """The embedded store's process id while it runs; None when it does not, or for an external endpoint."""
        s = self._server
        return s.pid if s is not None and s.running else None

    def exited(self) -> bool:
        """The embedded store's process has exited (and is not yet restarted); False for an external endpoint."""
        return self._server is not None and not self._server.running

    async def kill(self) -> int:
        """SIGKILL the embedded store (``watch`` then restarts it); returns its pid (StoreError: none running)."""
        pid = self.pid()
        if self._server is None or pid is None:
            raise StoreError("up: no embedded store running to kill")
        await asyncio.to_thread(self._server.kill)
        return pid

    def pause(self) -> None:
        """SIGSTOP the embedded store: every connection to it hangs until ``resume`` (StoreError: none)."""
        if self._server is None:
            raise StoreError("up: no embedded store to pause (an external endpoint)")
        self._server.pause()

    def resume(self) -> None:
        """SIGCONT the embedded store (a no-op for an external endpoint)."""
        if self._server is not None:
            self._server.resume()

    def admin_config(self) -> S3Config | None:
        """The embedded store's admin credentials (reads and lists every bucket); None for an external endpoint."""
        return self._server.config("admin") if self._server is not None else None


def _weed_error(server: SeaweedServer) -> str:
    """The store's last error line (its log's E/F records), "" if none."""
    lines = [x for x in server.log_tail(50).splitlines() if x[:1] in ("E", "F") and x[1:5].isdigit()]
    return lines[-1][:300] if lines else ""
