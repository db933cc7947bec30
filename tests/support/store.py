"""What tests share about the test store: the bucket every test works in, a prefix of its own per
test, and the type of the store factories the fixtures in ``tests/conftest.py`` hand out."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from pulsenet.store import LocalStore, ObjectStore

TEST_BUCKET = "pulsenet-test"

StoreFactory = Callable[..., ObjectStore]


def unique_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix of this test's own in the shared bucket (its name, made key-safe, and 8 random hex)."""
    name = re.sub(r"[^a-zA-Z0-9-]+", "-", request.node.name).strip("-")[:60]
    return f"{name}-{uuid.uuid4().hex[:8]}"


class CountingStore(LocalStore):
    """A LocalStore that records what each read actually moved: bytes returned or written per key."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.read_bytes: dict[str, int] = {}

    async def _get(self, key: str, byte_range, max_bytes: int | None) -> bytes:
        data = await super()._get(key, byte_range, max_bytes)
        self.read_bytes[key] = self.read_bytes.get(key, 0) + len(data)
        return data

    async def _get_file(self, key: str, path: str, max_bytes: int | None) -> int:
        self.read_bytes.setdefault(key, 0)
        n = await super()._get_file(key, path, max_bytes)
        self.read_bytes[key] += n
        return n

