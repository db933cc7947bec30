"""What tests share about the test store: the bucket every test works in, a prefix of its own per
test, and the type of the store factories the fixtures in ``tests/conftest.py`` hand out."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

import pytest

from pulsenet.store import ObjectStore

TEST_BUCKET = "pulsenet-test"

StoreFactory = Callable[..., ObjectStore]


def unique_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix of this test's own in the shared bucket (its name, made key-safe, and 8 random hex)."""
    name = re.sub(r"[^a-zA-Z0-9-]+", "-", request.node.name).strip("-")[:60]
    return f"{name}-{uuid.uuid4().hex[:8]}"
