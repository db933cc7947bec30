"""Where a PULSELoCo trainer keeps what it must not lose: its resume point and the run's shared states.

Three copies, each for a different failure (docs/loco.md, "Persistence"):

- the local resume point (``state_dir/state.pt``, written atomically after every round): a restart
  on the same disk resumes exactly where it stopped (:func:`save_local`);
- the trainer's own checkpoint in the store every ``checkpoint_every`` rounds: a restart on a fresh
  disk (:func:`snapshot` takes a private copy now, :func:`upload_checkpoint` uploads it later);
- the agreed global state every ``state_every`` rounds, by one writer: catch-up and repair start
  from it (:func:`publish_state`); :func:`retain` prunes what is older than ``retention`` rounds.

:func:`load_resume_point` picks the newest of the first two. The uploads run in the trainer's
:class:`Background` and retry until they land (``retry``: ``LocoTrainer._retry``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path

from pulsenet.errors import PulsenetError, VerificationError
from pulsenet.loco.documents import RoundStore
from pulsenet.loco.inner import InnerLoop
from pulsenet.loco.progress import Retry
from pulsenet.loco.state import GlobalState, TrainerState
from pulsenet.runtime import first_error

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"


async def save_local(state_dir: Path | None, current: Callable[[], TrainerState]) -> Path | None:
    """Write ``current()`` atomically as the local resume point; its path (None without a state dir)."""
    if state_dir is None:
        return None
    path = state_dir / STATE_FILE
    await asyncio.to_thread(lambda: current().save(path))
    return path


async def load_resume_point(
    inner: InnerLoop, state_dir: Path | None, rs: RoundStore, retry: Retry
) -> TrainerState | None:
    """The newest resume point (local file or our own store checkpoint), loaded into ``inner``;
    None if there is none. VerificationError if it does not fit the model."""
    candidates: list[TrainerState] = []
    shapes = {n: tuple(p.shape) for n, p in (await asyncio.to_thread(inner.parameters)).items()}
    if state_dir is not None and (state_dir / STATE_FILE).exists():
        candidates.append(await asyncio.to_thread(TrainerState.load, state_dir / STATE_FILE, shapes))
    remote = await retry(rs.latest_checkpoint, "listing our checkpoints")
    if remote is not None and (not candidates or remote[0] > candidates[0].global_.round):
        with tempfile.TemporaryDirectory(prefix="pulseloco-ckpt-", dir=rs.scratch_dir) as tmp:
            path = Path(tmp) / STATE_FILE
            await retry(lambda: rs.fetch_checkpoint(remote[1], path), "fetching our checkpoint")
            candidates.append(await asyncio.to_thread(TrainerState.load, path, shapes))
    if not candidates:
        return None
    ts = max(candidates, key=lambda s: s.global_.round)
    try:
        # In threads: a data-parallel site's inner loop broadcasts both to its other ranks.
        await asyncio.to_thread(inner.load_state_fp32, ts.global_.theta)
        await asyncio.to_thread(inner.restore, ts.inner)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:  # torch says no more
        raise VerificationError(f"resume point of round {ts.global_.round} does not fit: {e}") from e
    log.warning("%s: resumed from round %d", rs.id, ts.global_.round)
    return ts


async def snapshot(path: Path | None, current: Callable[[], TrainerState], scratch: Path | None = None) -> Path:
    """A private copy of the resume point, taken now (the next round mutates the live state), in
    ``scratch`` (None: the system's temporary directory)."""
    snap = Path(tempfile.mkdtemp(prefix="pulseloco-ckpt-", dir=scratch)) / STATE_FILE
    if path is None:  # no local state dir: the store copy is the only resume point
        await asyncio.to_thread(lambda: current().save(snap))
    else:
        try:
            os.link(path, snap)  # the inode stays ours even after the next round replaces path
        except OSError:
            await asyncio.to_thread(shutil.copyfile, path, snap)
    return snap


def writes_state(digests: Mapping[str, str], who: str, digest: str) -> bool:
    """Whether ``who`` (holding ``digest``) writes this round's global state: one writer per round,
    the lowest-id trainer holding the majority digest (``digests``: the participants' that count,
    all of them seen; {} if not, and nobody writes)."""
    holders = sorted(t for t, d in digests.items() if d == digest)
    return bool(holders) and holders[0] == who and 2 * len(holders) > len(digests)


async def upload_checkpoint(rs: RoundStore, r: int, snap: Path, retry: Retry) -> None:
    """Upload a :func:`snapshot` as our checkpoint of round r, then remove it."""
    try:
        await retry(lambda: rs.publish_checkpoint(r, snap), f"uploading our checkpoint of round {r}")
    finally:
        shutil.rmtree(snap.parent, ignore_errors=True)


async def publish_state(rs: RoundStore, state: GlobalState, digest: str, retry: Retry) -> None:
    """Publish the agreed global state (this round's one writer: ``LocoTrainer._persist``)."""
    ref = await retry(
        lambda: rs.publish_state(state, digest), f"publishing the global state of round {state.round}"
    )
    log.info("%s: published the global state of round %d (%s)", rs.id, state.round, ref.digest[:16])


async def retain(rs: RoundStore, before: int, reached: int) -> None:
    """Delete our documents and the shared states of rounds before ``before``."""
    n = await rs.delete_own_before(before, reached)
    # Every trainer prunes the shared states too (idempotent): no single writer has to survive.
    n += await rs.delete_states_before(before)
    log.info("%s: retention deleted %d objects before round %d", rs.id, n, before)


class Background:
    """Uploads that run beside the rounds (checkpoints, global states, digests, retention).

    While :meth:`running` (``LocoTrainer.session``) they live in a TaskGroup, and an unexpected
    failure in one fails the session, as itself; outside it they are tracked until :meth:`drain`
    awaits them and re-raises such a failure. A typed store or disk failure is logged and dropped:
    the next round writes again.
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self.group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Hold the uploads' lifetime: leaving waits for those in flight (:meth:`drain`); failing or
        cancelled (a node stopping), it cancels them instead."""
        try:
            async with asyncio.TaskGroup() as group:
                self.group = group
                try:
                    yield
                except BaseException:
                    # Uploads that retry through an outage must not hold the exit; what they were
                    # writing is rewritten on the next run.
                    self.cancel()
                    raise
                await self.drain()
        except BaseExceptionGroup as eg:
            raise first_error(eg) from None
        finally:
            self.group = None

    def spawn(self, coro: Awaitable[None], what: str) -> None:
        """Run ``coro`` in the background (in ``group`` if set)."""

        async def guarded() -> None:
            try:
                await coro
            except (PulsenetError, OSError) as e:  # a store or disk failure: logged, the next round retries
                log.error("%s: background %s failed: %s: %s", self.who, what, type(e).__name__, e)

        task = self.group.create_task(guarded()) if self.group is not None else asyncio.create_task(guarded())
        self._tasks.add(task)
        task.add_done_callback(self._forget_if_ok)

    def cancel(self) -> None:
        """Cancel every task in flight (a session failing or cancelled: uploads that retry through an
        outage must not hold the exit; what they were writing is rewritten on the next run)."""
        for task in self._tasks:
            task.cancel()

    async def drain(self) -> None:
        """Wait for every task to finish; re-raise an unexpected failure of one."""
        while self._tasks:
            tasks = list(self._tasks)
            await asyncio.wait(tasks)
            self._tasks.difference_update(tasks)
            for t in tasks:
                if not t.cancelled() and (e := t.exception()) is not None:
                    raise e

    def _forget_if_ok(self, task: asyncio.Task[None]) -> None:
        """A finished task is dropped unless it failed: ``drain`` must still see that."""
        if not task.cancelled() and task.exception() is None:
            self._tasks.discard(task)
