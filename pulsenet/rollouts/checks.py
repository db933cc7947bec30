"""The ladder of checks a rollout batch climbs before the intake (intake.py) queues it.

A batch is accepted only if, in this order (the first failing check is the counted reason):

1. its manifest is at most ``signing.MAX_DOCUMENT`` bytes (listed size, then the read is capped)
   — ``too_large``;
2. it verifies under a key trusted *for the node whose store it is in*, signed for that node's
   context — ``wrong_node_key`` when a key trusted only for another node validly signed it,
   ``signature`` otherwise;
   malformed bodies and bodies that disagree with their key name — ``malformed``;
3. ``trainer_version - version <= max_staleness`` — else dropped as stale *in flight* (judged
   from the key name before any GET: a body must match its name anyway);
4. its model digest is the one published for its version (``digest_of``) — ``unknown_version``,
   ``wrong_digest``;
5. its declared size, rows and tokens are within limits, and could ever fit the queue's token and
   byte budgets — ``too_large``, refused before download;
6. the payload's size and SHA-256 equal the manifest's (``signed.fetch_object``: never read past the
   signed size) — ``size_mismatch``, ``hash_mismatch``;
7. the Parquet decodes under the limits — ``payload_malformed``;
8. every row's version, digest and node equal the manifest's, and the row, group and token
   counts match — ``row_mismatch``;
9. every row is within the trainer's :class:`~pulsenet.rollouts.rows.RowLimits` (token ids below the
   vocabulary, lengths within the context, one prompt per group, logprobs and rewards in range) —
   ``rows.ROW_REASONS``;
10. with ``answer_of`` (the trainer's ``rl.answers.BatchCheck``): the batch answers one batch id
    the trainer allows, whole: every group id exactly as ``group_id`` writes it, within bounds, each
    problem once, every group G rows, every assigned problem answered or declared dropped in the
    manifest as the trainer's prompter drops it, every prompt the problem's, every completion's
    length and ending what the sampling parameters give (on every row) — ``ANSWER_REASONS``; and no
    batch accepted before answered the same id — ``batch_repeated`` (the ids are part of the
    consumed record, so this holds across a restart).

Each check is a plain function here over what it needs; one that refuses returns a
``Refusal`` (intake_types.py). ``RolloutIntake._consider`` calls them in this order, holds check 3
and the repeat of check 10 (they read its state), and counts and logs each refusal per node and
reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulsenet.codec.rollout import RolloutColumns, decode_columns
from pulsenet.errors import (
    DocumentTooLarge,
    ManifestError,
    ObjectNotFound,
    RolloutError,
    RolloutRowError,
    SignatureError,
    SizeMismatch,
    VerificationError,
)
from pulsenet.rollouts.intake_types import AnswerOf, Refusal, RolloutIntakeConfig
from pulsenet.rollouts.layout import BatchName, RolloutLayout
from pulsenet.rollouts.manifest import BatchManifest, batch_manifest_from
from pulsenet.rollouts.rows import RowLimits, check_rows
from pulsenet.rollouts.sources import RolloutSource
from pulsenet.signed import fetch_document, fetch_object
from pulsenet.signing import MAX_DOCUMENT
from pulsenet.store.base import ObjectInfo

log = logging.getLogger(__name__)


async def read_manifest(
    source: RolloutSource,
    info: ObjectInfo,
    name: BatchName,
    *,
    keys: Mapping[str, Ed25519PublicKey],
    any_node: Mapping[str, Ed25519PublicKey],
    layout: RolloutLayout,
    config: RolloutIntakeConfig,
) -> BatchManifest | Refusal | None:
    """Checks 1 and 2: the batch's manifest, verified under every node's keys (``any_node``) so
    that another node's signature is told apart, then its signer checked against ``keys`` (those
    of the node whose store it is in). None: deleted by its owner's retention since the listing.
    Store errors other than a missing or oversized object propagate."""
    ctx = layout.context(config.run, source.store.url, source.node)
    try:
        signed = await fetch_document(
            source.store,
            info.key,
            any_node,
            context=ctx,
            max_bytes=MAX_DOCUMENT,
            timeout=config.timeout_s,
            listed_size=info.size,
        )
        if signed.signer not in keys:
            return Refusal("wrong_node_key", f"signed by {signed.signer}, a key of another node")
        m = batch_manifest_from(signed, layout=layout, name=name)
    except ObjectNotFound:
        return None
    except DocumentTooLarge as e:
        return Refusal("too_large", str(e))
    except SignatureError as e:
        return Refusal("signature", str(e))
    except ManifestError as e:
        return Refusal("malformed", str(e))
    if m.node != source.node:
        return Refusal("malformed", f"node {m.node!r} in the store of {source.node!r}")
    return m


def check_digest(m: BatchManifest, published: str | None) -> Refusal | None:
    """Check 4: ``published`` is the model digest the trainer published for ``m.version`` (None: none)."""
    if published is None:
        return Refusal("unknown_version", f"no published digest for v{m.version}")
    if published != m.model_digest:
        return Refusal("wrong_digest", f"served {m.model_digest[:16]}…, v{m.version} is {published[:16]}…")
    return None


def check_declared(m: BatchManifest, config: RolloutIntakeConfig) -> Refusal | None:
    """Check 5: what the manifest declares is within the limits and could ever fit the queue."""
    estimate = RolloutColumns.bound_nbytes(rows=m.rows, groups=m.groups, tokens=m.tokens)
    if (
        m.payload.size > config.max_batch_bytes
        or m.rows > config.max_rows
        or m.tokens > min(config.max_tokens, config.max_queued_tokens)
        or estimate > config.max_queued_bytes
    ):
        return Refusal("too_large", f"{m.payload.size} bytes, {m.rows} rows, {m.tokens} tokens declared")
    return None


async def fetch_payload(source: RolloutSource, m: BatchManifest, timeout: float | None) -> tuple[bytes | Refusal, int]:
    """Check 6: the payload, its size and SHA-256 the manifest's; and the bytes downloaded for it.
    Store errors other than a missing object propagate."""
    try:
        payload = await fetch_object(source.store, m.payload, timeout=timeout)
    except ObjectNotFound:
        return Refusal("size_mismatch", f"payload {m.payload.key} is missing"), 0
    except SizeMismatch as e:
        return Refusal("size_mismatch", str(e)), 0
    except VerificationError as e:
        return Refusal("hash_mismatch", str(e)), m.payload.size
    return payload, len(payload)


async def read_rows(
    m: BatchManifest,
    payload: bytes,
    limits: RowLimits,
    answer_of: AnswerOf | None,
) -> tuple[RolloutColumns, str | None] | Refusal:
    """Checks 7 to 10 (the repeat of 10 aside), in threads: the rows and the batch id they answer
    (None: ``answer_of`` is None, or names none to check)."""
    try:
        columns = await asyncio.to_thread(decode_and_check, m, payload, limits)
        answer = None if answer_of is None else await asyncio.to_thread(answer_of, columns, m.dropped)
    except RolloutRowError as e:
        return Refusal(e.reason, str(e))
    except RolloutError as e:
        return Refusal("payload_malformed", str(e))
    except (ValueError, TypeError, IndexError, KeyError, OverflowError) as e:
        # A batch no check can judge (a case the checks do not foresee) is refused and remembered
        # like any other, never retried at every poll: logged with its traceback, to be fixed.
        log.error("rollout batch %s: a check raised", m.payload.key, exc_info=e)
        return Refusal("payload_malformed", f"a check raised {type(e).__name__}: {e}")
    return columns, answer


def decode_and_check(m: BatchManifest, payload: bytes, limits: RowLimits) -> RolloutColumns:
    """Checks 7 to 9: the rows (decoded under the manifest's counts), checked against the manifest
    and ``limits``: RolloutError (payload), RolloutRowError (``row_mismatch`` or a ROW_REASONS reason)."""
    cols = decode_columns(payload, max_rows=m.rows, max_tokens=m.tokens)
    if (cols.version, cols.model_digest, cols.node) != (m.version, m.model_digest, m.node):
        raise RolloutRowError(
            "row_mismatch", f"rows say node {cols.node!r} v{cols.version}; the manifest says {m.node!r} v{m.version}"
        )
    if len(cols) != m.rows or len(cols.groups) != m.groups or cols.tokens != m.tokens:
        raise RolloutRowError(
            "row_mismatch",
            f"{len(cols)} rows in {len(cols.groups)} groups, {cols.tokens} tokens; manifest says "
            f"{m.rows} in {m.groups}, {m.tokens} tokens",
        )
    check_rows(cols, limits)
    return cols
