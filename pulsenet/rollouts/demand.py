"""Demand: what each trainer will take, so inference nodes generate that and no more (issue 23).

Why: with a fixed 2x over-production, about 40% of generated batches went stale before any
trainer took them; on a GPU network generation is the bill. Here every trainer says how many rows
it wants in flight from each node, and every inference node paces its engine by that: it generates
while some trainer's grant is not covered by its untaken batches, and waits otherwise (AReaL's
staleness-aware rollout control, prime-rl's buffer sized to the trainer's demand).

**The record** is one signed document per trainer in the trainer's *own* store (the bucket its
policy channel is in; never a bucket two parties write), ``{prefix}/demand/{trainer}.json``
(layout.py), overwritten in place, signed for ``RolloutLayout.demand_context`` by the trainer's
key::

    {"format": "pulsenet-rollout-demand", "schema": 1,
     "trainer": "t0", "seq": 1767225600000000, "version": 12, "max_staleness": 2,
     "participants": ["t0", "t1"],
     "grants": {"inf-a": 64, "inf-b": 64},
     "taken": {"inf-a": 3, "inf-b": 2},
     "batches_per_version": 16, "prompts_per_batch": 64, "group_size": 8,
     "publisher": "<key id>", "created": "2026-01-01T00:00:00.000000+00:00"}

- ``version``: the trainer's policy version now; ``max_staleness``: the oldest version it accepts
  is ``version - max_staleness``; ``participants``: the partition's trainer set (partition.py).
- ``grants[node]``: rows the trainer wants *outstanding* from that node: generated, still fresh
  for it, owned by it, not yet taken (``RolloutIntake.demand``: its rows in flight split over the
  live nodes). A node not named is not read by this trainer; a grant of 0 means "none now".
- ``taken[node]``: that node's batches this trainer took (or dropped after a failed step) at
  versions ``>= version - max_staleness``, from its consumed record, so it survives a restart.
- ``batches_per_version``, ``prompts_per_batch``: the batch ids a node may answer for this trainer
  (``rl.tasks.Assignment``): at each version it serves, batches ``b < batches_per_version`` of at
  most ``prompts_per_batch`` problems, each problem a pure function of (run seed, node, version,
  b). The trainer refuses a batch outside them, and a batch id answered twice; a node makes no
  more than the smallest bounds of the records naming it. Every batch answers exactly
  ``prompts_per_batch`` problems (those its prompter drops declared in its manifest).
- ``group_size`` (schema 3, issue 38): GRPO's G, the rows of every group; the trainer refuses any
  other. A node makes groups of the G every record naming it agrees on. A record without it
  (schema 2, still read and written when the trainer sets none) leaves G to the node's setting.
- ``seq``: strictly increasing per trainer (microseconds of the writer's clock, or the last + 1):
  a reader keeps the newest record it verified and counts an older one (a replayed copy) as
  ``backwards``, never acting on it. A record that has not changed for ``ttl_s`` by the *reader's*
  clock is a trainer gone: the writer rewrites it at least every ``heartbeat_s``.

**Pacing** (:func:`batches_to_generate`, pure): for each live record naming this node, the node
counts its own batches that record's trainer owns and may still take, subtracts what it took, and
compares with the grant; the sum of the shortfalls, in batches, is what it generates now. 0 means
wait (also when its served version is too old for every trainer: what it would make is stale on
arrival); None means no live record names it, and the node generates as it would without demand.

What a party can do with it: a trainer's key can only speak for its own slot; a site writer of a
trainer's bucket can delete the record (nodes fall back to unpaced generation after ``ttl_s``) or
replay an older one (ignored, counted); a compromised trainer key can ask for too much (waste) or
nothing (its own share idles), never make a node train, serve or sign anything.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pulsenet import runtime
from pulsenet.deadlines import SMALL_CALL_S
from pulsenet.errors import DocumentTooLarge, ManifestError, ObjectNotFound, ObjectTooLarge, StoreError
from pulsenet.rollouts.layout import MAX_VERSION, NODE, BatchName, RolloutLayout, check_node
from pulsenet.rollouts.manifest import now_iso
from pulsenet.rollouts.partition import owner
from pulsenet.signed import fetch_document
from pulsenet.signing import key_id, sign_document, verify_document
from pulsenet.store.base import ObjectStore

log = logging.getLogger(__name__)

FORMAT = "pulsenet-rollout-demand"
SCHEMA = 3
"""2: ``batches_per_version`` and ``prompts_per_batch`` (issue 29); 3: ``group_size`` (issue 38).
A record without a group size is written and read as schema 2."""
MAX_DEMAND = 1 << 20
"""Largest demand record a node fetches (about 30 bytes per inference node named)."""
MAX_NODES = 1 << 15
"""Most nodes one record may name in ``grants`` or ``taken``."""
MAX_PARTICIPANTS = 1024
MAX_COUNT = 1 << 40
MAX_ASSIGNED = 1 << 16
"""Largest ``batches_per_version`` or ``prompts_per_batch`` a record may carry."""
_FIELDS = frozenset(
    {"format", "schema", "trainer", "seq", "version", "max_staleness", "participants", "grants", "taken",
     "batches_per_version", "prompts_per_batch", "publisher", "created"}
)  # fmt: skip
_FIELDS_V3 = _FIELDS | {"group_size"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Demand:
    """One trainer's demand record (module docstring). ``seq``, ``publisher`` and ``created`` are
    set by :class:`DemandWriter` when it signs."""

    trainer: str
    version: int
    max_staleness: int
    participants: tuple[str, ...]
    grants: Mapping[str, int]
    """Node -> rows wanted outstanding (generated, fresh, owned by this trainer, not yet taken)."""
    taken: Mapping[str, int]
    """Node -> batches taken at versions ``>= version - max_staleness``."""
    batches_per_version: int = 16
    """Batch numbers a node may answer per version for this trainer (``b < batches_per_version``)."""
    prompts_per_batch: int = 64
    """Problems per batch."""
    group_size: int | None = None
    """GRPO's G: rows of every group (None: the node's own setting; a schema 2 record)."""
    seq: int = 0
    publisher: str = ""
    created: str = ""

    @property
    def oldest(self) -> int:
        """The oldest rollout version this trainer still accepts."""
        return self.version - self.max_staleness

    def content(self) -> tuple:
        """What a reader acts on (not seq, publisher or time): a writer rewrites when it changes."""
        return (
            self.version, self.max_staleness, self.participants,
            tuple(sorted(self.grants.items())), tuple(sorted(self.taken.items())),
            self.batches_per_version, self.prompts_per_batch, self.group_size,
        )  # fmt: skip

    def to_body(self) -> dict:
        g = {} if self.group_size is None else {"group_size": self.group_size}
        return {
            **g,
            "format": FORMAT,
            "schema": 2 if self.group_size is None else SCHEMA,
            "trainer": self.trainer,
            "seq": self.seq,
            "version": self.version,
            "max_staleness": self.max_staleness,
            "participants": list(self.participants),
            "grants": dict(self.grants),
            "taken": dict(self.taken),
            "batches_per_version": self.batches_per_version,
            "prompts_per_batch": self.prompts_per_batch,
            "publisher": self.publisher,
            "created": self.created,
        }

    @classmethod
    def from_body(cls, body: Mapping) -> Demand:
        """Validate a (verified) body's shape; ManifestError names what is wrong."""
        try:
            return _from_body(body)
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"malformed demand record: {type(e).__name__}: {e}") from None


def _from_body(body: Mapping) -> Demand:
    schema = body.get("schema") if isinstance(body, Mapping) else None
    fields = {2: _FIELDS, 3: _FIELDS_V3}.get(schema) if type(schema) is int else None
    if not isinstance(body, Mapping) or body.get("format") != FORMAT or set(body) != fields:
        raise ManifestError(f"not a {FORMAT} v2 or v{SCHEMA} record")
    trainer = _node(body["trainer"], "trainer")
    parts = body["participants"]
    if not isinstance(parts, list) or not 0 < len(parts) <= MAX_PARTICIPANTS:
        raise ManifestError(f"demand record participants must be a list of 1..{MAX_PARTICIPANTS} ids")
    participants = tuple(_node(p, "participant") for p in parts)
    if list(participants) != sorted(set(participants)) or trainer not in participants:
        raise ManifestError("demand record participants must be sorted, distinct, and include the trainer")
    counts = {}
    for name in ("grants", "taken"):
        d = body[name]
        if not isinstance(d, dict) or len(d) > MAX_NODES:
            raise ManifestError(f"demand record {name} must be an object of at most {MAX_NODES} nodes")
        counts[name] = {_node(k, name): _int(v, name, MAX_COUNT) for k, v in d.items()}
    if not isinstance(body["publisher"], str) or not isinstance(body["created"], str):
        raise ManifestError("demand record publisher and created must be strings")
    return Demand(
        trainer=trainer,
        seq=_int(body["seq"], "seq", 1 << 62),
        version=_int(body["version"], "version", MAX_VERSION),
        max_staleness=_int(body["max_staleness"], "max_staleness", MAX_VERSION),
        participants=participants,
        grants=counts["grants"],
        taken=counts["taken"],
        batches_per_version=_positive(body["batches_per_version"], "batches_per_version"),
        prompts_per_batch=_positive(body["prompts_per_batch"], "prompts_per_batch"),
        group_size=_positive(body["group_size"], "group_size") if schema == SCHEMA else None,
        publisher=body["publisher"],
        created=body["created"],
    )


def _node(v: object, what: str) -> str:
    if not isinstance(v, str) or not NODE.fullmatch(v):
        raise ManifestError(f"demand record {what} {str(v)[:80]!r} is not a node id")
    return v


def _positive(v: object, what: str) -> int:
    n = _int(v, what, MAX_ASSIGNED)
    if n < 1:
        raise ManifestError(f"demand record {what} must be >= 1")
    return n


def assigned(demands: Iterable[Demand], node: str) -> tuple[int, int] | None:
    """``(batches_per_version, prompts_per_batch)`` that every live record naming ``node`` allows
    (the smallest of each), or None when none names it: what an inference node may make."""
    named = [d for d in demands if node in d.grants]
    if not named:
        return None
    return min(d.batches_per_version for d in named), min(d.prompts_per_batch for d in named)


def assigned_group_size(demands: Iterable[Demand], node: str) -> int | None:
    """The G every live record naming ``node`` signed (``group_size``), or None when none names one
    or they disagree (the node's own setting then; a trainer with another G refuses its groups)."""
    sizes = {d.group_size for d in demands if node in d.grants}
    return sizes.pop() if len(sizes) == 1 else None


def _int(v: object, what: str, most: int) -> int:
    if type(v) is not int or not 0 <= v <= most:
        raise ManifestError(f"demand record {what} must be an int in 0..{most}, got {str(v)[:40]}")
    return v


# --- the inference side: how much to generate ---------------------------------------------------


def batches_to_generate(
    demands: Iterable[Demand],
    *,
    node: str,
    version: int,
    produced: Iterable[BatchName],
    rows_per_batch: int,
    layout: RolloutLayout | None = None,
) -> int | None:
    """How many batches ``node`` should generate now at its served ``version``.

    ``demands``: the live records (``DemandReader.poll``); ``produced``: this node's batches still
    in its store (``RolloutWriter.produced``: only manifests its own key signed, never a listed name);
    ``rows_per_batch``: rows of the batch it would make. A batch above the served ``version`` is not
    counted (the node makes batches at the version it serves, which only moves forward once it
    generates): a claimed version is bounded by what the node knows before it steers the pacing.
    For each record naming ``node``: its outstanding batches are the ones that trainer owns
    (partition over the record's participants) at versions it still accepts, less those it took;
    the shortfall is its grant less their rows. Returns the summed shortfall in batches (rounded
    up), 0 to wait, or None when no record names ``node`` (no pacing: generate as without demand).
    """
    if rows_per_batch < 1:
        raise ValueError(f"rows_per_batch must be >= 1, got {rows_per_batch}")
    layout = layout or RolloutLayout()
    produced = list(produced)
    wanted, named = 0, False
    for d in demands:
        grant = d.grants.get(node)
        if grant is None:
            continue
        named = True
        if version < d.oldest:
            continue  # what this node would make now is already too old for this trainer
        mine = sum(
            1
            for b in produced
            if d.oldest <= b.version <= version and owner(layout.batch_id(node, b), d.participants) == d.trainer
        )
        outstanding = max(0, mine - d.taken.get(node, 0))
        wanted += max(0, grant - outstanding * rows_per_batch)
    return math.ceil(wanted / rows_per_batch) if named else None


# --- the trainer side: writing ------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class DemandConfig:
    run: str = "default"
    """Run id of the signing context (the same as the rollout channel's)."""
    prefix: str = "rollouts"
    """Key prefix of the rollout channel (layout.py), in the trainer's own store."""
    timeout_s: float | None = SMALL_CALL_S
    """Deadline of each store call."""
    interval_s: float = 0.25
    """``DemandWriter.run``: how often the trainer's demand is compared with what was written."""
    heartbeat_s: float = 5.0
    """``DemandWriter.run``: the record is rewritten at least this often, changed or not."""
    ttl_s: float = 30.0
    """``DemandReader``: a record unchanged this long (reader's clock) is a trainer gone."""

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.heartbeat_s <= 0 or self.ttl_s <= self.heartbeat_s:
            raise ValueError("need interval_s > 0, heartbeat_s > 0 and ttl_s > heartbeat_s")


@dataclass(slots=True)
class DemandWriterStats:
    writes: int = 0
    errors: int = 0


class DemandWriter:
    """Writes one trainer's demand record into its own store; ``await start()`` first."""

    def __init__(
        self, store: ObjectStore, key: Ed25519PrivateKey, trainer: str, config: DemandConfig | None = None
    ) -> None:
        self.store = store
        self.key = key
        self.trainer = check_node(trainer)
        self.config = config = config or DemandConfig()
        self.layout = RolloutLayout(config.prefix)
        self.key_id = key_id(key.public_key())
        self.context = self.layout.demand_context(config.run, store.url, trainer)
        self.stats = DemandWriterStats()
        self.last: Demand | None = None
        """The record written last."""

    async def start(self) -> None:
        """Continue ``seq`` after the record already in the store (a restarted trainer)."""
        try:
            signed = await fetch_document(
                self.store,
                self.layout.demand(self.trainer),
                {self.key_id: self.key.public_key()},
                context=self.context,
                max_bytes=MAX_DEMAND,
                timeout=self.config.timeout_s,
            )
            self.last = Demand.from_body(signed.body)
        except ObjectNotFound:
            pass
        except (ManifestError, DocumentTooLarge) as e:  # not ours (planted) or unreadable: overwrite it
            log.warning("demand record of %s in %s is not readable: %s", self.trainer, self.store.url, e)

    async def write(self, demand: Demand) -> Demand:
        """Sign and put ``demand`` (its seq past the last one's); returns what was written."""
        if demand.trainer != self.trainer:
            raise ValueError(f"demand of {demand.trainer!r} given to the writer of {self.trainer!r}")
        seq = max(time.time_ns() // 1000, (self.last.seq + 1) if self.last else 0)
        d = dataclasses.replace(demand, seq=seq, publisher=self.key_id, created=now_iso())
        Demand.from_body(d.to_body())  # what a reader would refuse is never written
        data = sign_document(d.to_body(), self.key, context=self.context)
        await self.store.put(self.layout.demand(self.trainer), data, timeout=self.config.timeout_s)
        self.last = d
        self.stats.writes += 1
        return d

    async def run(self, demand: Callable[[], Demand], stop: asyncio.Event) -> None:
        """Write ``demand()`` whenever what it says changes (checked every ``interval_s``) and at
        least every ``heartbeat_s``, until ``stop``; store errors are logged, counted and retried."""
        written_at = -math.inf

        async def step() -> None:
            nonlocal written_at
            d, now = demand(), time.monotonic()
            if self.last is None or d.content() != self.last.content() or now - written_at >= self.config.heartbeat_s:
                await self.write(d)
                written_at = now

        await runtime.every(self.config.interval_s, stop, step, on_error=self._not_written)

    def _not_written(self, e: Exception) -> None:
        """A store error or timeout writing the record (``run``): counted and logged, retried at the
        next interval; anything else ends the loop."""
        if not isinstance(e, (StoreError, TimeoutError)):
            raise e
        self.stats.errors += 1
        log.warning("demand record of %s not written: %s: %s", self.trainer, type(e).__name__, e)


# --- the inference side: reading ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DemandSource:
    """One trainer's store (read-only credentials) and the keys that may sign its record."""

    trainer: str
    store: ObjectStore
    trusted: Mapping[str, Ed25519PublicKey]


@dataclass(slots=True)
class DemandStats:
    polls: int = 0
    reads: int = 0
    """Records fetched (GETs that returned a body)."""
    not_modified: int = 0
    """Conditional GETs answered 304: the record is the one read last."""
    changed: int = 0
    """Records that moved forward (a higher seq)."""
    missing: int = 0
    """Reads that found no record."""
    backwards: int = 0
    """Verified records older than one already seen (replayed): ignored."""
    rejected: dict[str, int] = field(default_factory=dict)
    """Trainer -> records refused (bad signature, malformed, too large, another trainer's)."""
    errors: int = 0
    """Store errors and timeouts (logged); the last good record stays until ``ttl_s``."""


@dataclass(slots=True)
class _Seen:
    demand: Demand
    changed: float
    """time.monotonic() when its seq last moved forward."""


class DemandReader:
    """An inference node's view of the trainers' demand records."""

    def __init__(self, sources: Sequence[DemandSource], config: DemandConfig | None = None) -> None:
        trainers = [check_node(s.trainer) for s in sources]
        if len(set(trainers)) != len(trainers):
            raise ValueError(f"demand sources need distinct trainer ids, got {trainers}")
        self.sources = list(sources)
        self.config = config or DemandConfig()
        self.layout = RolloutLayout(self.config.prefix)
        self.stats = DemandStats()
        self._seen: dict[str, _Seen] = {}
        self._etag: dict[str, str] = {}  # trainer -> ETag of the record object read last

    def live(self, now: float | None = None) -> list[Demand]:
        """The newest record of every trainer that changed within ``ttl_s``."""
        now = time.monotonic() if now is None else now
        return [s.demand for s in self._seen.values() if now - s.changed <= self.config.ttl_s]

    async def poll(self, now: float | None = None) -> list[Demand]:
        """Read every trainer's record once; the live records. Never raises for a source's fault."""
        self.stats.polls += 1
        for source in self.sources:
            try:
                await self._read(source)
            except (StoreError, TimeoutError) as e:
                self.stats.errors += 1
                log.warning("demand record of %s unreadable: %s: %s", source.trainer, type(e).__name__, e)
        return self.live(now)

    async def _read(self, source: DemandSource) -> None:
        """One conditional GET of a trainer's record (a 304 while it is the object read last, so an
        idle poll costs one request per trainer and a refused or replayed record is verified and
        counted once); a changed one is verified and observed."""
        cfg = self.config
        key = self.layout.demand(source.trainer)
        try:
            got = await source.store.get_if_changed(
                key, self._etag.get(source.trainer), max_bytes=MAX_DEMAND, timeout=cfg.timeout_s
            )
        except ObjectNotFound:
            self.stats.missing += 1
            self._etag.pop(source.trainer, None)
            return
        except ObjectTooLarge as e:
            self._etag.pop(source.trainer, None)
            return self._refuse(source.trainer, DocumentTooLarge(f"{key}: {e}"))
        if got is None:
            self.stats.not_modified += 1
            return
        self.stats.reads += 1
        self._etag[source.trainer] = got.etag
        context = self.layout.demand_context(cfg.run, source.store.url, source.trainer)
        try:
            signed = await asyncio.to_thread(verify_document, got.data, source.trusted, context=context)
            d = Demand.from_body(signed.body)
            if d.trainer != source.trainer or d.publisher != signed.signer:
                raise ManifestError(f"record of {d.trainer!r} signed by {signed.signer} in the slot of {source.trainer!r}")
        except ManifestError as e:  # SignatureError is a ManifestError
            return self._refuse(source.trainer, e)
        self._observe(source.trainer, d)

    def _refuse(self, trainer: str, e: Exception) -> None:
        self.stats.rejected[trainer] = self.stats.rejected.get(trainer, 0) + 1
        log.warning("demand record of %s refused: %s: %s", trainer, type(e).__name__, e)

    def _observe(self, trainer: str, d: Demand) -> None:
        seen = self._seen.get(trainer)
        if seen is not None and d.seq < seen.demand.seq:
            self.stats.backwards += 1
            log.warning("demand record of %s went back from seq %d to %d: ignored", trainer, seen.demand.seq, d.seq)
        elif seen is None or d.seq > seen.demand.seq:
            self.stats.changed += 1
            self._seen[trainer] = _Seen(d, time.monotonic())

