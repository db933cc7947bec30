"""PULSESync: publish a policy's BF16 weights as signed, verified patch chains over an object store.

See ``docs/sync.md`` for the key layout, the chain/anchor/retention rules and resumption.

- :class:`Publisher` turns each new state into the next version (patch + periodic anchor, signed
  manifest written last, create-only) in a background task.
- :class:`Subscriber` polls, rebuilds the newest version off to the side, verifies it and swaps it in.
"""

from pulsenet.sync.chain import EMPTY_DIGEST
from pulsenet.sync.layout import Layout
from pulsenet.sync.manifest import Manifest, sign_manifest, verify_manifest
from pulsenet.sync.publisher import Publisher, PublisherConfig, PublishRecord
from pulsenet.sync.subscriber import Subscriber, SubscriberConfig, SubscriberStats

__all__ = [
    "EMPTY_DIGEST",
    "Layout",
    "Manifest",
    "PublishRecord",
    "Publisher",
    "PublisherConfig",
    "Subscriber",
    "SubscriberConfig",
    "SubscriberStats",
    "sign_manifest",
    "verify_manifest",
]
