"""This trainer's own update through one PULSELoCo round: made, published, settled.

- :func:`encode` (step 2): ``s = e + θ_{r-1} - θ_local``, the visibility gate and the payload bytes
  (``algorithm.make_update``, ``codec.payload``); the new error feedback keeps what was not sent.
- :func:`publish`: the payload, then its signed manifest, retried until they land. A restarted
  trainer that redoes a round it already published may get other bits: the stored payload stands.
  :func:`finish` ends the upload once the round is decided (abandoned if still retrying).
- :func:`settle` (after step 4): the error feedback once the round's record is known: averaged,
  left out (delayed, not lost), rejected (this round's update dropped), or void.

The round itself (``trainer.py``) calls these in order; the maths is ``algorithm.py``'s.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

import torch

from pulsenet.codec import payload as wire
from pulsenet.errors import PulsenetError
from pulsenet.loco import algorithm as alg
from pulsenet.loco.config import RoundReport
from pulsenet.loco.documents import Record, RoundStore
from pulsenet.loco.progress import Retry
from pulsenet.signed import ObjectRef

log = logging.getLogger(__name__)
Phase = Callable[[str, int], AbstractAsyncContextManager[object]]
"""``phase(name, round)``: the trainer's phase hook (``LocoTrainer._phase``)."""


@dataclass(slots=True)
class Sent:
    """Round r's update as published: what collecting, applying and settling it need."""

    round: int
    report: RoundReport
    own: wire.Payload
    """Our payload (dense DiLoCo: without its values, which are a full model copy)."""
    new_error: alg.StateDict | None
    """e after sending all of ``own`` (None for dense DiLoCo, which keeps no error feedback)."""
    data: bytes
    sha256: str
    """Of ``data``: a record that names another payload of ours names an earlier run's."""


def encode(
    report: RoundReport,
    theta: Mapping[str, torch.Tensor],
    local: Mapping[str, torch.Tensor],
    error: alg.StateDict | None,
    *,
    sparse: bool,
    gate_scale: float,
) -> Sent:
    """Pseudo-gradient, gate and payload bytes of round ``report.round`` against θ_{r-1} (CPU: call
    it in a thread).

    Sparse values are coded relative to the round's base weights, which every receiver holds;
    DiLoCo's dense payload stays raw FP32 bits under zstd (the baseline as specified).
    """
    r = report.round
    own, new_error = alg.make_update(theta, local, error, round=r, sparse=sparse, gate_scale=gate_scale)
    data = wire.encode(own, theta if sparse else None)
    report.sent, report.total, report.payload_bytes = own.sent, own.total, len(data)
    if not sparse:
        own = wire.Payload(r, own.mode, {})  # dense values are a full model copy: keep only the bytes
    return Sent(r, report, own, new_error, data, hashlib.sha256(data).hexdigest())


async def publish(
    rs: RoundStore, sent: Sent, base_digest: str, *, mode: str, retry: Retry, phase: Phase
) -> tuple[bytes, ObjectRef]:
    """Upload payload + manifest, retried through store outages until they land (the round's
    collect cancels this when the round is decided without us); returns the payload bytes that
    stand in the store (normally ours) and their reference. ``base_digest``: the global state's
    digest the update was made against (into the manifest)."""
    r, data, report = sent.round, sent.data, sent.report
    async with phase("upload", r):
        manifest, fresh = await retry(
            lambda: rs.publish_payload(
                r, data, mode=mode, sent=report.sent, total=report.total, base_digest=base_digest
            ),
            f"round {r}: uploading our payload",
        )
    if fresh or manifest.payload.sha256 == sent.sha256:
        return data, manifest.payload
    # A restarted trainer redid a round it had already published and got different bits: the
    # stored payload is the one peers see (``settle`` accounts for it).
    log.warning("%s: round %d was already published with a different payload; the stored one stands", rs.id, r)
    stored = await retry(lambda: rs.fetch(manifest.payload), f"round {r}: reading our stored payload")
    return stored, manifest.payload


async def finish(upload: asyncio.Task[tuple[bytes, ObjectRef]], who: str, r: int) -> None:
    """Round r is decided (or its attempt failed): an upload still retrying is abandoned, and
    awaited either way (a manifest may already name the payload: never leave it half way).

    Safe mid-put: the payload key is content-addressed and the manifest create-only; a record
    that names our payload needed our manifest, so nothing that matters is left half done."""
    if not upload.done():
        log.warning("%s: round %d: abandoning our payload's upload (still retrying)", who, r)
        upload.cancel()
    (published,) = await asyncio.gather(upload, return_exceptions=True)
    if isinstance(published, PulsenetError):
        log.error("%s: round %d: publishing our payload failed: %s", who, r, published)


def settle(
    sent: Sent, record: Record, payloads: Mapping[str, wire.Payload], who: str, void: str | None
) -> alg.StateDict | None:
    """The error feedback after round ``sent.round`` applied ``record`` (``void``: why its outer
    step was void, else None); None: e stays as it was (dense DiLoCo keeps none)."""
    if sent.new_error is None or void is not None:  # a void round drops our update, like a rejection
        return None
    if who in record.rejected:
        # Judged invalid (non-finite, outsized): carrying it as error feedback would poison every
        # later round, so this round's local progress is dropped and e stays as it was.
        log.error(
            "%s: round %d: our own payload was rejected (%s); dropping this round's update",
            *(who, sent.round, record.rejected[who]),
        )
        return None
    # The record names the payload of ours that stands in the store: ours, or the one an earlier
    # run published, which is what was averaged (``algorithm.settle_error``).
    ours = record.participants.get(who)
    stored = payloads[who] if ours is not None and ours.sha256 != sent.sha256 else None
    return alg.settle_error(sent.new_error, sent.own, included=ours is not None, stored=stored)
