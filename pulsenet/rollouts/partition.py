"""Which trainer trains on a batch: rendezvous hashing over the round's participant set.

Why a partition and not claim markers: under the trust model every site writes only its own
bucket, so a create-only "claimed" marker would need one bucket all trainers may write, a shared
writable place the design rules out. Rendezvous hashing needs no writes at all: every trainer
computes the same owner from the batch id and the sorted participant ids, so within one
participant set each batch has exactly one owner and is never trained on twice.

The set is looked up per policy version (``participants(version)``), so as long as trainers agree
on the set of each version (e.g. from PULSELoCo round records) a batch's owner never changes. When
they disagree during a change, a batch may be skipped (its owner under one view never takes it),
never trained twice within one set. Rendezvous hashing moves only the batches of the trainers that
joined or left.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def owner(batch_id: str, participants: Iterable[str]) -> str:
    """The participant that owns ``batch_id``: highest SHA-256 of ``trainer \\n batch_id``."""
    ids = sorted(set(participants))
    if not ids:
        raise ValueError("a partition needs at least one participant")
    return max(ids, key=lambda t: hashlib.sha256(f"{t}\n{batch_id}".encode()).digest())
