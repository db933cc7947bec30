"""The ObjectStore contract, run against both backends (LocalStore and S3Store on real SeaweedFS)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import os
import random
import socket
import time
from pathlib import Path

import botocore.exceptions as bex
import pytest

from pulsenet.errors import (
    ConditionFailed,
    ConfigError,
    ObjectNotFound,
    ObjectTooLarge,
    StoreTimeout,
    StoreUnavailable,
)
from pulsenet.store import (
    LocalStore,
    ObjectStore,
    RateLimiter,
    RequestCounts,
    S3Config,
    S3Store,
    backoff_delay,
    open_store,
)
from pulsenet.store import s3 as s3_module
from pulsenet.store.local import TMP_PREFIX
from tests.support.store import StoreFactory
from tests.support.waiting import wait_until

MiB = 1024 * 1024
# Small multipart sizes so a ~20 MB object takes several parts and ranges.
SMALL_PARTS = {"multipart_threshold": 5 * MiB, "multipart_chunk": 5 * MiB}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


# --- basic objects -------------------------------------------------------------------------


async def test_put_get_overwrite(store: ObjectStore) -> None:
    await store.put("a/b/c.bin", b"one")
    assert await store.get("a/b/c.bin") == b"one"
    await store.put("a/b/c.bin", b"two!")
    assert await store.get("a/b/c.bin") == b"two!"
    await store.put("empty", b"")
    assert await store.get("empty") == b""


async def test_byte_ranges_are_half_open_and_clipped(store: ObjectStore) -> None:
    data = bytes(range(256)) * 4
    await store.put("r", data)
    assert await store.get("r", byte_range=(0, 1)) == data[0:1]
    assert await store.get("r", byte_range=(10, 300)) == data[10:300]
    assert await store.get("r", byte_range=(1000, 5000)) == data[1000:]  # end clipped
    assert await store.get("r", byte_range=(len(data), len(data) + 9)) == b""  # start past the end
    for bad in [(5, 5), (-1, 3), (7, 2)]:
        with pytest.raises(ValueError):
            await store.get("r", byte_range=bad)


async def test_head_and_exists(store: ObjectStore) -> None:
    before = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=5)
    await store.put("h", b"12345")
    info = await store.head("h")
    assert (info.key, info.size) == ("h", 5)
    assert info.etag and '"' not in info.etag
    assert info.last_modified.tzinfo is not None and info.last_modified >= before
    assert await store.exists("h") and not await store.exists("nope")
    await store.put("h", b"123456")
    assert (await store.head("h")).etag != info.etag


async def test_missing_key_raises_object_not_found(store: ObjectStore, tmp_path: Path) -> None:
    for call in (store.get("missing"), store.get("missing", byte_range=(0, 4)), store.head("missing")):
        with pytest.raises(ObjectNotFound) as err:
            await call
        assert isinstance(err.value, KeyError)
    with pytest.raises(ObjectNotFound):
        await store.get_file("missing", tmp_path / "out")
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "./a", "a/", "a\\b"])
async def test_bad_keys_rejected(store: ObjectStore, key: str) -> None:
    with pytest.raises(ValueError):
        await store.put(key, b"x")


# --- create-only -------------------------------------------------------------------------


async def test_create_only_conflict(store: ObjectStore) -> None:
    await store.put("manifest.json", b"v1", if_none_match=True)
    with pytest.raises(ConditionFailed):
        await store.put("manifest.json", b"v2", if_none_match=True)
    assert await store.get("manifest.json") == b"v1"


async def test_create_only_race_has_one_winner(store: ObjectStore) -> None:
    async def attempt(i: int) -> int | None:
        try:
            await store.put("race", f"writer {i}".encode(), if_none_match=True)
        except ConditionFailed:
            return None
        return i

    results = await asyncio.gather(*(attempt(i) for i in range(8)))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    assert await store.get("race") == f"writer {winners[0]}".encode()


async def test_put_file_create_only_multipart(store_factory: StoreFactory, tmp_path: Path) -> None:
    store = store_factory(**SMALL_PARTS)
    src = tmp_path / "big"
    src.write_bytes(os.urandom(6 * MiB))  # two parts on S3
    assert await store.put_file("obj", src, if_none_match=True) == 6 * MiB
    src.write_bytes(b"other")
    with pytest.raises(ConditionFailed):
        await store.put_file("obj", src, if_none_match=True)
    with pytest.raises(ConditionFailed):
        await store.put("obj", b"other", if_none_match=True)
    assert (await store.head("obj")).size == 6 * MiB


# --- listing and deletion -----------------------------------------------------------------


async def test_list_prefix_sorted_and_paginated(store_factory: StoreFactory) -> None:
    store = store_factory(list_page_size=7)  # 20 keys: three pages on S3
    keys = [f"a/{i:02d}" for i in range(17)] + ["ab/1", "b/1", "b/2"]
    await asyncio.gather(*(store.put(k, k.encode()) for k in reversed(keys)))
    listed = await store.list()
    assert [i.key for i in listed] == sorted(keys)
    assert all(i.size == len(i.key) for i in listed)
    assert [i.key for i in await store.list("a/")] == [f"a/{i:02d}" for i in range(17)]
    assert [i.key for i in await store.list("a")] == [*(f"a/{i:02d}" for i in range(17)), "ab/1"]
    assert [i.key for i in await store.list("b/2")] == ["b/2"]
    assert await store.list("zzz") == []


async def test_delete_batches_and_ignores_missing(
    store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3_module, "DELETE_BATCH", 7)  # 23 keys: four DeleteObjects calls on S3
    keys = [f"d/{i}" for i in range(20)]
    await asyncio.gather(*(store.put(k, b"x") for k in keys))
    await store.put("keep", b"k")
    await store.delete([*keys, "d/missing-1", "never/there", "d/missing-2"])
    assert [i.key for i in await store.list()] == ["keep"]
    await store.delete([])
    await store.delete(["keep", "keep"])
    assert await store.list() == []


# --- large objects ------------------------------------------------------------------------


async def test_multipart_put_file_and_parallel_get_file(store_factory: StoreFactory, tmp_path: Path) -> None:
    store = store_factory(**SMALL_PARTS, max_concurrency=4)
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(20 * MiB + 12345))  # 5 parts on S3, the last one short
    assert await store.put_file("big/model.bin", src) == src.stat().st_size
    dest = tmp_path / "out" / "model.bin"
    assert await store.get_file("big/model.bin", dest) == src.stat().st_size
    assert _sha(dest) == _sha(src)
    assert _leftovers(dest.parent) == ["model.bin"]
    # A plain get of part of it agrees too.
    start = 5 * MiB - 10
    assert (
        await store.get("big/model.bin", byte_range=(start, start + 20))
        == src.read_bytes()[start : start + 20]
    )


async def test_small_and_empty_files(store: ObjectStore, tmp_path: Path) -> None:
    for name, data in [("small", b"tiny"), ("empty", b"")]:
        src = tmp_path / name
        src.write_bytes(data)
        assert await store.put_file(f"f/{name}", src) == len(data)
        assert await store.get_file(f"f/{name}", tmp_path / f"{name}.out") == len(data)
        assert (tmp_path / f"{name}.out").read_bytes() == data


async def test_interrupted_get_file_leaves_nothing(store_factory: StoreFactory, tmp_path: Path) -> None:
    fast = store_factory(**SMALL_PARTS)
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(20 * MiB))
    await fast.put_file("obj", src)
    # 80 Mbit/s: 20 MiB takes ~2 s; stop after 0.9 s, once some chunks are in the temp file.
    slow = store_factory(**SMALL_PARTS, link_mbps=80, max_concurrency=1)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "existing").write_bytes(b"old")
    for dest in (out_dir / "new.bin", out_dir / "existing"):
        with pytest.raises(StoreTimeout):
            await slow.get_file("obj", dest, timeout=0.9)
    assert _leftovers(out_dir) == ["existing"]
    assert (out_dir / "existing").read_bytes() == b"old"


async def test_s3_get_file_refuses_to_mix_versions(s3_factory: StoreFactory, tmp_path: Path) -> None:
    """An overwrite during a download fails it (If-Match per range) rather than stitching versions.

    (LocalStore reads through one open descriptor, so it returns the old version whole instead.)
    """
    fast = s3_factory(**SMALL_PARTS)
    await fast.put("obj", os.urandom(15 * MiB))
    slow = s3_factory(**SMALL_PARTS, link_mbps=40, max_concurrency=1)  # three 5 MiB ranges, ~1 s each
    download = asyncio.create_task(slow.get_file("obj", tmp_path / "out"))
    # the version is pinned (HEAD answered) once the first range is asked for: not a fixed 0.2 s,
    # which a loaded machine can spend before the HEAD, so the download would get the new version whole
    await wait_until(lambda: slow.requests.get >= 1 or download.done(), 30, "the first range request")
    await fast.put("obj", os.urandom(15 * MiB))  # lands while the first range is being paid for
    with pytest.raises(ConditionFailed):
        await download
    assert _leftovers(tmp_path) == []


async def test_put_file_missing_source_is_callers_error(store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        await store.put_file("x", tmp_path / "no-such-file")


# --- conditional GET and request counters ------------------------------------------------


async def test_get_if_changed_costs_a_304_when_unchanged(store: ObjectStore) -> None:
    await store.put("head.json", b"v1")
    first = await store.get_if_changed("head.json", None)
    assert first is not None and first.data == b"v1" and first.etag == (await store.head("head.json")).etag
    before = store.requests.snapshot()
    assert await store.get_if_changed("head.json", first.etag) is None
    assert await store.get_if_changed("head.json", f'"{first.etag}"') is None  # quoted as HTTP sends it
    delta = store.requests - before
    assert (delta.get_not_modified, delta.get, delta.bytes_down) == (2, 0, 0)
    await store.put("head.json", b"v2, longer")
    second = await store.get_if_changed("head.json", first.etag)
    assert second is not None and second.data == b"v2, longer" and second.etag != first.etag
    assert (store.requests - before).get == 1
    with pytest.raises(ObjectTooLarge):
        await store.get_if_changed("head.json", first.etag, max_bytes=4)
    with pytest.raises(ObjectNotFound):
        await store.get_if_changed("missing.json", first.etag)


async def test_requests_are_counted_by_kind(store_factory: StoreFactory) -> None:
    store = store_factory(list_page_size=2)
    s3 = isinstance(store, S3Store)
    for i in range(5):
        await store.put(f"c/{i}", b"x" * 10)
    await store.get("c/0")
    await store.head("c/1")
    assert not await store.exists("c/none")  # a HEAD answered 404 is a request too
    await store.list("c/")
    await store.delete([f"c/{i}" for i in range(5)])
    with pytest.raises(ObjectNotFound):
        await store.get("c/0")
    counts = store.requests.as_dict()
    assert counts == {
        "get": 2,
        "get_not_modified": 0,
        "head": 2,
        "list": 3 if s3 else 1,  # S3: 5 keys in pages of 2
        "put": 5,
        "delete": 1,
        "bytes_down": 10,
        "bytes_up": 50,
    }
    assert store.requests.requests == sum(counts[k] for k in ("get", "get_not_modified", "head", "list", "put", "delete"))
    assert isinstance(store.requests.snapshot(), RequestCounts) and store.requests.snapshot() is not store.requests
    assert store.health.consecutive_failures == 0 and store.health.last_ok is not None
    assert store.health.degraded() is None


# --- deadlines, failures and the link emulation --------------------------------------------


async def test_timeout_raises_store_timeout(store_factory: StoreFactory) -> None:
    store = store_factory(link_mbps=1)  # 1 MB would take 8 s
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout) as err:
        await store.put("slow", b"x" * 1_000_000, timeout=0.3)
    assert time.monotonic() - t0 < 4  # not the 8 s the transfer would take
    assert isinstance(err.value, TimeoutError)


async def test_rate_limit_caps_throughput(store_factory: StoreFactory) -> None:
    store = store_factory(link_mbps=8)  # 1 MB/s
    data = os.urandom(2_000_000)
    t0 = time.monotonic()
    await store.put("paced", data)
    assert 1.5 <= time.monotonic() - t0 < 6
    fast = store_factory(link_mbps=32)  # get side, 4 MB/s: ~0.5 s
    t0 = time.monotonic()
    assert await fast.get("paced") == data
    assert 0.35 <= time.monotonic() - t0 < 4


async def test_rate_limiter_shared_and_refunds_on_cancel() -> None:
    limiter = RateLimiter(80)  # 10 MB/s
    t0 = time.monotonic()
    await asyncio.gather(*(limiter.acquire(500_000) for _ in range(4)))  # 2 MB in total
    assert 0.15 <= time.monotonic() - t0 < 2.0
    waiter = asyncio.create_task(limiter.acquire(50_000_000))
    await asyncio.sleep(0.05)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    t0 = time.monotonic()
    await limiter.acquire(100_000)  # not stuck behind the cancelled 5 s of debt
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(ValueError):
        RateLimiter(0)


class _BlackHole:
    """A TCP listener that never answers: connections queue in the backlog, reads hang."""

    def __enter__(self) -> str:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


async def test_s3_hung_server_times_out() -> None:
    with _BlackHole() as endpoint:
        cfg = S3Config(endpoint_url=endpoint, access_key_id="k", secret_access_key="s", read_timeout_s=0.3)
        async with S3Store("bucket", "", cfg) as store:
            t0 = time.monotonic()
            with pytest.raises(StoreTimeout):  # the call's deadline
                await store.get("x", timeout=0.5)
            assert time.monotonic() - t0 < 4
        async with S3Store("bucket", "", dataclasses.replace(cfg, max_retries=1)) as store:
            with pytest.raises(StoreTimeout, match="no response"):  # read timeouts, retries exhausted
                await store.head("x")


def test_backoff_is_exponential_with_full_jitter() -> None:
    rng = random.Random(0)
    for attempt, bound in ((0, 0.1), (1, 0.2), (3, 0.8), (6, 5.0), (60, 5.0), (10_000, 5.0)):
        draws = [backoff_delay(attempt, 0.1, 5.0, rng) for _ in range(2000)]
        assert min(draws) >= 0 and max(draws) <= bound
        assert min(draws) < bound * 0.05 and max(draws) > bound * 0.95  # the whole range, not half of it


async def test_s3_unreachable_is_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    cfg = S3Config(
        endpoint_url=f"http://127.0.0.1:{port}", access_key_id="k", secret_access_key="s", max_retries=2
    )
    async with S3Store("bucket", "p", cfg) as store:
        with pytest.raises(StoreUnavailable):
            await store.put("x", b"1")
        assert store.requests.put == 3  # every attempt is a request
        h = store.health
        assert (h.consecutive_failures, h.failures, h.last_ok) == (3, 3, None)
        assert "3 failed requests in a row" in (h.degraded() or "") and "Connect" in (h.last_error or "")


# --- URLs and config -----------------------------------------------------------------------


def test_open_store_parses_urls(tmp_path: Path) -> None:
    s3 = open_store("s3://my-bucket/runs/exp1/", S3Config(endpoint_url="http://127.0.0.1:1"))
    assert isinstance(s3, S3Store) and (s3.bucket, s3.prefix) == ("my-bucket", "runs/exp1/")
    assert open_store("s3://my-bucket").prefix == ""  # type: ignore[attr-defined]
    local = open_store(tmp_path.as_uri(), S3Config(link_mbps=5))
    assert isinstance(local, LocalStore) and local.root == tmp_path
    assert open_store(f"file://localhost{tmp_path}").url == tmp_path.as_uri()


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com/x",
        "s3://",
        "s3:///prefix",
        "s3://Bad_Bucket/x",
        "s3://bucket/a/../b",
        "s3://bucket/p?versionId=1",
        "file://otherhost/tmp/x",
        "file:relative/path",
        "/just/a/path",
        "bucket/prefix",
    ],
)
def test_bad_url_is_config_error(url: str) -> None:
    with pytest.raises(ConfigError):
        open_store(url)


def test_s3_config_env_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://env:1")
    assert S3Config().endpoint_url is None  # never implicitly
    cfg = S3Config.from_env(
        {
            "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
            "AWS_ACCESS_KEY_ID": "id",
            "AWS_SECRET_ACCESS_KEY": "secret",
            "AWS_DEFAULT_REGION": "eu-west-1",
            "AWS_REGION": "eu-central-1",
        },
        max_retries=2,
    )
    assert (cfg.endpoint_url, cfg.access_key_id, cfg.secret_access_key) == (
        "http://127.0.0.1:9",
        "id",
        "secret",
    )
    assert (cfg.region, cfg.max_retries) == ("eu-central-1", 2)
    assert S3Config(region="x").with_env({}).region == "x"
    with pytest.raises(ConfigError):
        S3Config(access_key_id="only-half")
    with pytest.raises(ConfigError):
        S3Config(multipart_chunk=1024)


async def test_local_store_hides_temp_files(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    await store.put("x/y", b"1")
    (tmp_path / "x" / f"{TMP_PREFIX}stale").write_bytes(b"partial")
    assert [i.key for i in await store.list()] == ["x/y"]
    with pytest.raises(ValueError):
        await store.put(f"x/{TMP_PREFIX}1", b"no")


async def test_max_bytes_refuses_oversized_objects_before_reading_them(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    store = store_factory()
    data = bytes(range(256)) * 40  # 10240 bytes
    await store.put("big/obj", data)
    assert await store.get("big/obj", max_bytes=len(data)) == data
    with pytest.raises(ObjectTooLarge):
        await store.get("big/obj", max_bytes=len(data) - 1)
    # A slice is judged by its own length.
    assert await store.get("big/obj", byte_range=(0, 100), max_bytes=100) == data[:100]
    with pytest.raises(ObjectTooLarge):
        await store.get("big/obj", byte_range=(0, 101), max_bytes=100)
    dest = tmp_path / "out.bin"
    with pytest.raises(ObjectTooLarge):
        await store.get_file("big/obj", dest, max_bytes=4096)
    assert not dest.exists() and not list(tmp_path.iterdir())
    assert await store.get_file("big/obj", dest, max_bytes=len(data)) == len(data)
    assert dest.read_bytes() == data
    with pytest.raises(ValueError):
        await store.get("big/obj", max_bytes=-1)


@pytest.mark.integration
@pytest.mark.parametrize("create_only", [False, True])
async def test_multipart_completion_whose_response_is_lost(
    s3_factory: StoreFactory, tmp_path: Path, create_only: bool
) -> None:
    """The server completes the upload but its response is lost, and the retry is told NoSuchUpload:
    the object landed, so the put succeeded (issue 12, item 9).

    Faults injected on the real client: the first completion's response is dropped after the server
    acted on it, and the retry names the upload id as consumed (SeaweedFS itself answers a repeated
    completion with 200 for a while; AWS and others forget the id): the server's real 404 NoSuchUpload.
    """
    from botocore.exceptions import ConnectionClosedError

    store = s3_factory(**SMALL_PARTS)
    assert isinstance(store, S3Store)
    src = tmp_path / "state.bin"
    src.write_bytes(os.urandom(11 * MiB))  # 3 parts
    lost: list[int] = []
    answers: list[str] = []

    def lose_response(http_response: object = None, parsed: dict | None = None, **_: object) -> None:
        answers.append(str((parsed or {}).get("Error", {}).get("Code", "OK")))
        if not lost:  # the first completion reached the server; its answer never arrives
            lost.append(1)
            raise ConnectionClosedError(endpoint_url="injected: connection closed after the server completed")

    def consumed(params: dict, **_: object) -> None:
        if lost:
            params["UploadId"] = f"consumed-{params['UploadId']}"

    events = store._client.meta.events
    events.register("after-call.s3.CompleteMultipartUpload", lose_response)
    events.register("provide-client-params.s3.CompleteMultipartUpload", consumed)
    await store.put_file("big", src, if_none_match=create_only)
    assert answers == ["OK", "NoSuchUpload"]
    dest = tmp_path / "back.bin"
    await store.get_file("big", dest)
    assert dest.read_bytes() == src.read_bytes()
    # Not ours: the first completion never reaches the server, the retry is told NoSuchUpload, and
    # another object stands at the key: the put fails.
    def never_sent(**_: object) -> None:
        if not lost:
            lost.append(1)
            raise ConnectionClosedError(endpoint_url="injected: connection closed before sending")

    events.unregister("after-call.s3.CompleteMultipartUpload", lose_response)
    events.register("before-send.s3.CompleteMultipartUpload", never_sent)
    lost.clear()
    await store.put("big", b"someone else's", timeout=10)
    with pytest.raises(ConditionFailed if create_only else ObjectNotFound):
        await store.put_file("big", src, if_none_match=create_only)
    assert await store.get("big", timeout=10) == b"someone else's"


async def test_get_stream_hands_the_object_over_in_order_as_it_lands(store_factory: StoreFactory) -> None:
    """A reader may decode the front while the back is on the wire: chunks reach the sink in order,
    the first long before the last; on S3 it is one GET and no HEAD."""
    data = os.urandom(5 * MiB + 123)
    await store_factory().put("obj", data)
    slow = store_factory(link_mbps=40)  # ~1.05 s for the object
    t0, landed, got = time.perf_counter(), [], bytearray()

    def sink(chunk: bytes) -> None:
        landed.append(time.perf_counter() - t0)
        got.extend(chunk)

    assert await slow.get_stream("obj", sink, max_bytes=len(data)) == len(data)
    assert bytes(got) == data and len(landed) >= 5
    assert landed[0] < 0.5 * landed[-1]
    if isinstance(slow, S3Store):
        assert (slow.requests.get, slow.requests.head) == (1, 0)
    empty: list[bytes] = []
    await store_factory().put("empty", b"")
    assert await slow.get_stream("empty", empty.append, max_bytes=10) == 0 and empty == []


async def test_get_stream_refuses_more_than_max_bytes_before_its_excess(store: ObjectStore) -> None:
    data = os.urandom(3 * MiB)
    await store.put("obj", data)
    got = bytearray()
    with pytest.raises(ObjectTooLarge):
        await store.get_stream("obj", got.extend, max_bytes=len(data) - 1, chunk=MiB)
    assert len(got) <= len(data) - 1 and bytes(got) == data[: len(got)]
    with pytest.raises(ObjectNotFound):
        await store.get_stream("missing", got.extend, max_bytes=10)


@pytest.mark.integration
async def test_s3_get_stream_resumes_a_cut_body_from_what_it_handed_over(s3_factory: StoreFactory) -> None:
    """A body cut mid-read (the connection drops) is retried from the bytes already handed over,
    with a Range pinned to the first answer's ETag, not from the start."""
    data = os.urandom(4 * MiB)
    store = s3_factory(backoff_base_s=0.01)
    await store.put("obj", data)
    real, calls = store._client.get_object, []

    class CutBody:
        def __init__(self, body: object) -> None:
            self.body, self.read_bytes = body, 0

        def read(self, n: int) -> bytes:
            if self.read_bytes >= 2 * MiB:
                raise bex.ResponseStreamingError(error="connection reset mid-body")
            chunk = self.body.read(n)  # type: ignore[attr-defined]
            self.read_bytes += len(chunk)
            return chunk

        def __enter__(self) -> CutBody:
            return self

        def __exit__(self, *exc: object) -> None:
            self.body.close()  # type: ignore[attr-defined]

    def get_object(**kwargs: object) -> dict:
        calls.append(kwargs)
        resp = real(**kwargs)
        return resp | {"Body": CutBody(resp["Body"])} if len(calls) == 1 else resp

    store._client.get_object = get_object  # type: ignore[method-assign]
    got = bytearray()
    assert await store.get_stream("obj", got.extend, max_bytes=len(data), chunk=MiB) == len(data)
    assert bytes(got) == data
    assert len(calls) == 2 and calls[1]["Range"] == f"bytes={2 * MiB}-" and str(calls[1]["IfMatch"]).strip('"')
