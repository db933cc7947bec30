"""The rollout channel over the real store, for the rollout tests: two inference sites with their own
buckets and keys, honest rows, and an intake over them."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsenet.codec.rollout import Rollout
from pulsenet.rollouts import (
    RolloutIntake,
    RolloutIntakeConfig,
    RolloutSource,
    RolloutWriter,
    RolloutWriterConfig,
)
from pulsenet.signing import key_id
from pulsenet.store import ObjectStore
from pulsenet.store.seaweed import SeaweedServer

DIGESTS = {v: hashlib.sha256(f"model-v{v}".encode()).hexdigest() for v in range(64)}


def make_rows(
    node: str, version: int, *, groups: int = 2, g: int = 3, seed: int = 0, digest: str | None = None
):
    rng = random.Random(f"{node}-{version}-{seed}")
    rows = []
    for gi in range(groups):
        prompt = tuple(rng.randrange(50_000) for _ in range(rng.randrange(1, 12)))
        for _ in range(g):
            n = rng.randrange(1, 16)
            rows.append(
                Rollout(
                    group=f"{node}-v{version}-s{seed}-g{gi}",
                    prompt_ids=prompt,
                    completion_ids=tuple(rng.randrange(50_000) for _ in range(n)),
                    # float32 values: the wire carries logprobs as float32 (what engines compute)
                    logprobs=tuple(float(np.float32(-5 * rng.random())) for _ in range(n)),
                    reward=rng.choice([0.0, 1.0, 0.25]),
                    version=version,
                    model_digest=digest or DIGESTS[version],
                    node=node,
                    seed=rng.randrange(1 << 62),
                )
            )
    return rows


@dataclass
class Site:
    node: str
    key: Ed25519PrivateKey
    own: ObjectStore
    """The node's own bucket with its own (write) credentials."""
    read: ObjectStore
    """The same bucket and prefix with the trainer's read-only credentials."""

    def source(self) -> RolloutSource:
        return RolloutSource(self.node, self.read, {key_id(self.key.public_key()): self.key.public_key()})

    def writer(self, **cfg: object) -> RolloutWriter:
        return RolloutWriter(self.own, self.key, self.node, RolloutWriterConfig(run="test", **cfg))


def make_sites(s3_factory, seaweed: SeaweedServer) -> list[Site]:
    """Inference nodes ``inf-a`` and ``inf-b``, each with its own bucket and key."""
    out = []
    for s in ("a", "b"):
        bucket = seaweed.bucket(s)
        own = s3_factory(identity=seaweed.writer(s), bucket=bucket)
        out.append(
            Site(f"inf-{s}", Ed25519PrivateKey.generate(), own, s3_factory(identity="reader", bucket=bucket))
        )
    return out


def intake(sites: list[Site], **cfg: object) -> RolloutIntake:
    kw = {k: cfg.pop(k) for k in ("trainer_id", "participants") if k in cfg}
    return RolloutIntake(
        [s.source() for s in sites], DIGESTS.get, RolloutIntakeConfig(run="test", **cfg), **kw
    )

