"""PULSELoCo with real trainer processes on the embedded S3 server: agreement, stragglers, SIGKILL + resume."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pulsenet.loco import RoundStore
from pulsenet.loco.documents import trainer_keys
from pulsenet.loco.layout import LocoLayout
from pulsenet.signing import load_private_key
from pulsenet.store import S3Store
from pulsenet.store.seaweed import SeaweedServer
from tests.support.loco_helpers import make_keys, published_digests, spawn, trainer_args
from tests.support.store import TEST_BUCKET, unique_prefix

pytestmark = pytest.mark.integration
IDS = ("a", "b", "c")


class Run:
    """One PULSELoCo run on its own prefix of the test bucket, with its keys, state dirs and logs."""

    def __init__(self, seaweed: SeaweedServer, request: pytest.FixtureRequest, tmp: Path) -> None:
        self.prefix = unique_prefix(request)
        self.url = f"s3://{TEST_BUCKET}/{self.prefix}"
        cfg = seaweed.config("admin")
        self.s3 = cfg
        self.env = {
            "AWS_ENDPOINT_URL": str(cfg.endpoint_url),
            "AWS_ACCESS_KEY_ID": str(cfg.access_key_id),
            "AWS_SECRET_ACCESS_KEY": str(cfg.secret_access_key),
            "AWS_REGION": cfg.region,
        }
        self.tmp = tmp
        self.keys, self.pubs = make_keys(tmp / "keys", IDS)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, tid: str, rounds: int, extra: list[str], *, worker: bool = False) -> None:
        argv = trainer_args(
            self.url, tid, self.keys, self.pubs, self.tmp / "state" / tid,
            workers=len(IDS), rounds=rounds, report=self.report_path(tid), extra=extra,
        )  # fmt: skip
        self.procs[tid] = spawn(argv, self.env, self.log_path(tid), worker=worker)

    def report_path(self, tid: str) -> Path:
        return self.tmp / f"report-{tid}.json"

    def log_path(self, tid: str) -> Path:
        return self.tmp / f"{tid}.log"

    def reports(self, tid: str) -> list[dict]:
        return json.loads(self.report_path(tid).read_text())

    def wait(self, timeout: float) -> None:
        until = time.monotonic() + timeout
        for tid, proc in self.procs.items():
            try:
                rc = proc.wait(max(1.0, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_all()
                pytest.fail(f"trainer {tid} did not finish in {timeout} s; log:\n{self.tail(tid)}")
            assert rc == 0, f"trainer {tid} exited {rc}; log:\n{self.tail(tid)}"

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def tail(self, tid: str, n: int = 40) -> str:
        return "\n".join(self.log_path(tid).read_text(errors="replace").splitlines()[-n:])

    def round_store(self) -> RoundStore:
        store = S3Store(TEST_BUCKET, self.prefix, self.s3)
        return RoundStore(store, "reader", load_private_key(self.keys["a"]), trainer_keys(self.pubs))


@pytest.fixture
def run(seaweed: SeaweedServer, request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    r = Run(seaweed, request, tmp_path)
    yield r
    r.kill_all()


async def _digests_and_records(
    run: Run, rounds: int
) -> tuple[dict[int, dict[str, str]], dict[int, list[str]]]:
    rs = run.round_store()
    try:
        digests = await published_digests(rs, IDS, range(1, rounds + 1))
        records = {}
        for r in range(1, rounds + 1):
            rec = await rs.read_record(r)
            assert rec is not None, f"round {r} has no record"
            records[r] = sorted(rec.participants)
        return digests, records
    finally:
        await rs.store.close()


@pytest.mark.timeout(240)
async def test_three_trainer_processes_agree_after_every_round(run: Run) -> None:
    rounds = 10
    for tid in IDS:
        run.start(tid, rounds, ["--deadline", "20"])
    await asyncio.to_thread(run.wait, 200)
    digests, records = await _digests_and_records(run, rounds)
    for r in range(1, rounds + 1):
        assert len(set(digests[r].values())) == 1, f"round {r}: digests differ: {digests[r]}"
        assert set(records[r]) <= set(digests[r]), f"round {r}: a participant published no digest"
    assert set(digests[rounds]) == set(IDS)
    assert all(records[r] == list(IDS) for r in range(1, rounds + 1)), records
    finals = {tid: run.reports(tid)[-1] for tid in IDS}
    assert {f["round"] for f in finals.values()} == {rounds}
    assert len({f["digest"] for f in finals.values()}) == 1
    sent = [rep["sent"] / rep["total"] for rep in run.reports("a")]
    assert all(0 < f <= 1 for f in sent)


@pytest.mark.timeout(240)
async def test_straggler_misses_the_deadline_and_rejoins(run: Run) -> None:
    rounds, hold_round = 6, 3
    for tid in IDS:
        extra = ["--deadline", "3"]
        if tid == "c":
            extra += ["--hold-round", str(hold_round), "--hold-s", "8"]
        run.start(tid, rounds, extra, worker=True)
    await asyncio.to_thread(run.wait, 200)
    digests, records = await _digests_and_records(run, rounds)
    assert records[hold_round] == ["a", "b"], records  # the quorum went ahead without c
    assert any("c" in records[r] for r in range(hold_round + 1, rounds + 1)), f"c never rejoined: {records}"
    for r in range(1, rounds + 1):
        assert len(set(digests[r].values())) == 1, f"round {r}: digests differ: {digests[r]}"
    assert set(digests[rounds]) == set(IDS)
    c = {rep["round"]: rep for rep in run.reports("c")}
    assert c[rounds]["digest"] == run.reports("a")[-1]["digest"]
    # c finished its held round late: it closed it (the record stood without it) before catching up
    assert hold_round in c, f"c reported no round {hold_round}: {sorted(c)}"
    assert not c[hold_round]["included"], c[hold_round]
    assert "holding round 3" in run.log_path("c").read_text()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("extra", [[], ["--overlap"]], ids=["synchronous", "overlapped"])
async def test_sigkilled_trainer_resumes_and_ends_digest_equal(run: Run, extra: list[str]) -> None:
    """Overlapped: c dies with round 5's inner phase under way, and resumes from a point whose
    inner optimizer is a round ahead (its redone payload may differ: the stored one stands)."""
    rounds, kill_round = 7, 4
    for tid in IDS:
        run.start(tid, rounds, ["--deadline", "3", *extra])
    rs = run.round_store()
    try:
        # Kill c mid-round: its round-4 payload is published, the round is not finished.
        until = time.monotonic() + 150
        while not await rs.store.exists(LocoLayout().manifest("c", kill_round)):
            assert time.monotonic() < until, f"c never reached round {kill_round}:\n{run.tail('c')}"
            assert run.procs["c"].poll() is None, run.tail("c")
            await asyncio.sleep(0.05)
        run.procs["c"].send_signal(signal.SIGKILL)
        await asyncio.to_thread(run.procs["c"].wait)
    finally:
        await rs.store.close()
    assert run.procs["c"].returncode == -signal.SIGKILL
    run.start("c", rounds, ["--deadline", "3", *extra])  # same state dir: resume
    await asyncio.to_thread(run.wait, 200)
    digests, _ = await _digests_and_records(run, rounds)
    for r in range(1, rounds + 1):
        assert len(set(digests[r].values())) == 1, f"round {r}: digests differ: {digests[r]}"
    assert set(digests[rounds]) == set(IDS)
    log = run.log_path("c").read_text()
    assert "resumed from round" in log
    resumed = run.reports("c")
    assert resumed and resumed[0]["round"] >= kill_round and resumed[-1]["round"] == rounds
